"""Draft-adapter checkpoints on the vLLM plugin, on CPU (no vLLM needed): the per-token LoRA routing the plugin
hands vLLM (canvas rows take the adapter, every other row none), the trained `<|mask|>` row it attaches, and
decodes under the emulated vLLM (tests/vllm_emulator.py, `vllm_view`) against the native engine: greedy and
sampled, token for token, with self-spec's greedy output the base model's causal output. The same LoRA
routing through vLLM's own loader and punica ops is `make vllm-contract`'s (tests/contracts/vllm/lora.py); the
mapping `draft_lora.DraftLoRA.route` builds from that routing is tested here over stand-ins for the three vLLM
names it imports."""

import importlib
import sys
import types
from dataclasses import dataclass

import pytest
import torch

from bdcore.decode.rows import Rows
from bdcore.decode.sampling import SamplingParams
from bdcore.loading import load_checkpoint
from inference.backend_settings import DRAFT_LORA_NAME
from inference.vllm_backend import command as vc
from inference.vllm_backend import draft_adapter as da
from inference.vllm_backend.steps import BatchRow, StepGlue
from tests.test_draft_adapter import draft_checkpoint
from tests.test_vllm_steps import Request, native_output, run_vllm
from tests.vllm_emulator import native_decode, vllm_decode, vllm_view

PROMPTS = [[5, 9, 13, 7, 22, 3], [40, 41, 8], [17, 30, 30, 12, 6, 9, 11, 4, 19]]
GREEDY, SAMPLED = SamplingParams(max_tokens=14), SamplingParams(temperature=0.9, top_k=20, max_tokens=12)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return draft_checkpoint(tmp_path_factory.mktemp("drafted") / "c", "qwen3")


@pytest.fixture(scope="module")
def models(ckpt):
    """(native engine's model, the vLLM plugin's view, the base model without the adapter)."""
    mask_id = vc.bdstack_settings(ckpt, "diffusion").mask_id
    base = load_checkpoint(ckpt, draft_energy=1.0).model
    base.get_input_embeddings()._forward_hooks.clear()  # no trained row either: the plain base
    return load_checkpoint(ckpt, draft_energy=1.0).model, vllm_view(ckpt, mask_id), base


def settings(ckpt, mode, **kw):
    return vc.bdstack_settings(ckpt, mode, **kw)


def test_lora_flags_ask_for_the_adapter_vllm_can_hold():
    config = {"r": 4, "target_modules": ["model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"]}
    assert da.max_lora_rank(config) == 8 and da.max_lora_rank(config | {"r": 8}) == 8
    assert da.max_lora_rank(config | {"r": 9}) == 16
    assert da.max_lora_rank(config | {"rank_pattern": {"q_proj": 40}}) == 64  # the largest term decides
    assert da.target_modules(config) == ["down_proj", "q_proj"]
    with pytest.raises(da.DraftAdapterError, match="largest LoRA rank, 512"):
        da.max_lora_rank(config | {"r": 513})
    with pytest.raises(da.DraftAdapterError, match="no resolved target modules"):
        da.target_modules({"target_modules": "all-linear"})


def test_the_mask_row_the_plugin_attaches_is_the_trained_one(ckpt, models):
    native, served, base = models
    mask_id = settings(ckpt, "diffusion").mask_id
    ids = torch.tensor([[3, mask_id, 7, mask_id, 11]])
    got, want = served.get_input_embeddings()(ids), native.get_input_embeddings()(ids)
    assert torch.equal(got, want)
    plain = base.get_input_embeddings()(ids)
    assert torch.equal(got[0, [0, 2, 4]], plain[0, [0, 2, 4]])  # only <|mask|> rows change ...
    assert not torch.equal(got[0, 1], plain[0, 1])  # ... and they do
    with pytest.raises(da.DraftAdapterError, match="hidden size 7"):
        da.load_mask_row(ckpt / "draft_adapter", 7)


@pytest.mark.parametrize("mode", ["diffusion", "self-spec"])
def test_the_mapping_names_canvas_rows_only(ckpt, models, mode):
    """A step of three requests: one prefilling (no adapter), one running its planned forward (adapter at its
    canvas rows only, none at its clean rows and padding), one vLLM dummy (none)."""
    _, served, _ = models
    s = settings(ckpt, mode)
    glue = StepGlue(s)
    glue.add("a", PROMPTS[0], GREEDY, torch.Generator())
    glue.add("b", PROMPTS[1], GREEDY, torch.Generator())
    full = torch.zeros(len(PROMPTS[1]), served.config.vocab_size)
    full[-1, 11] = 5.0
    glue.sample([BatchRow("b", 0, 0, True)], full[:0], full[-1:])  # b's prefill: its first forward is planned
    planned = glue.requests["b"].planned
    rows = [BatchRow("a", 0, 0, True), BatchRow("b", s.canvas_length, len(PROMPTS[1]), False)]
    rows.append(BatchRow("_dummy", 3, 0, False))
    got = glue.adapter_rows(rows, [len(PROMPTS[0]), s.canvas_length, 3])
    # diffusion: a denoise forward is all canvas (the seed's slot included); self-spec's cold step is the pending
    # token (a clean row: the base model verifies it) and a canvas of masks
    n = len(planned.tokens)
    want_b = [True] * n if mode == "diffusion" else [False] + [True] * (n - 1)
    assert got == [False] * len(PROMPTS[0]) + want_b + [False] * (s.canvas_length - n) + [False] * 3
    assert Rows().clean([1, 2], 0).canvas([s.mask_id] * 2, 2).drafting() == [False, False, True, True]


@dataclass(frozen=True)
class StandInMapping:
    """vLLM 0.33's `LoRAMapping` (`AdapterMapping`'s two tuples and `is_prefill`)."""

    index_mapping: tuple
    prompt_mapping: tuple
    is_prefill: bool = False


@dataclass(frozen=True)
class StandInRequest:
    """vLLM's `LoRARequest`, by its positional fields."""

    lora_name: str
    lora_int_id: int
    lora_path: str


class StandInWorkerManager:
    """vLLM's `LRUCacheWorkerLoRAManager`: records what the plugin activates, with which mapping."""

    def __init__(self, vllm_config, device, embedding_modules):
        self.built, self.activated = (vllm_config, device, embedding_modules), []

    def set_active_adapters(self, requests, mapping):
        self.activated.append((requests, mapping))


@pytest.fixture
def draft_lora(monkeypatch):
    """`inference.vllm_backend.draft_lora` imported over stand-ins for the vLLM names it imports at its top (no
    vLLM in this environment), and dropped afterwards so that no later import sees the stand-ins."""
    import inference.vllm_backend as package

    names = {
        "vllm": {},
        "vllm.lora": {},
        "vllm.lora.layers": {"LoRAMapping": StandInMapping},
        "vllm.lora.request": {"LoRARequest": StandInRequest},
        "vllm.lora.worker_manager": {"LRUCacheWorkerLoRAManager": StandInWorkerManager},
    }
    for name, attrs in names.items():
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, module)
    name = "inference.vllm_backend.draft_lora"
    monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.delattr(package, "draft_lora", raising=False)
    module = importlib.import_module(name)
    yield module
    sys.modules.pop(name, None)
    if getattr(package, "draft_lora", None) is module:
        delattr(package, "draft_lora")


def test_the_lora_mapping_gives_the_adapter_to_drafting_tokens_only(draft_lora, tmp_path):
    """`DraftLoRA.route`: the adapter's id at exactly the drafting tokens of the forward, 0 (no LoRA: the base
    weights) at every other token, no adapter in the prompt mapping, activated through vLLM's worker manager
    over the runner's own LoRA model manager; refused, naming the flags, when vLLM runs without LoRA."""
    manager = object()
    model = types.SimpleNamespace(lora_manager=manager, embedding_modules={"embed_tokens": "input_embeddings"})
    config = types.SimpleNamespace(lora_config=object())
    draft = draft_lora.DraftLoRA(config, model, "cpu", tmp_path / "draft_adapter")
    assert draft.worker._adapter_manager is manager and draft.worker.built == (config, "cpu", model.embedding_modules)
    assert draft.request == StandInRequest(DRAFT_LORA_NAME, da.DRAFT_LORA_ID, str(tmp_path / "draft_adapter"))
    assert da.DRAFT_LORA_ID != 0, "0 is vLLM's no-LoRA id"
    # a prefilling request, one whose cold step has a clean pending token then a canvas, and padding
    mask = 3
    step = [False] * 4 + Rows().clean([9], 4).canvas([mask] * 3, 5).drafting() + [False, False]
    mapping = draft.route(step, 2)
    ids = da.DRAFT_LORA_ID
    assert mapping == StandInMapping((0, 0, 0, 0, 0, ids, ids, ids, 0, 0), (0, 0), is_prefill=True)
    assert draft.worker.activated == [({draft.request}, mapping)]
    assert draft.route([False] * 3, 1).index_mapping == (0, 0, 0), "a forward without drafting rows: base only"
    assert draft.route([True] * 2, 3) == StandInMapping((ids, ids), (0, 0, 0), is_prefill=True)
    with pytest.raises(draft_lora.PluginError, match="--enable-lora"):  # no LoRA config
        draft_lora.DraftLoRA(types.SimpleNamespace(lora_config=None), model, "cpu", tmp_path)
    with pytest.raises(draft_lora.PluginError, match="--enable-lora"):  # a model without LoRA layers
        draft_lora.DraftLoRA(config, types.SimpleNamespace(embedding_modules={}), "cpu", tmp_path)


@pytest.mark.parametrize("threshold", [0.05, 0.5])
def test_diffusion_equals_the_native_engine_with_the_adapter(ckpt, models, threshold):
    native, served, base = models
    s = settings(ckpt, "diffusion", threshold=threshold)
    differs = 0
    for i, prompt in enumerate(PROMPTS):
        for params in (GREEDY, SAMPLED):
            req, emitted = vllm_decode(served, s, prompt, params, seed=i)
            _, out = native_decode(native, s, prompt, params, seed=i)
            assert req.out.tokens == out.tokens and req.out.finish == out.finish
            assert emitted[: len(out.tokens)] == out.tokens and req.stats.forwards == out.stats.forwards
            differs += native_decode(base, s, prompt, params, seed=i)[1].tokens != out.tokens
    assert differs > 0, "the adapter changes the drafts"


def test_self_spec_greedy_is_the_base_models_causal_output(ckpt, models):
    native, served, base = models
    s = settings(ckpt, "self-spec")
    accepted = 0
    for i, prompt in enumerate(PROMPTS):
        req, _ = vllm_decode(served, s, prompt, GREEDY, seed=i)
        _, causal = native_decode(base, s, prompt, GREEDY, seed=i, mode="causal")
        _, same = native_decode(native, s, prompt, GREEDY, seed=i, causal_prefill=True)
        assert req.out.tokens == causal.tokens == same.tokens
        assert req.stats.accepted == same.stats.accepted and req.stats.forwards == same.stats.forwards
        sampled, _ = vllm_decode(served, s, prompt, SAMPLED, seed=10 + i)
        _, native_sampled = native_decode(native, s, prompt, SAMPLED, seed=10 + i, causal_prefill=True)
        assert sampled.out.tokens == native_sampled.tokens and sampled.stats.accepted == native_sampled.stats.accepted
        accepted += sum(same.stats.accepted.values())
    assert accepted > 0


@pytest.mark.parametrize("mode", ["diffusion", "self-spec"])
def test_batches_under_the_step_glue_equal_the_native_engine(ckpt, models, mode):
    """Three requests, one joining late (its prefill shares a step with the others' forwards), the LoRA
    routed by `StepGlue.adapter_rows` over the whole step: every answer is the native engine's."""
    native, served, _ = models
    s = settings(ckpt, mode, threshold=0.3) if mode == "diffusion" else settings(ckpt, mode)
    for params in (GREEDY, SAMPLED):
        requests = [Request(p, params, arrival) for p, arrival in zip(PROMPTS, (0, 2, 0))]
        run_vllm(served, s, requests, seeds=[20, 21, 22])
        for i, r in enumerate(requests):
            assert r.output == native_output(native, s, r.prompt, params, seed=20 + i)[0]
