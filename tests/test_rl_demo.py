"""`benchmark/rl_demo.py` (`make demo-rl`) at the smallest scale: a converted tiny checkpoint, two RL steps,
the before/after table per decode mode and the rollout-vs-engine cost."""

import json

import pytest

from tests.conftest import run_train
from tests.train_args import train_args

pytestmark = pytest.mark.e2e


def test_rl_demo_prints_before_and_after(demo_kit, tmp_path, capsys):
    from benchmark.rl_demo import main

    start = tmp_path / "bd"
    run_train(train_args(demo_kit, start, max_steps=2, lr="1e-3"))
    flags = "--rl_diffusion_rollout --rl_group_size 2 --rl_prompts_per_step 2 --rl_max_new_tokens 8 --lr 1e-3"
    argv = ["--start", str(start / "final"), "--data", str(demo_kit / "train.jsonl"), "--heldout"]
    argv += [str(demo_kit / "eval.jsonl"), "--minutes", "0.01", "--bd-size", "4", "--limit", "3", "--max-tokens", "8"]
    argv += ["--rl-flags", flags, "--threshold", "0.5", "--out", str(tmp_path / "rl")]
    argv += ["--sft-baseline", "--sft-flags", "--lr 1e-3 --warmup 2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "| before |" in out and "| after RL |" in out and "| after SFT, same time |" in out
    assert "rollout / engine" in out and "diffusion accuracy (threshold 0.5)" in out
    saved = json.loads((tmp_path / "rl" / "rl_demo.json").read_text())
    calibration = [json.loads(x) for x in (tmp_path / "rl" / "calibrate" / "metrics.jsonl").read_text().splitlines()]
    assert len(calibration) == 3
    mean = sum(r["step_time_s"] for r in calibration[1:]) / 2  # the first step's warm-up left out
    assert saved["steps"] == max(2, int(0.6 / mean)), "sized by the calibration run"
    assert saved["rows"]["after RL"]["self-spec"]["same_as_causal"] == 1.0
    assert (tmp_path / "rl" / "rl" / "final" / "block_diffusion.json").is_file()
    assert {row["threshold"] for row in saved["rows"].values()} == {0.5}, "evaluated at the rollouts' threshold"
    # the rollouts ran at the threshold the table evaluates
    assert json.loads((tmp_path / "rl" / "rl" / "run_config.json").read_text())["rl_threshold"] == 0.5
    # the SFT baseline started from the same checkpoint, sized by its own calibration to the RL run's wall time
    sft_calibration = [
        json.loads(x) for x in (tmp_path / "rl" / "calibrate-sft" / "metrics.jsonl").read_text().splitlines()
    ]
    sft_mean = sum(r["step_time_s"] for r in sft_calibration[1:]) / 2
    assert saved["sft_steps"] == max(2, int(saved["wall_s"] / sft_mean))
    sft_config = json.loads((tmp_path / "rl" / "sft" / "run_config.json").read_text())
    assert sft_config["model_id"] == str(start / "final") and sft_config["recipe"] == "sft"
