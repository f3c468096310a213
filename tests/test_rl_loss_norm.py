"""DAPO's token-level mean (and GRPO's per-trajectory mean) is over the global batch: under FSDP2 on two
ranks whose rollouts differ in length, the gradient equals the one-rank run's on the same rollouts."""

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.e2e  # torchrun


def test_two_ranks_give_the_gradient_of_the_one_rank_loss(tmp_path):
    out = tmp_path / "diff.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    proc = subprocess.run(
        [*cmd, "tests/distributed/rl_loss_norm.py", str(out)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},  # the script's own folder is sys.path[0], not the checkout
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    diff = json.loads(out.read_text())
    assert diff["token"] < 1e-6 and diff["trajectory"] < 1e-6, diff
