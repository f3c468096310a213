"""Invariant 4: greedy self-spec == greedy causal token for token; the committed state after k
accepted drafts equals an AR forward over the same tokens; sampled self-spec follows the AR
distribution."""

import random
from collections import Counter

import pytest
import torch

from bdcore.decode.rows import Rows
from bdcore.decode.rules import greedy_accept
from bdcore.decode.sampling import SamplingParams
from bdcore.loading import load_checkpoint
from inference.native.engine import DecodeConfig, Engine
from tests.one_sequence import OneSequence
from tests.tiny import tiny_checkpoint


@pytest.fixture(scope="module", params=["qwen3", "llama", "qwen3_5", "qwen3_moe"])
def loaded(request, tmp_path_factory):
    return load_checkpoint(tiny_checkpoint(tmp_path_factory.mktemp(request.param), arch=request.param, bd_size=4))


def _prompts(tok, n, seed=0):
    rng = random.Random(seed)
    words = ["Copy", "Add", "Sort", "Reverse", "abc", "17 3", "zz", "hello"]
    return [
        tok(
            tok.apply_chat_template(
                [{"role": "user", "content": " ".join(rng.choices(words, k=3))}],
                add_generation_prompt=True,
                tokenize=False,
            ),
            add_special_tokens=False,
        )["input_ids"]
        for _ in range(n)
    ]


@pytest.mark.parametrize("canvases", ["last", "all"])
@pytest.mark.parametrize("draft_len", [2, 4])
def test_greedy_self_spec_equals_greedy_causal(loaded, draft_len, canvases):
    check_greedy_self_spec_equals_causal(loaded, draft_len, canvases)


def check_greedy_self_spec_equals_causal(loaded, draft_len, canvases="last"):
    """Shared with the CUDA twin (`tests/test_cuda_paths.py`), which loads the checkpoint on the GPU."""
    causal = Engine(loaded, DecodeConfig(mode="causal"))
    spec = Engine(loaded, DecodeConfig(mode="self-spec", draft_len=draft_len, self_spec_canvases=canvases))
    params = SamplingParams(max_tokens=24)
    accepted = Counter()
    for ids in _prompts(loaded.tokenizer, 12):
        a, b = causal.generate(ids, params), spec.generate(ids, params)
        assert a.tokens == b.tokens and a.finish_reason == b.finish_reason
        assert b.stats.forwards <= a.stats.forwards
        accepted.update(b.stats.accepted)
    assert sum(k * v for k, v in accepted.items()) > 0, "some drafts were accepted (the test exercises acceptance)"


def test_state_after_k_accepted_equals_ar_state(loaded):
    check_state_after_k_accepted(loaded)


def check_state_after_k_accepted(loaded, *, atol=1e-5, rtol=1e-5):
    model, N = loaded.model, 4
    ids = _prompts(loaded.tokenizer, 1, seed=3)[0]
    # The true greedy continuation, from plain causal decoding.
    truth = Engine(loaded, DecodeConfig(mode="causal")).generate(ids, SamplingParams(max_tokens=8)).tokens
    assert len(truth) >= N + 1
    for k in range(N):
        drafts = list(truth[1:N])
        if k < N - 1:
            drafts[k] = (drafts[k] + 1) % 90  # reject at index k
        spec = OneSequence(model, banned=loaded.mask_id)
        spec.forward(Rows().clean(ids, 0), keep=len(ids))
        c = len(ids)
        rows = Rows().clean([truth[0], *drafts], c).canvas([loaded.mask_id] * (N - 1), c + N)
        logits = spec.forward(rows, keep=N, rollback=True)
        got_k = greedy_accept(torch.tensor(drafts), logits[:N].argmax(-1).cpu())
        assert got_k == k
        spec.crop_to(c + 1 + k)
        ar = OneSequence(model, banned=loaded.mask_id)
        ar.forward(Rows().clean(ids + [truth[0]] + drafts[:k], 0), keep=c + 1 + k)
        assert spec.length == ar.length == c + 1 + k
        for a, b in zip(spec.cache.keys + spec.cache.values, ar.cache.keys + ar.cache.values, strict=True):
            torch.testing.assert_close(a, b, atol=atol, rtol=rtol)
        assert spec.cache.states.keys() == ar.cache.states.keys() == set(spec.runner.linear_layers)
        for i in spec.runner.linear_layers:  # hybrid: recurrent and conv state after exactly k accepted drafts
            torch.testing.assert_close(spec.cache.states[i].rec, ar.cache.states[i].rec, atol=atol, rtol=rtol)
            torch.testing.assert_close(spec.cache.states[i].conv, ar.cache.states[i].conv, atol=atol, rtol=rtol)


def ar_law(loaded, ids, params: dict, length: int = 4) -> dict[tuple, float]:
    """The exact law of the first `length` sampled tokens after `ids`, by enumerating every path (keep
    top_k small: top-k 2 gives at most 2**length paths)."""
    from bdcore.decode.sampling import probabilities

    exact = {(): 1.0}
    for _ in range(length):
        nxt = {}
        for path, pr in exact.items():
            logits = OneSequence(loaded.model, banned=loaded.mask_id).forward(Rows().clean(ids + list(path), 0), keep=0)
            dist = probabilities(logits[-1:], SamplingParams(**params), loaded.mask_id)[0]
            for t in dist.nonzero().flatten().tolist():
                nxt[path + (t,)] = pr * float(dist[t])
        exact = nxt
    assert not any(t in loaded.stop_ids for path in exact for t in path), "pick a prompt that does not stop early"
    return exact


def total_variation(seen: Counter, exact: dict[tuple, float]) -> float:
    """Between the empirical law of `seen` (paths counted) and `exact`."""
    n = sum(seen.values())
    return 0.5 * sum(abs(seen[path] / n - pr) for path, pr in exact.items()) + 0.5 * sum(
        c / n for path, c in seen.items() if path not in exact
    )


def ar_law_case(loaded) -> tuple[list[int], dict, dict[tuple, float]]:
    """The statistical check's prompt, sampling settings (top-k 2, 4 tokens) and exact AR law (Qwen3 only)."""
    if loaded.model.config.model_type != "qwen3":
        pytest.skip("one architecture is enough for the statistical check")
    ids = _prompts(loaded.tokenizer, 1, seed=5)[0]
    params = dict(temperature=1.0, top_k=2, max_tokens=4)
    return ids, params, ar_law(loaded, ids, params)


@pytest.mark.e2e
def test_sampled_self_spec_follows_the_ar_distribution(loaded):
    """The joint law of 4 sampled tokens (top-k 2: at most 16 sequences) matches the exact AR law,
    computed by enumerating every path; self-spec's warm steps accept drafts by rejection sampling."""
    ids, params, exact = ar_law_case(loaded)
    n = 1200
    for mode, canvases in (("causal", "last"), ("self-spec", "last"), ("self-spec", "all")):
        engine = Engine(loaded, DecodeConfig(mode=mode, draft_len=4, self_spec_canvases=canvases))
        seen = Counter(tuple(engine.generate(ids, SamplingParams(**params, seed=s)).tokens) for s in range(n))
        tv = total_variation(seen, exact)
        assert tv < 0.08, (mode, canvases, tv)


def test_seeded_drafting_forward(loaded):
    """`Layout.seeded` (SGLang's self-spec rounds): after a causal step, one canvas [pending, MASK x L] at the
    pending token's place drafts from its rows 0..L-1, keeps nothing and emits nothing; the verify after it
    checks those drafts at the positions after the pending token."""
    from bdcore.decode.layout import Layout
    from bdcore.decode.modes import SelfSpecDecoder
    from bdcore.decode.sequence import AnswerTokens, DecodeStats, EngineOwnedCache, Sequence

    ids, mask = _prompts(loaded.tokenizer, 1, seed=6)[0], loaded.mask_id
    out = AnswerTokens(loaded.stop_ids, 32, DecodeStats())
    seq = Sequence(ids, SamplingParams(), torch.Generator(), out, mask, loaded.stop_ids, cache=EngineOwnedCache())
    dec, one = SelfSpecDecoder(seq, draft_len=4), OneSequence(loaded.model, banned=mask)
    dec.layout = Layout(0, 3, 0, seeded=True)
    with pytest.raises(ValueError, match="cannot be the prefill"):
        dec.next_forward()

    def step(layout):
        dec.layout = layout
        fwd = dec.next_forward()
        logits = one.forward(fwd.rows, fwd.keep, rollback=fwd.rollback)
        seq.cache.length += fwd.keep
        dec.take(logits)
        one.crop_to(seq.cache.length)
        return fwd, logits

    step(Layout(0, 0, 0))  # the prefill, a plain causal step: emits the first token, caches the prompt
    c, pending = len(ids), out.tokens[-1]
    fwd, logits = step(Layout(0, 3, 0, seeded=True))
    want = Rows().canvas([pending, mask, mask, mask], c)
    assert (fwd.rows, fwd.keep) == (want, 0) and out.tokens == [pending] and seq.cache.length == c
    assert dec.drafts == logits[:3].argmax(-1).tolist()
    drafts = list(dec.drafts)
    fwd, logits = step(Layout(2, 0, 2))
    assert fwd.rows == Rows().clean([pending, *drafts[:2]], c) and fwd.rollback
    k = greedy_accept(torch.tensor(drafts[:2]), logits.argmax(-1))
    emitted = out.tokens + ([out.stop_token] if out.stop_token is not None else [])
    assert emitted == [pending, *drafts[:k], int(logits[k].argmax())] and seq.cache.length == c + 1 + k
    assert dec.drafts is None and dec.q is None
