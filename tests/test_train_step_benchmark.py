"""benchmark/train_step.py at the smallest size: the AR, block-diffusion and bf16 block-diffusion steps are
timed side by side and their ratios reported."""

import json
import subprocess
import sys

import pytest

from train.build import cpu_has_bf16

pytestmark = pytest.mark.e2e  # a whole program, server or long sweep: `pytest -m 'not e2e'` skips it


@pytest.mark.skipif(not cpu_has_bf16(), reason="this CPU has no native bf16 (AVX512-BF16 / AMX)")
def test_train_step_benchmark_reports_the_bf16_speedup():
    argv = ["--layers", "1", "--hidden", "64", "--vocab", "256", "--prompt", "16", "--response", "32", "--bd_size", "8"]
    argv += ["--steps", "1", "--warmup", "0", "--threads", "1", "--bf16", "--json"]
    out = subprocess.run(
        [sys.executable, "-m", "benchmark.train_step", *argv], capture_output=True, text=True, check=True
    ).stdout
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["bd_bf16_step_s"] > 0 and summary["bf16_speedup"] > 0
    assert summary["token_ratio"] > 1 and summary["time_ratio"] > 0
