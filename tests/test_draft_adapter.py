"""Draft-only LoRA adapters: the clean stream and every kept row run the base model bit for bit, only the
adapter and the `<|mask|>` row train, the engine applies the adapter at canvas rows only (causal and greedy
self-spec output == the base model's; canvas logits == the training forward's), and a plain LoRA
conversion merges into stock weights that compute what the adapted model computes."""

import copy
import random

import pytest
import torch

from bdcore.decode.config import DecodeConfig
from bdcore.decode.sampling import SamplingParams
from bdcore.draft_adapter import ADAPTER_DIR, MASK_ROW, LoraSpec, add_lora, merged_state_dict
from bdcore.loading import load_checkpoint
from bdcore.sidecar import Sidecar, SidecarError, read_sidecar, write_sidecar
from benchmark.tiny import draft_checkpoint, randomize_adapter  # noqa: F401 (draft_checkpoint: other tests import it here)
from inference.native.engine import Engine
from tests.test_invariant_3_engine_denoise import check_engine_canvas_logits
from tests.test_invariant_4_self_spec import _prompts
from tests.tiny import FILLER_ID, MASK_ID, random_sample, tiny_checkpoint, tiny_hybrid_model, tiny_model
from train.config import BlockDiffusionConfig
from train.model import TwoStreamLM
from train.noise import noise_generator
from train.rows import SpecialIds, build_batch

ARCHS = ["qwen3", "qwen3_5"]


def adapted(model, *, draft_only=True, mask_id=MASK_ID, seed=0):
    add_lora(model, LoraSpec(rank=4, alpha=8, draft_only=draft_only), mask_id)
    randomize_adapter(model, seed)
    return model


def _batch(cfg):
    rng = random.Random(3)
    samples = [random_sample(rng, max_prompt=10, max_resp=14) for _ in range(3)]
    return build_batch([[s] for s in samples], cfg, SpecialIds(MASK_ID, FILLER_ID), noise_generator(5, 0, 0))


def _tiny(arch):
    return tiny_hybrid_model() if arch == "qwen3_5" else tiny_model(arch)


@pytest.mark.parametrize("arch", ARCHS)
def test_clean_stream_is_the_base_model_bit_for_bit(arch):
    base = _tiny(arch)
    model = adapted(copy.deepcopy(base))
    cfg = BlockDiffusionConfig(bd_size=4, ar_loss_weight=0.0, clean_causal=True)
    batch = _batch(cfg)
    with torch.no_grad():
        got = TwoStreamLM(model, cfg).hidden_states(batch)
        want = TwoStreamLM(base, cfg).hidden_states(batch)
    clean, noised = batch.meta.stream == 0, batch.meta.stream >= 1
    assert torch.equal(got[clean], want[clean])
    assert (got[noised] - want[noised]).abs().max() > 1e-2, "the adapter acts at the noised views"


def test_a_forward_that_does_not_say_which_rows_draft_is_refused():
    model = adapted(tiny_model())
    with pytest.raises(RuntimeError, match="draft_rows"):
        model(input_ids=torch.tensor([[1, 2, 3]]))


def test_only_the_adapter_and_the_mask_row_train():
    model = adapted(tiny_model())
    cfg = BlockDiffusionConfig(bd_size=4, ar_loss_weight=0.0, clean_causal=True)
    TwoStreamLM(model, cfg)(_batch(cfg)).loss.backward()
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n or n.endswith(MASK_ROW) for n in trained)
    assert any(n.endswith(MASK_ROW) for n in trained), "the <|mask|> row trains"
    for n, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and p.grad.abs().sum() > 0, n


@pytest.fixture(scope="module", params=ARCHS)
def pair(request, tmp_path_factory):
    """The same base served plainly and with a draft adapter."""
    plain = load_checkpoint(tiny_checkpoint(tmp_path_factory.mktemp("plain"), arch=request.param, bd_size=4))
    draft = load_checkpoint(draft_checkpoint(tmp_path_factory.mktemp("draft"), request.param))
    return plain, draft


def test_causal_and_greedy_self_spec_are_the_base_models_output(pair):
    plain, draft = pair
    params = SamplingParams(max_tokens=20)
    base = Engine(plain, DecodeConfig(mode="causal"))
    modes = {m: Engine(draft, DecodeConfig(mode=m, draft_len=4)) for m in ("causal", "self-spec", "diffusion")}
    plain_diffusion = Engine(plain, DecodeConfig(mode="diffusion"))
    differs = 0
    for ids in _prompts(plain.tokenizer, 8, seed=2):
        want = base.generate(ids, params)
        for mode in ("causal", "self-spec"):
            got = modes[mode].generate(ids, params)
            assert got.tokens == want.tokens and got.finish_reason == want.finish_reason, mode
        differs += modes["diffusion"].generate(ids, params).tokens != plain_diffusion.generate(ids, params).tokens
    assert differs > 0, "the adapter changes the drafts"


def test_forwards_without_drafting_rows_run_the_base_modules(pair, monkeypatch):
    """A served draft-adapter model runs a forward in which no row drafts (causal steps, prompts) on its base
    modules (`base_twin`): no adapted projection is called and the tokens are the base model's; forwards
    that draft still go through the adapter. Hybrid: the twin's gated-delta layers decode with its own
    projections (bound to the original's, they would call the adapter)."""
    from bdcore.draft_adapter import DraftGate

    plain, draft = pair
    calls = []  # every adapted projection asks the gate for its drafting rows
    plan = DraftGate.plan
    monkeypatch.setattr(DraftGate, "plan", lambda self, shape: calls.append(1) or plan(self, shape))
    params = SamplingParams(max_tokens=12)
    base = Engine(plain, DecodeConfig(mode="causal"))
    causal = Engine(draft, DecodeConfig(mode="causal"))
    prompts = _prompts(plain.tokenizer, 3, seed=5)
    for ids in prompts:
        assert causal.generate(ids, params).tokens == base.generate(ids, params).tokens
    assert calls == [], "a causal decode called the adapter"
    spec = Engine(draft, DecodeConfig(mode="self-spec", draft_len=4))
    for ids in prompts:
        assert spec.generate(ids, params).tokens == base.generate(ids, params).tokens
    assert calls, "drafting forwards run the adapter"


def test_batched_forwards_gate_each_row_as_one_request_alone(pair):
    """Padded batched forwards (clean and canvas rows of several requests) == each request alone, and the
    scheduler's batched generations == one at a time, in every mode."""
    from tests.test_scheduler import test_batched_equals_one_by_one, test_batched_logits_match_one_sequence_forwards

    _, draft = pair
    test_batched_logits_match_one_sequence_forwards(draft)
    test_batched_equals_one_by_one(draft, mix=True)


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen3_5"])
def test_engine_canvas_logits_equal_training_logits_with_the_adapter(arch):
    check_engine_canvas_logits(arch, True, False, adapt=adapted, atol=1e-4 if arch == "qwen3_5" else 2e-5)


def test_plain_lora_merges_into_stock_weights():
    model = adapted(tiny_model(), draft_only=False)
    merged = tiny_model()
    merged.load_state_dict(merged_state_dict(model, model.state_dict()))
    ids = torch.tensor([[3, MASK_ID, 7, 11, MASK_ID, 2]])
    with torch.no_grad():
        want, got = model(input_ids=ids).logits, merged(input_ids=ids).logits
    assert (want - tiny_model()(input_ids=ids).logits).abs().max() > 1e-2, "the adapter changes the model"
    keep = torch.arange(want.shape[-1]) != MASK_ID  # tied: the merged output row of <|mask|> (banned) moved too
    torch.testing.assert_close(got[..., keep], want[..., keep], atol=1e-5, rtol=1e-5)


def test_sidecar_names_the_adapter_and_is_validated(tmp_path):
    ckpt = draft_checkpoint(tmp_path / "c", "qwen3")
    assert read_sidecar(ckpt).draft_adapter == ADAPTER_DIR
    base = {**Sidecar(bd_size=4, mask_id=1).__dict__}
    for bad in ("", "../x", "/abs", 3):
        with pytest.raises(SidecarError, match="draft_adapter"):
            Sidecar.from_dict({**base, "draft_adapter": bad})
    with pytest.raises(SidecarError, match="format_version 2"):
        Sidecar.from_dict({**base, "format_version": 1, "draft_adapter": ADAPTER_DIR})
    assert Sidecar.from_dict({**base, "format_version": 1}).draft_adapter is None  # version 1 still reads
    (ckpt / ADAPTER_DIR / "adapter_config.json").unlink()
    with pytest.raises(ValueError, match="adapter_config.json"):
        load_checkpoint(ckpt)


def test_sglang_serves_causal_on_the_base_and_its_plugin_holds_settings_to_the_adapter(tmp_path, capsys):
    """SGLang's causal mode is the stock server on the directory's base weights (it never reads the adapter); the
    plugin refuses settings written for the checkpoint without its adapter, whose drafts would not be what was
    trained (diffusion and self-spec with the adapter: tests/test_sglang_draft_adapter.py)."""
    import yaml

    from inference import serve
    from inference.sglang_backend import plugin
    from inference.sglang_backend.command import bdstack_settings

    ckpt = draft_checkpoint(tmp_path / "c", "qwen3")
    assert (
        serve.main([str(ckpt), "--mode", "causal", "--backend", "sglang", "--dry-run", "--sglang-python", "/x/py"]) == 0
    )
    assert capsys.readouterr().out.split()[1:3] == ["-m", "sglang.launch_server"]
    sidecar = read_sidecar(ckpt)
    write_sidecar(ckpt, Sidecar(**{**sidecar.__dict__, "draft_adapter": None}))
    path = tmp_path / "s.yaml"
    settings = bdstack_settings(ckpt, "diffusion")
    path.write_text(yaml.safe_dump(settings.to_dict()))
    write_sidecar(ckpt, sidecar)
    with pytest.raises(plugin.PluginError, match="draft_adapter disagrees with the checkpoint's sidecar"):
        plugin.load_settings(str(ckpt), settings.algorithm, str(path))
