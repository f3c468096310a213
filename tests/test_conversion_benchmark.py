"""benchmark/conversion.py end to end at the smallest scale: every arm trains on the same base within
its (tiny) budget and is evaluated side by side in one table."""

import json

import pytest

from benchmark import conversion

pytestmark = pytest.mark.e2e  # a whole program, server or long sweep: `pytest -m 'not e2e'` skips it


def test_every_arm_trains_and_is_evaluated(demo_kit, tmp_path, capsys):
    out = tmp_path / "conv"
    argv = [
        "--base", str(demo_kit / "base_model"),
        "--sft-data", str(demo_kit / "train.jsonl"),
        "--heldout", str(demo_kit / "eval.jsonl"),
        "--budget-min", "0.01",
        "--limit", "3",
        "--max-tokens", "8",
        "--train-flags", "--bd_size 4 --ar_loss_weight 0.2 --max_length 192 --lr 1e-3",
        "--opd-flags", "--opd_prompts_per_step 2 --opd_max_new_tokens 8",
        "--out", str(out),
    ]  # fmt: skip
    assert conversion.main(argv) == 0
    record = json.loads((out / "conversion.json").read_text())
    assert [r["arm"] for r in record["arms"]] == list(conversion.ARMS)
    for r in record["arms"]:
        assert all(n >= 2 for n in r["steps"])
        for mode in ("causal", "diffusion", "self-spec"):
            assert r[mode]["tokens_per_forward"] > 0
        assert r["causal"]["same_as_causal"] == 1.0
    assert record["base"]["ar_loss"] > 0 and "diffusion" not in record["base"]
    text = capsys.readouterr().out
    assert "| sft_opd |" in text and "python -m benchmark.conversion" in text
