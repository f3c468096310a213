"""The vLLM plugin's mask builder and sampler against the native engine, on CPU (no vLLM needed)."""

import pytest
import torch

from bdcore.decode.rows import Rows, decode_mask
from bdcore.decode.sampling import SamplingParams
from inference.vllm_backend.masks import NotExpressible, ranges_for, triton_visible
from inference.vllm_backend.sampler import request_params
from inference.vllm_backend.settings import VllmDecodeSettings
from tests.tiny import VOCAB, tiny_model
from tests.vllm_emulator import native_decode, vllm_decode

MASK, EOT, FILLER = VOCAB - 1, 1, 2
PROMPTS = [[5, 9, 13, 7, 22, 3], [40, 41, 8], [17, 30, 30, 12, 6, 9, 11, 4, 19]]


def settings(mode, size=4, **kw):
    return VllmDecodeSettings(mode, size, mask_id=MASK, end_of_turn_id=EOT, filler_id=FILLER, **kw)


def commits(trace):
    return [(c.start, c.canvas, c.slots, c.tokens) for c in trace]


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3", seed=3).eval()


def forwards():
    """Rows of every forward kind the plugin runs: prefill, causal step, cold step, verify, commit, denoise."""
    yield 0, Rows().clean([5, 6, 7], 0)
    yield 3, Rows().clean([8], 3)
    yield 3, Rows().clean([8], 3).canvas([MASK] * 3, 4)
    yield 3, Rows().clean([8, 9, 10, 11], 3).canvas([MASK] * 3, 7)
    yield 5, Rows().commit([8, 9, 10, 11], 5, block_causal=False)
    yield 5, Rows().canvas([8, MASK, 10, MASK], 5)


@pytest.mark.parametrize("within_block_causal", [False, True])
def test_ranges_give_the_decode_mask(within_block_causal):
    for cached, rows in forwards():
        spec = ranges_for(rows, cached, within_block_causal=within_block_causal)
        want = decode_mask(cached, rows, True, within_block_causal, "cpu")[0, 0]
        assert torch.equal(triton_visible(spec, cached, len(rows.tokens)), want), (cached, rows.tokens, spec)


def test_layouts_vllm_cannot_hold_are_refused():
    rows = Rows().clean([8, 9], 3)
    rows.canvas([MASK] * 2, 4, view=1).canvas([MASK] * 2, 5, view=2)  # --self-spec-canvases all
    with pytest.raises(NotExpressible, match="positions"):
        ranges_for(rows, 3, within_block_causal=False)
    with pytest.raises(NotExpressible, match="block-causal"):
        ranges_for(Rows().commit([8, 9], 3, block_causal=True), 3, within_block_causal=False)


@pytest.mark.parametrize(("within_block_causal", "threshold"), [(False, 0.05), (False, 0.13), (True, 0.13)])
def test_diffusion_commits_equal_the_native_engine(model, within_block_causal, threshold):
    s = settings("diffusion", threshold=threshold, within_block_causal=within_block_causal)
    for i, prompt in enumerate(PROMPTS):
        for params in (SamplingParams(max_tokens=14), SamplingParams(temperature=0.8, top_k=20, max_tokens=14)):
            req, emitted = vllm_decode(model, s, prompt, params, seed=i, trace=True)
            native, out = native_decode(model, s, prompt, params, seed=i, trace=True)
            assert req.out.tokens == out.tokens and req.out.finish == out.finish
            assert commits(req.decoder.trace) == commits(native.trace)  # every commit: state, slots, tokens
            got = [x for c in req.decoder.trace for x in c.logprobs]
            assert torch.allclose(torch.tensor(got), torch.tensor([x for c in native.trace for x in c.logprobs]))
            assert req.stats.forwards == out.stats.forwards
            assert emitted[: len(out.tokens)] == out.tokens


def test_self_spec_greedy_equals_causal_and_native(model):
    s = settings("self-spec", size=4)
    for i, prompt in enumerate(PROMPTS):
        params = SamplingParams(max_tokens=16)
        req, emitted = vllm_decode(model, s, prompt, params, seed=i)
        _, causal = native_decode(model, s, prompt, params, seed=i, mode="causal")
        _, spec = native_decode(model, s, prompt, params, seed=i)
        assert req.out.tokens == causal.tokens == spec.tokens
        _, same = native_decode(model, s, prompt, params, seed=i, causal_prefill=True)
        assert req.stats.accepted == same.stats.accepted and req.stats.forwards == same.stats.forwards


def test_self_spec_sampled_acceptance_equals_the_native_engine(model):
    s = settings("self-spec", size=3)
    for i, prompt in enumerate(PROMPTS):
        params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16)
        req, _ = vllm_decode(model, s, prompt, params, seed=10 + i)
        _, same = native_decode(model, s, prompt, params, seed=10 + i, causal_prefill=True)
        assert req.out.tokens == same.tokens
        assert req.stats.accepted == same.stats.accepted and sum(same.stats.accepted.values()) > 0


def test_request_params_travel_in_extra_args():
    assert request_params(None, 7) == SamplingParams(max_tokens=7)  # greedy unless asked
    p = request_params({"bdstack": {"temperature": 0.7, "top_k": 5, "top_p": 0.9}}, 7)
    assert (p.temperature, p.top_k, p.top_p) == (0.7, 5, 0.9)
    with pytest.raises(ValueError, match="seed"):
        request_params({"bdstack": {"seed": 1}}, 7)
