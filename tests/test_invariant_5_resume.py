"""Invariant 5: N steps + resume + M steps == N + M uninterrupted (losses, lr, weights)."""

import json

import torch
from safetensors.torch import load_file

from tests.conftest import read_metrics, run_train


def test_resume_continues_the_same_run(demo_kit, tmp_path):
    common = [
        "--model_id",
        str(demo_kit / "base_model"),
        "--dataset",
        str(demo_kit / "train.jsonl"),
        "--bd_size",
        "4",
        "--max_length",
        "192",
        "--pack",
        "--grad_accum",
        "2",
        "--lr",
        "2e-3",
        "--warmup",
        "1",
        "--max_steps",
        "4",
        "--weight_decay",
        "0.1",
    ]
    full, part = tmp_path / "full", tmp_path / "resumed"
    run_train([*common, "--save_every", "2", "--save_dir", str(full)], nproc=2)
    run_train([*common, "--save_dir", str(part), "--resume", str(full / "step_2")], nproc=2)
    a, b = read_metrics(full), read_metrics(part)
    assert sorted(b) == [3, 4]
    for step in (3, 4):
        for key in ("loss", "diff", "ar", "lr", "grad_norm"):
            assert abs(a[step][key] - b[step][key]) <= 1e-6 * max(1.0, abs(a[step][key])), (step, key)
    assert a[3]["loss"] != a[2]["loss"]
    wa, wb = load_file(str(full / "final" / "model.safetensors")), load_file(str(part / "final" / "model.safetensors"))
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=1e-6)


def test_resume_from_a_run_directory_uses_latest(demo_kit, tmp_path):
    common = [
        "--model_id",
        str(demo_kit / "base_model"),
        "--dataset",
        str(demo_kit / "train.jsonl"),
        "--bd_size",
        "4",
        "--max_length",
        "192",
        "--lr",
        "1e-3",
    ]
    run = tmp_path / "run"
    run_train([*common, "--max_steps", "2", "--save_dir", str(run)])
    run_train([*common, "--max_steps", "3", "--save_dir", str(run), "--resume", str(run)])
    assert [r["step"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())] == [1, 2, 3]
