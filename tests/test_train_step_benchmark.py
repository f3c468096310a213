"""benchmark/train_step.py at the smallest size: the AR, block-diffusion and bf16 block-diffusion steps are
timed side by side and their ratios reported, each on the rows its objective builds (timings alone would
pass for a benchmark that timed the wrong rows)."""

import json
import subprocess
import sys

import pytest

from bdcore.loading import cpu_has_bf16

pytestmark = pytest.mark.e2e  # a whole program, server or long sweep: `pytest -m 'not e2e'` skips it


P, N, BD, DOCS = 16, 32, 8, 2 * 2  # prompt and response tokens per sample, block size, rows x docs per row


def _summary(*extra: str) -> dict:
    argv = ["--layers", "1", "--hidden", "64", "--vocab", "256", "--prompt", str(P), "--response", str(N)]
    argv += ["--bd_size", str(BD), "--rows", "2", "--docs_per_row", "2"]
    argv += ["--steps", "1", "--warmup", "0", "--threads", "1", "--json", *extra]
    out = subprocess.run(
        [sys.executable, "-m", "benchmark.train_step", *argv], capture_output=True, text=True, check=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def _check_rows(summary: dict, arms=("bd",)) -> None:
    """The AR step reads the clean stream (P + N tokens a sample) with an AR row per response token; the
    block-diffusion step adds two complementary noised views of the response (2N tokens a sample), whose
    masked slots are every response token but each block's seed (docs/design.md section 2)."""
    assert summary["ar_tokens"] == DOCS * (P + N) and summary["bd_tokens"] == DOCS * (P + 3 * N)
    assert summary["token_ratio"] == summary["bd_tokens"] / summary["ar_tokens"]
    assert summary["rows"]["ar"] == [DOCS * N, 0]
    for arm in arms:
        assert summary["rows"][arm] == [DOCS * N, DOCS * (N - N // BD)]


def test_train_step_benchmark_times_a_mixture_of_experts():
    """`--arch qwen3_moe` builds the MoE (8 experts of width 64 in place of one MLP of width 192: the
    parameter count says which model was timed) and times both steps."""
    dense, moe = _summary(), _summary("--arch", "qwen3_moe", "--experts", "8")
    h = 64
    assert moe["params"] - dense["params"] == 8 * 3 * h * h + 8 * h - 3 * h * 3 * h  # experts + router - MLP
    assert moe["arch"] == "qwen3_moe" and moe["time_ratio"] > 0
    _check_rows(dense)
    _check_rows(moe)


@pytest.mark.skipif(not cpu_has_bf16(), reason="this CPU has no native bf16 (AVX512-BF16 / AMX)")
def test_train_step_benchmark_reports_the_bf16_speedup():
    summary = _summary("--bf16")
    assert summary["bd_bf16_step_s"] > 0 and summary["bf16_speedup"] > 0
    assert summary["time_ratio"] > 0
    _check_rows(summary, arms=("bd", "bd_bf16"))  # bf16 compute times the same rows as fp32
