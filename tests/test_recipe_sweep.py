"""benchmark/recipe_sweep.py at the smallest scale: arms train on one base within their budget, the trainer
scores each one's final weights with the drafting metric, and the table holds every arm to the base's AR
held-out loss (a draft adapter keeps it exactly; full fine-tuning moves it)."""

import argparse
import json

import pytest

from benchmark import recipe_sweep

pytestmark = pytest.mark.e2e  # a whole program, server or long sweep: `pytest -m 'not e2e'` skips it


def test_arm_names_and_flags_parse_or_fail_by_name():
    assert recipe_sweep.parse_arm("lr_1e-4=--lr 1e-4 --bd_size 4") == ("lr_1e-4", ["--lr", "1e-4", "--bd_size", "4"])
    for bad in ("--lr 1e-4", "=--lr 1", "a b=--lr 1"):
        with pytest.raises(argparse.ArgumentTypeError, match="NAME=FLAGS"):
            recipe_sweep.parse_arm(bad)


def test_arms_are_scored_by_the_drafting_metric_against_the_base(demo_kit, tmp_path, capsys):
    out = tmp_path / "sweep"
    argv = [
        "--base", str(demo_kit / "base_model"),
        "--data", str(demo_kit / "train.jsonl"),
        "--eval-data", str(demo_kit / "eval.jsonl"),
        "--eval-samples", "6",
        "--budget-min", "0.01",
        "--common", "--bd_size 4 --max_length 192 --ar_loss_weight 0.5",
        "--arm", "full=--lr 3e-2",
        "--arm", "adapter=--draft_adapter --lora_rank 4 --lr 3e-2",
        "--out", str(out),
    ]  # fmt: skip
    assert recipe_sweep.main(argv) == 0
    record = json.loads((out / "sweep.json").read_text())
    base, full, adapter = record["arms"]
    assert [r["arm"] for r in record["arms"]] == ["base", "full", "adapter"]
    for r in record["arms"]:
        assert 0 <= r["draft_first_accept"] <= 1 and 1 <= r["draft_tpf_linear"] <= r["draft_tpf_all"] + 1e-9
    assert base["steps"] == 1 and full["steps"] >= 2 and adapter["steps"] >= 2
    # the adapter's clean stream is the base bit for bit; lr 3e-2 on every weight is not
    assert adapter["eval_ar_loss"] == pytest.approx(base["eval_ar_loss"], rel=1e-5)
    assert abs(full["eval_ar_loss"] - base["eval_ar_loss"]) > 1e-3
    text = capsys.readouterr().out
    line = {r.split(" | ")[0].strip("| "): r for r in text.splitlines() if r.startswith("| ")}
    assert "| yes |" in line["adapter"]
    assert ("| yes |" in line["full"]) == (full["eval_ar_loss"] <= base["eval_ar_loss"] + 1e-4)
    assert "python -m benchmark.recipe_sweep" in text and (out / "sweep.md").is_file()
    with pytest.raises(SystemExit):
        recipe_sweep.main([*argv, "--arm", "base=--lr 1"])
