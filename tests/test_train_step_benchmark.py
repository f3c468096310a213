"""benchmark/train_step.py at the smallest size: the AR, block-diffusion and bf16 block-diffusion steps are
timed side by side and their ratios reported."""

import json
import subprocess
import sys

import pytest

from train.build import cpu_has_bf16

pytestmark = pytest.mark.e2e  # a whole program, server or long sweep: `pytest -m 'not e2e'` skips it


def _summary(*extra: str) -> dict:
    argv = ["--layers", "1", "--hidden", "64", "--vocab", "256", "--prompt", "16", "--response", "32", "--bd_size", "8"]
    argv += ["--steps", "1", "--warmup", "0", "--threads", "1", "--json", *extra]
    out = subprocess.run(
        [sys.executable, "-m", "benchmark.train_step", *argv], capture_output=True, text=True, check=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_train_step_benchmark_times_a_mixture_of_experts():
    """`--arch qwen3_moe` builds the MoE (8 experts of width 64 in place of one MLP of width 192: the
    parameter count says which model was timed) and times both steps."""
    dense, moe = _summary(), _summary("--arch", "qwen3_moe", "--experts", "8")
    h = 64
    assert moe["params"] - dense["params"] == 8 * 3 * h * h + 8 * h - 3 * h * 3 * h  # experts + router - MLP
    assert moe["arch"] == "qwen3_moe" and moe["time_ratio"] > 0 and moe["token_ratio"] == dense["token_ratio"]


@pytest.mark.skipif(not cpu_has_bf16(), reason="this CPU has no native bf16 (AVX512-BF16 / AMX)")
def test_train_step_benchmark_reports_the_bf16_speedup():
    summary = _summary("--bf16")
    assert summary["bd_bf16_step_s"] > 0 and summary["bf16_speedup"] > 0
    assert summary["token_ratio"] > 1 and summary["time_ratio"] > 0
