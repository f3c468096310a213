"""Our SGLang algorithms (inference/sglang_backend/algorithms.py) driven the way SGLang drives them, on CPU.

`tests/sglang_emulator.py` plays SGLang's separate-context scheduler; the forwards are the native
engine's. Greedy diffusion must equal the native engine with unfused commits token for token (same
forwards count), greedy self-spec must equal greedy causal decoding, batched or not.
"""

from collections import Counter
from dataclasses import replace

import pytest
import torch
import yaml

from bdcore.decode.sampling import SamplingParams
from bdcore.loading import load_checkpoint
from inference.native.engine import DecodeConfig, Engine
from inference.sglang_backend.algorithms import SelfSpec, ShiftedDiffusion
from inference.sglang_backend.requests import RoundTokens, request_params, request_seed
from inference.sglang_backend.settings import DIFFUSION, SELF_SPEC, DecodeSettings
from tests.sglang_emulator import EmulatedModelRunner, emulated, serve
from tests.test_invariant_4_self_spec import _prompts, ar_law_case, total_variation
from tests.tiny import tiny_checkpoint

pytestmark = pytest.mark.e2e  # a whole program, server or long sweep: `pytest -m 'not e2e'` skips it


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def loaded(request, tmp_path_factory):
    return load_checkpoint(tiny_checkpoint(tmp_path_factory.mktemp(request.param), arch=request.param, bd_size=4))


def _settings(loaded, algorithm, block_size=4, **kw) -> DecodeSettings:
    from bdcore.tokens import end_of_turn_id, filler_id

    tok = loaded.tokenizer
    eot = end_of_turn_id(tok)
    others = sorted(loaded.stop_ids - {eot, filler_id(tok, eot)})
    return DecodeSettings(
        algorithm=algorithm,
        block_size=block_size,
        mask_id=loaded.mask_id,
        end_of_turn_id=eot,
        filler_id=filler_id(tok, eot),
        other_stop_ids=others,
        **kw,
    )


@pytest.mark.parametrize("threshold", [0.0, 0.5, 1.1])
def test_diffusion_equals_native_unfused(loaded, threshold):
    """One server, requests one after another (SGLang's dLLM default): each later request's prompt
    and every context pass come after canvases, and must still be encoded causally."""
    algo = emulated(ShiftedDiffusion)(_settings(loaded, DIFFUSION, threshold=threshold))
    native = Engine(loaded, DecodeConfig(mode="diffusion", threshold=threshold, fuse_commit=False))
    params = SamplingParams(max_tokens=20)
    prompts = _prompts(loaded.tokenizer, 6)
    refs = [native.generate(ids, params) for ids in prompts]
    got, forwards = serve(loaded, algo, prompts, [params] * len(prompts))
    assert got == [r.tokens for r in refs]
    assert forwards == sum(r.stats.forwards for r in refs)


@pytest.mark.parametrize(("max_running", "budget"), [(5, None), (2, 5)])
def test_diffusion_batched_equals_one_by_one(loaded, max_running, budget):
    """Batched canvases, requests joining between rounds, context passes cut by the KV budget."""
    algo = emulated(ShiftedDiffusion)(_settings(loaded, DIFFUSION, threshold=0.5))
    prompts = _prompts(loaded.tokenizer, 5, seed=1)
    params = [SamplingParams(max_tokens=m) for m in (5, 20, 9, 16, 20)]
    batched, _ = serve(loaded, algo, prompts, params, max_running_requests=max_running, extend_budget=budget)
    single = [serve(loaded, algo, [p], [q])[0][0] for p, q in zip(prompts, params)]
    assert batched == single
    assert all(len(o) <= q.max_tokens for o, q in zip(batched, params))


@pytest.mark.parametrize("cls", [ShiftedDiffusion, SelfSpec])
def test_every_forward_sets_its_attention(loaded, cls):
    """SGLang's Triton backend honours a bidirectional layer in ordinary EXTEND forwards too (under the
    plugin's settings), so nothing may be inherited from the previous forward: context passes and
    prompts causal, drafts bidirectional (default checkpoints), verifies causal."""
    algo = emulated(cls)(_settings(loaded, DIFFUSION if cls is ShiftedDiffusion else SELF_SPEC))
    runner = EmulatedModelRunner(loaded)
    prompts = _prompts(loaded.tokenizer, 3, seed=5)
    serve(loaded, algo, prompts, [SamplingParams(max_tokens=12)] * 3, max_running_requests=2, runner=runner)
    assert not any(bi for mode, bi in runner.modes if mode == "EXTEND")
    canvases = [bi for mode, bi in runner.modes if mode == "DLLM_EXTEND"]
    assert canvases and (all(canvases) if cls is ShiftedDiffusion else canvases == [True, False] * (len(canvases) // 2))


@pytest.mark.parametrize("draft_len", [2, 4])
def test_greedy_self_spec_equals_greedy_causal(loaded, draft_len):
    algo = emulated(SelfSpec)(_settings(loaded, SELF_SPEC, block_size=draft_len))
    causal = Engine(loaded, DecodeConfig(mode="causal"))
    prompts = _prompts(loaded.tokenizer, 8, seed=2)
    params = [SamplingParams(max_tokens=m) for m in (24, 7, 24, 13, 24, 3, 24, 24)]
    got, forwards = serve(loaded, algo, prompts, params, max_running_requests=len(prompts))
    want = [causal.generate(p, q).tokens for p, q in zip(prompts, params)]
    assert got == want
    assert forwards < sum(len(w) + 1 for w in want), "batched self-spec spends fewer forwards than causal"


def test_sampled_self_spec_is_seeded_by_request_and_valid(loaded):
    algo = emulated(SelfSpec)(_settings(loaded, SELF_SPEC))
    prompts = _prompts(loaded.tokenizer, 3, seed=4)
    params = [SamplingParams(temperature=1.0, top_k=20, top_p=0.9, max_tokens=12)] * 3
    rids = ["a", "b", "c"]
    first, _ = serve(
        loaded, emulated(SelfSpec)(_settings(loaded, SELF_SPEC)), prompts, params, max_running_requests=3, rids=rids
    )
    again, _ = serve(loaded, algo, prompts, params, rids=rids)
    assert first == again, "each request's generator is seeded from its id: every TP rank draws alike"
    for out in first:
        assert loaded.mask_id not in out and len(out) <= 12


def test_filler_is_reported_as_end_of_turn(loaded):
    s = _settings(loaded, DIFFUSION)
    sink = RoundTokens(s)
    assert sink.push([5, 6, s.filler_id, 7]) and sink.take() == [5, 6, s.end_of_turn_id]
    assert not sink.push([5, 6, 7]) and sink.take() == [5, 6, 7]
    assert sink.push([8, s.end_of_turn_id]) and sink.take() == [8, s.end_of_turn_id]


def test_canvas_without_context_pass_is_a_clear_error(loaded):
    from tests.sglang_emulator import Batch, Mode, _sampling_info

    algo = emulated(ShiftedDiffusion)(_settings(loaded, DIFFUSION))
    runner = EmulatedModelRunner(loaded)
    info = _sampling_info([SamplingParams()], len(loaded.tokenizer))
    canvas = Batch(Mode(True), torch.zeros(4, dtype=torch.long), ["r"], torch.tensor([9]), info)
    with pytest.raises(RuntimeError, match="without a preceding context pass"):
        algo.run(runner, canvas)
    ctx = Batch(Mode(False), torch.tensor([1, 2, 3]), ["r"], torch.tensor([3]), info, [[1, 2, 3]])
    algo.run(runner, ctx)
    with pytest.raises(RuntimeError, match="context pass must end where the canvas starts"):
        algo.run(runner, canvas)  # canvas at 9 - 4 = 5, seed after 3 tokens


def test_request_params_decodes_sglang_encoding():
    from tests.sglang_emulator import _sampling_info

    info = _sampling_info([SamplingParams(), SamplingParams(temperature=0.7, top_k=0, top_p=0.8)], 100)
    assert request_params(info, 0, 100).greedy
    p = request_params(info, 1, 100)
    assert (p.temperature, p.top_k, p.top_p) == (pytest.approx(0.7), 0, pytest.approx(0.8))
    assert request_params(None, 0, 100).greedy


def test_settings_round_trip_and_errors(loaded):
    s = _settings(loaded, DIFFUSION, threshold=0.8, steps=2)
    assert DecodeSettings.from_dict(yaml.safe_load(yaml.safe_dump(s.to_dict()))) == s
    assert s.denoise_steps == 2 and _settings(loaded, DIFFUSION).denoise_steps == 3
    bad = s.to_dict() | {"treshold": 0.5}
    with pytest.raises(ValueError, match="unknown key"):
        DecodeSettings.from_dict(bad)
    with pytest.raises(ValueError, match="missing key"):
        DecodeSettings.from_dict({k: v for k, v in s.to_dict().items() if k != "mask_id"})
    with pytest.raises(ValueError, match="block_size must be >= 2"):
        DecodeSettings.from_dict(s.to_dict() | {"block_size": 1})
    with pytest.raises(ValueError, match="three different tokens"):
        DecodeSettings.from_dict(s.to_dict() | {"filler_id": s.mask_id})
    with pytest.raises(ValueError, match="algorithm"):
        DecodeSettings.from_dict(s.to_dict() | {"algorithm": "LowConfidence"})


@pytest.fixture(scope="module")
def hybrid_wbc(tmp_path_factory):
    """A Qwen3.5 (gated-delta) checkpoint whose canvas is within-block causal: what SGLang can serve."""
    import json

    path = tiny_checkpoint(tmp_path_factory.mktemp("hybrid"), arch="qwen3_5", bd_size=4)
    sidecar = json.loads((path / "block_diffusion.json").read_text())
    (path / "block_diffusion.json").write_text(json.dumps(sidecar | {"within_block_causal": True}))
    return load_checkpoint(path)


def test_hybrid_self_spec_equals_causal_only_with_the_state_guard(hybrid_wbc):
    loaded = hybrid_wbc
    settings = _settings(loaded, SELF_SPEC, within_block_causal=True)
    prompts = _prompts(loaded.tokenizer, 6, seed=8)
    params = [SamplingParams(max_tokens=16)] * len(prompts)
    want = [Engine(loaded, DecodeConfig(mode="causal")).generate(p, q).tokens for p, q in zip(prompts, params)]
    got, _ = serve(loaded, emulated(SelfSpec)(settings), prompts, params)
    assert got == want
    unguarded, _ = serve(loaded, emulated(SelfSpec, state_guard=False)(settings), prompts, params)
    assert unguarded != want, "without the guard the canvas tokens leak into the recurrent state"


def test_hybrid_diffusion_equals_native_unfused(hybrid_wbc):
    loaded = hybrid_wbc
    algo = emulated(ShiftedDiffusion)(_settings(loaded, DIFFUSION, threshold=0.5, within_block_causal=True))
    native = Engine(loaded, DecodeConfig(mode="diffusion", threshold=0.5, fuse_commit=False))
    params = SamplingParams(max_tokens=16)
    for ids in _prompts(loaded.tokenizer, 4, seed=9):
        (got,), forwards = serve(loaded, algo, [ids], [params])
        ref = native.generate(ids, params)
        assert got == ref.tokens and forwards == ref.stats.forwards


@pytest.mark.parametrize("threshold", [0.5, 0.95])
def test_sampled_diffusion_equals_native_unfused_token_for_token(loaded, threshold):
    """Sampled: the request's generator is seeded from its id; the native engine given that seed draws the same
    tokens, forward for forward (the same decoder, rules and sampler, the same logits)."""
    algo = emulated(ShiftedDiffusion)(_settings(loaded, DIFFUSION, threshold=threshold))
    native = Engine(loaded, DecodeConfig(mode="diffusion", threshold=threshold, fuse_commit=False))
    prompts = _prompts(loaded.tokenizer, 4, seed=11)
    rids = [f"sampled-{i}" for i in range(len(prompts))]
    params = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, max_tokens=20)
    got, forwards = serve(loaded, algo, prompts, [params] * len(prompts), rids=rids)
    refs = [native.generate(p, replace(params, seed=request_seed(r))) for p, r in zip(prompts, rids)]
    assert got == [r.tokens for r in refs]
    assert forwards == sum(r.stats.forwards for r in refs)
    assert len({tuple(g) for g in got}) > 1 and any(len(g) > 4 for g in got), "a test that decodes something"


def test_sampled_self_spec_follows_the_ar_law(loaded):
    """Rejection sampling through SGLang's rounds: the joint law of 4 sampled tokens (top-k 2) matches the
    exact AR law (tests/test_invariant_4_self_spec.py's enumeration), each request drawing from its own id."""
    ids, params, exact = ar_law_case(loaded)
    n = 1200
    algo = emulated(SelfSpec)(_settings(loaded, SELF_SPEC))
    got, _ = serve(loaded, algo, [ids] * n, [SamplingParams(**params)] * n, max_running_requests=64)
    tv = total_variation(Counter(tuple(g) for g in got), exact)
    assert tv < 0.08, tv


@pytest.fixture(scope="module")
def dense_wbc(tmp_path_factory):
    """A dense checkpoint whose canvas is within-block causal: every canvas forward on SGLang is causal."""
    import json

    path = tiny_checkpoint(tmp_path_factory.mktemp("dense_wbc"), bd_size=4)
    sidecar = json.loads((path / "block_diffusion.json").read_text())
    (path / "block_diffusion.json").write_text(json.dumps(sidecar | {"within_block_causal": True}))
    return load_checkpoint(path)


def test_within_block_causal_dense_equals_native(dense_wbc):
    loaded = dense_wbc
    prompts = _prompts(loaded.tokenizer, 4, seed=12)
    params = [SamplingParams(max_tokens=16)] * len(prompts)
    runner = EmulatedModelRunner(loaded)
    algo = emulated(ShiftedDiffusion)(_settings(loaded, DIFFUSION, threshold=0.5, within_block_causal=True))
    got, _ = serve(loaded, algo, prompts, params, runner=runner)
    native = Engine(loaded, DecodeConfig(mode="diffusion", threshold=0.5, fuse_commit=False))
    assert got == [native.generate(p, q).tokens for p, q in zip(prompts, params)]
    assert not any(bi for _, bi in runner.modes), "the checkpoint's canvas is causal: no forward is bidirectional"
    got, _ = serve(loaded, emulated(SelfSpec)(_settings(loaded, SELF_SPEC, within_block_causal=True)), prompts, params)
    causal = Engine(loaded, DecodeConfig(mode="causal"))
    assert got == [causal.generate(p, q).tokens for p, q in zip(prompts, params)]


def test_hybrid_sampled_diffusion_equals_native_unfused(hybrid_wbc):
    loaded = hybrid_wbc
    algo = emulated(ShiftedDiffusion)(_settings(loaded, DIFFUSION, threshold=0.5, within_block_causal=True))
    native = Engine(loaded, DecodeConfig(mode="diffusion", threshold=0.5, fuse_commit=False))
    params = SamplingParams(temperature=1.0, top_k=20, max_tokens=16)
    prompts, rids = _prompts(loaded.tokenizer, 3, seed=13), ["h0", "h1", "h2"]
    got, _ = serve(loaded, algo, prompts, [params] * 3, max_running_requests=3, rids=rids)
    assert got == [native.generate(p, replace(params, seed=request_seed(r))).tokens for p, r in zip(prompts, rids)]


def test_self_spec_rounds_stay_within_the_canvas(loaded):
    """A round returns 1..N tokens (the emulator asserts it: SGLang writes them over the canvas's N slots), and
    more than one on average (the AR token, then a correction or bonus after any accepted drafts)."""
    algo = emulated(SelfSpec)(_settings(loaded, SELF_SPEC))
    runner = EmulatedModelRunner(loaded)
    prompts = _prompts(loaded.tokenizer, 4, seed=14)
    got, _ = serve(loaded, algo, prompts, [SamplingParams(max_tokens=24)] * 4, runner=runner)  # one at a time
    canvases = [bi for mode, bi in runner.modes if mode == "DLLM_EXTEND"]
    rounds = len(canvases) // 2
    assert canvases == [True, False] * rounds, "a round: a bidirectional draft, then a causal verify"
    # Every round but a request's last emits the AR token and a correction or bonus at least
    assert 4 * rounds >= sum(len(g) for g in got) >= 2 * (rounds - len(prompts)), (rounds, [len(g) for g in got])


def test_mask_logits_are_banned_as_the_native_runner_bans_them(loaded):
    """SGLang's model does not ban `<|mask|>`: a model that rates it highly everywhere must still commit as the
    native engine does (its runner bans the mask, so greedy confidences leave it out)."""

    class MaskLovingRunner(EmulatedModelRunner):
        def forward(self, batch, pp_proxy_tensors=None):
            out = super().forward(batch, pp_proxy_tensors)
            for logits in (out.logits_output.next_token_logits, out.logits_output.full_logits):
                if logits is not None:
                    logits[..., loaded.mask_id] += 50.0
            return out

    algo = emulated(ShiftedDiffusion)(_settings(loaded, DIFFUSION, threshold=0.5))
    native = Engine(loaded, DecodeConfig(mode="diffusion", threshold=0.5, fuse_commit=False))
    params, prompts = SamplingParams(max_tokens=16), _prompts(loaded.tokenizer, 3, seed=15)
    got, forwards = serve(loaded, algo, prompts, [params] * 3, runner=MaskLovingRunner(loaded))
    refs = [native.generate(p, params) for p in prompts]
    assert got == [r.tokens for r in refs] and forwards == sum(r.stats.forwards for r in refs)
