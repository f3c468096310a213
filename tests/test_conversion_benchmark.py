"""benchmark/conversion.py end to end at the smallest scale: every arm trains on the same base within
its (tiny) budget and is evaluated side by side in one table."""

import json

import pytest
import torch

from bdcore.loading import load_checkpoint
from benchmark import conversion, conversion_eval
from tests.tiny import tiny_checkpoint

pytestmark = pytest.mark.e2e  # a whole program, server or long sweep: `pytest -m 'not e2e'` skips it


def _argv(kit, base, out, arms):
    return [
        "--base", str(base),
        "--sft-data", str(kit / "train.jsonl"),
        "--heldout", str(kit / "eval.jsonl"),
        "--budget-min", "0.01",
        "--limit", "3",
        "--max-tokens", "8",
        "--train-flags", "--bd_size 4 --ar_loss_weight 0.2 --max_length 192 --lr 1e-3",
        "--opd-flags", "--opd_prompts_per_step 2 --opd_max_new_tokens 8",
        "--arms", arms,
        "--out", str(out),
    ]  # fmt: skip


def test_arms_train_on_one_base_and_are_evaluated_side_by_side(demo_kit, tmp_path, capsys):
    """The kit's random base never ends an answer, so its self-distilled set is empty: the two arms that
    need it are covered by the refusal below and by the demo-scale run in docs/history/results-notebook.md."""
    out = tmp_path / "conv"
    argv = _argv(demo_kit, demo_kit / "base_model", out, "sft,opd,sft_draft") + [
        "--lora-flags",
        "--lora_rank 4 --draft_adapter",
    ]
    assert conversion.main(argv) == 0
    record = json.loads((out / "conversion.json").read_text())
    assert [r["arm"] for r in record["arms"]] == ["sft", "opd", "sft_draft"]
    for r in record["arms"]:
        assert all(n >= 2 for n in r["steps"])
        for mode in ("causal", "diffusion", "self-spec"):
            assert r[mode]["tokens_per_forward"] > 0
        # causal decoding is the HF model's own greedy loop (`conversion_eval.stock_greedy`), so this holds
        # the engine's causal mode to it; greedy self-spec is lossless
        assert r["causal"]["same_as_causal"] == 1.0 and r["self-spec"]["same_as_causal"] == 1.0
    assert record["base"]["ar_loss"] > 0 and "diffusion" not in record["base"]
    sft, _, draft = record["arms"]
    # the draft adapter keeps the base: its AR loss and causal answers are the base's
    assert draft["ar_loss"] == pytest.approx(record["base"]["ar_loss"], rel=1e-5)
    assert draft["trainable_params"] < sft["trainable_params"] / 10 and draft["checkpoint_mb"] > 0
    assert all(r["peak_mem_mib"] > 0 and r["step_time_s"] > 0 for r in (sft, draft))
    text = capsys.readouterr().out
    assert "| opd |" in text and "python -m benchmark.conversion" in text
    # --eval-only evaluates what that run trained, without training again
    assert conversion.main([*argv, "--arms", "sft", "--eval-only"]) == 0
    again = json.loads((out / "conversion.json").read_text())["arms"]
    assert [r["arm"] for r in again] == ["sft"] and again[0]["steps"] == sft["steps"]
    assert again[0]["self-spec"]["tokens_per_forward"] == sft["self-spec"]["tokens_per_forward"]
    with pytest.raises(SystemExit, match="does not exist"):
        conversion.main([*argv, "--arms", "sft_self", "--eval-only"])


def test_self_distilled_arms_need_answers_the_base_finished(demo_kit, tmp_path):
    with pytest.raises(SystemExit, match="kept no self-distilled answer"):
        conversion.main(_argv(demo_kit, demo_kit / "base_model", tmp_path / "conv", "sft_self"))


def test_causal_decoding_is_the_stock_models_greedy_loop(demo_kit, tmp_path):
    """`same_as_causal` is measured against `stock_greedy` (the HF model alone, no engine), so the engine's
    causal mode is held to it too. On a random tiny checkpoint, whose answers differ from prompt to prompt
    (the trained arms above answer every prompt alike at this scale, so they cannot tell)."""
    ckpt = tiny_checkpoint(tmp_path / "c", bd_size=4)
    loaded = load_checkpoint(ckpt)
    heldout = conversion_eval.load_heldout(demo_kit / "eval.jsonl", loaded.tokenizer, 4)
    facts = dict(max_tokens=12, stop_ids=loaded.stop_ids, banned=loaded.mask_id)
    answers = [conversion_eval.stock_greedy(loaded.model, ids, **facts) for ids in heldout.prompt_ids]
    assert len({tuple(a) for a in answers}) == len(answers), "answers differ (a wrong decode would show)"
    for ids, answer in zip(heldout.prompt_ids, answers):  # the loop is Hugging Face's own greedy decoding
        out = loaded.model.generate(
            torch.tensor([ids]),
            max_new_tokens=12,
            do_sample=False,
            suppress_tokens=[loaded.mask_id],
            eos_token_id=sorted(loaded.stop_ids),
            pad_token_id=min(loaded.stop_ids),
        )[0, len(ids) :].tolist()
        assert [t for t in out[: len(answer) + 1] if t not in loaded.stop_ids] == answer
    row = conversion_eval.evaluate(ckpt, heldout, max_tokens=12, threshold=0.9)
    assert row["causal"]["same_as_causal"] == 1.0 and row["self-spec"]["same_as_causal"] == 1.0
