"""`train.py --lora_rank R [--draft_adapter]` end to end: under FSDP2 on two ranks the draft adapter trains
while the saved base stays the base model bit for bit, and the served checkpoint decodes causal and
greedy self-spec exactly as the base model; a plain LoRA run saves merged stock weights; a resumed run
continues the uninterrupted one exactly."""

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from bdcore.decode.config import DecodeConfig
from bdcore.decode.sampling import SamplingParams
from bdcore.draft_adapter import ADAPTER_DIR, MASK_ROW, MASK_ROW_FILE
from bdcore.loading import load_checkpoint
from inference.native.engine import Engine
from tests.conftest import read_metrics, run_train
from tests.test_invariant_4_self_spec import _prompts
from tests.train_args import train_args

pytestmark = pytest.mark.e2e  # a whole program, server or long sweep: `pytest -m 'not e2e'` skips it

LORA = dict(lora_rank=4, lr="5e-3")


def _weights(path):
    return AutoModelForCausalLM.from_pretrained(path).state_dict()


def test_draft_adapter_trains_and_the_base_stays_the_base(demo_kit, tmp_path):
    run = tmp_path / "draft"
    run_train(train_args(demo_kit, run, max_steps=3, draft_adapter=True, **LORA), nproc=2)
    final = run / "final"
    base, saved = _weights(demo_kit / "base_model"), _weights(final)
    ckpt = load_checkpoint(final)
    mask_id = ckpt.mask_id
    for key, value in base.items():
        got = saved[key]
        if "embed_tokens" in key or "lm_head" in key:  # the <|mask|> row is new (or a reused padding row)
            n = value.shape[0]
            keep = torch.arange(n) != mask_id
            assert torch.equal(got[:n][keep], value[keep]), key
        else:
            assert torch.equal(got, value), key
    adapter = load_file(str(final / ADAPTER_DIR / "adapter_model.safetensors"))
    assert any("lora_B" in k and v.abs().sum() > 0 for k, v in adapter.items()), "the adapter trained"
    row = load_file(str(final / ADAPTER_DIR / MASK_ROW_FILE))[MASK_ROW]
    assert not torch.equal(row, saved["model.embed_tokens.weight"][mask_id]), "the <|mask|> row trained"
    assert read_metrics(run)[3]["ar"] == 0.0  # no AR term: the clean stream is the frozen base
    # Served: causal and greedy self-spec are the base model's output.
    plain = load_checkpoint(demo_kit / "base_model")
    params = SamplingParams(max_tokens=16)
    want = Engine(plain, DecodeConfig(mode="causal"))
    for mode in ("causal", "self-spec"):
        engine = Engine(ckpt, DecodeConfig(mode=mode))
        for ids in _prompts(ckpt.tokenizer, 4, seed=1):
            assert engine.generate(ids, params).tokens == want.generate(ids, params).tokens, mode


def test_plain_lora_saves_merged_stock_weights(demo_kit, tmp_path):
    run = tmp_path / "plain"
    run_train(train_args(demo_kit, run, max_steps=2, **LORA))
    final = run / "final"
    assert not (final / ADAPTER_DIR).exists() and load_checkpoint(final).sidecar.draft_adapter is None
    base, saved = _weights(demo_kit / "base_model"), _weights(final)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(saved[q], base[q]), "the LoRA delta is merged into the projection"
    assert torch.equal(saved["model.norm.weight"], base["model.norm.weight"]), "what LoRA does not adapt stays"


def test_draft_adapter_resume_continues_the_same_run(demo_kit, tmp_path):
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    flags = dict(LORA, draft_adapter=True, save_every=2, max_steps=4)
    run_train(train_args(demo_kit, full, **flags))
    run_train(train_args(demo_kit, resumed, **flags, resume=full / "step_2"))
    a, b = read_metrics(full), read_metrics(resumed)
    for s in (3, 4):
        assert b[s]["loss"] == pytest.approx(a[s]["loss"], rel=1e-6, abs=1e-9)
    for name in ("adapter_model.safetensors", MASK_ROW_FILE):
        want = load_file(str(full / "final" / ADAPTER_DIR / name))
        got = load_file(str(resumed / "final" / ADAPTER_DIR / name))
        for k in want:
            torch.testing.assert_close(got[k], want[k], atol=1e-6, rtol=1e-6)


def test_opd_with_a_draft_adapter_needs_no_second_model(demo_kit, tmp_path):
    run = tmp_path / "opd"
    opd = dict(opd_on_policy=True, opd_prompts_per_step=2, opd_max_new_tokens=12, opd_slots="masked")
    run_train(train_args(demo_kit, run, max_steps=2, draft_adapter=True, **LORA, **opd))
    for record in read_metrics(run).values():
        assert record["opd_kl"] > 0 and record["opd_ar_kl"] == 0.0  # the teacher is the clean stream itself
        assert record["t_teacher_s"] < 1e-3, "no teacher forward"


def test_draft_adapter_with_activation_checkpointing_trains_as_without(demo_kit, tmp_path):
    """Backward recomputes each layer after the forward's `draft_rows` context has exited; the recomputed
    adapter must still act at the drafting rows only, so both runs take the same steps."""
    runs = {}
    for recompute in (False, True):
        runs[recompute] = tmp_path / f"recompute_{recompute}"
        flags = dict(LORA, draft_adapter=True, max_steps=2, activation_checkpointing=recompute)
        run_train(train_args(demo_kit, runs[recompute], **flags))
    a, b = read_metrics(runs[False]), read_metrics(runs[True])
    for s in (1, 2):
        assert b[s]["loss"] == pytest.approx(a[s]["loss"], rel=1e-5)
        assert b[s]["grad_norm"] == pytest.approx(a[s]["grad_norm"], rel=1e-4)
    want = load_file(str(runs[False] / "final" / ADAPTER_DIR / "adapter_model.safetensors"))
    got = load_file(str(runs[True] / "final" / ADAPTER_DIR / "adapter_model.safetensors"))
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=1e-5, rtol=1e-4)


def test_a_uno_layout_adapter_trains_and_serves_self_spec_losslessly(demo_kit, tmp_path):
    """`--canvas_fill noise --within_block_causal` (the draft layout of SGLang's UNO, docs/design.md 8.21): the
    run's rows and its held-out metric fill canvases with noise, the sidecar records it, served self-spec is
    the base model's output and diffusion is refused."""
    from bdcore.serving_gate import CannotServe

    run = tmp_path / "uno"
    flags = dict(LORA, draft_adapter=True, canvas_fill="noise", within_block_causal=True, max_steps=2)
    run_train(train_args(demo_kit, run, eval_data=demo_kit / "eval.jsonl", eval_samples=3, **flags))
    ckpt = load_checkpoint(run / "final")
    sidecar = ckpt.sidecar
    assert (sidecar.canvas_fill, sidecar.within_block_causal, sidecar.views) == ("noise", True, 1)
    assert read_metrics(run)[2]["draft_first_accept"] >= 0.0  # the metric ran, on noise-filled canvases
    plain = load_checkpoint(demo_kit / "base_model")
    params = SamplingParams(max_tokens=16)
    want, engine = Engine(plain, DecodeConfig(mode="causal")), Engine(ckpt, DecodeConfig(mode="self-spec"))
    for ids in _prompts(ckpt.tokenizer, 4, seed=1):
        assert engine.generate(ids, params).tokens == want.generate(ids, params).tokens
    with pytest.raises(CannotServe, match="canvas_fill"):
        Engine(ckpt, DecodeConfig(mode="diffusion"))
