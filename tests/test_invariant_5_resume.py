"""Invariant 5: N steps + resume + M steps == N + M uninterrupted (losses, lr, weights)."""

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import read_metrics, run_train, train_py_error
from tests.train_args import train_args
from train.metrics import RunLogger

pytestmark = pytest.mark.e2e  # a whole program, server or long sweep: `pytest -m 'not e2e'` skips it


def test_resume_continues_the_same_run(demo_kit, tmp_path):
    common = dict(pack=True, grad_accum=2, lr="2e-3", warmup=1, max_steps=4, weight_decay=0.1)
    full, part = tmp_path / "full", tmp_path / "resumed"
    run_train(train_args(demo_kit, full, **common, save_every=2), nproc=2)
    run_train(train_args(demo_kit, part, **common, resume=full / "step_2"), nproc=2)
    a, b = read_metrics(full), read_metrics(part)
    assert sorted(b) == [3, 4]
    for step in (3, 4):
        for key in ("loss", "diff", "ar", "lr", "grad_norm"):
            assert abs(a[step][key] - b[step][key]) <= 1e-6 * max(1.0, abs(a[step][key])), (step, key)
    assert a[3]["loss"] != a[2]["loss"]
    wa, wb = load_file(str(full / "final" / "model.safetensors")), load_file(str(part / "final" / "model.safetensors"))
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=1e-6)


def _steps(run) -> list[int]:
    return [r["step"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())]


def test_resume_logs_each_step_once(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2, 3, 4)))
    logger = RunLogger(run, enabled=True, max_steps=5, start_step=2)
    for step in (3, 4, 5):
        logger.step({"step": step, "loss": 0.5, "diff": 0.5, "ar": 0.5, "lr": 1e-3, "tokens_per_s": 1.0})
    logger.close()
    assert _steps(run) == [1, 2, 3, 4, 5]


def test_resume_in_the_run_directory_logs_once_and_guards_the_schedule(demo_kit, tmp_path, capfd):
    common = dict(lr="1e-3", max_steps=3)
    run = tmp_path / "run"
    run_train(train_args(demo_kit, run, **common, save_every=2))
    # A run killed after step 3 restarts from step_2: step 3 is logged once.
    run_train(train_args(demo_kit, run, **common, resume=run / "step_2"))
    assert _steps(run) == [1, 2, 3]

    changed = train_args(demo_kit, run, lr="2e-3", max_steps=4, warmup=1, lr_min_ratio=0.5, resume=run)
    lines = train_py_error(changed, capfd)
    assert not any("Traceback" in x for x in lines), lines
    (line,) = [x for x in lines if x.startswith("train.py: error:")]
    for flag, old, new in (
        ("--max_steps", 3, 4),
        ("--lr", 0.001, 0.002),
        ("--warmup", 0, 1),
        ("--lr_min_ratio", 0.1, 0.5),
    ):
        assert f"{flag} {old} -> {new}" in line, line
    assert "--allow_schedule_change" in line
    assert _steps(run) == [1, 2, 3]

    run_train([*changed, "--allow_schedule_change"])
    assert _steps(run) == [1, 2, 3, 4]
    changes = json.loads((run / "run_config.json").read_text())["schedule_changes"]
    assert changes == {"max_steps": [3, 4], "lr": [0.001, 0.002], "warmup": [0, 1], "lr_min_ratio": [0.1, 0.5]}


def test_a_damaged_newest_checkpoint_resumes_from_the_one_before_with_a_warning(demo_kit, tmp_path):
    """A truncated shard of the newest checkpoint stopped the resume with EOFError; now its run goes on from the
    checkpoint before it, says which one it passed over, logs each step once and rewrites the damaged one."""
    run = tmp_path / "run"
    run_train(train_args(demo_kit, run, max_steps=2, save_every=1))
    shard = run / "final" / "train_state" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    proc = run_train(train_args(demo_kit, run, max_steps=2, resume=run))
    out = proc.stdout + proc.stderr
    assert f"warning: --resume: {run / 'final'} is damaged" in out, out[-3000:]
    assert _steps(run) == [1, 2]
    shard_size = (run / "final" / "train_state" / "__0_0.distcp").stat().st_size
    assert shard_size == (run / "step_1" / "train_state" / "__0_0.distcp").stat().st_size
