"""Shared fixtures: the offline demo kit (tiny Qwen3 + char tokenizer + synthetic chats)."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def demo_kit(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("kit")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "data.make_demo",
            str(out),
            "--train",
            "160",
            "--eval",
            "10",
            "--hidden",
            "64",
            "--layers",
            "2",
        ],
        cwd=REPO,
        check=True,
        capture_output=True,
    )
    return out


def run_train(args: list[str], *, nproc: int = 1, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run train.py as users do: plain python for one process, torchrun for several."""
    if nproc == 1:
        cmd = [sys.executable, "train.py", *args]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            "train.py",
            *args,
        ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"train.py failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc
