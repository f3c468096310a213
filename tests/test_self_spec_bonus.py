"""Sampled self-spec's bonus token: when every draft is accepted, the token emitted after them is drawn
from the AR distribution at the position after the last draft (`p[n]`), not at the last draft's own.

The statistical self-spec law test (`tests/test_invariant_4_self_spec.py`) decodes 4 tokens with 4-token
drafts, so a step that accepts every draft and then emits a bonus never happens there. Here: the rule on
hand-made distributions, and the engine sampling at top-k 1 (every distribution one-hot, so the
rejection sampler must reproduce greedy decoding exactly), compared with the slow reference decoder's
greedy self-spec (`tests/reference_decoder.py`), token for token and acceptance for acceptance."""

from collections import Counter

import pytest
import torch

from bdcore.decode.rules import speculative_accept
from bdcore.decode.sampling import SamplingParams
from bdcore.loading import load_checkpoint
from inference.native.engine import DecodeConfig, Engine
from tests import reference_decoder as ref
from tests.test_invariant_4_self_spec import _prompts
from tests.tiny import tiny_checkpoint


def test_all_accepted_drafts_are_followed_by_a_draw_from_the_next_position():
    # Two drafts proposed exactly as the target would (q == p), so both are always accepted; the bonus
    # position's distribution has support disjoint from the drafts' positions'.
    p = torch.tensor([[0.6, 0.4, 0.0, 0.0, 0.0], [0.0, 0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 0.0, 0.3, 0.7]])
    gen = torch.Generator().manual_seed(0)
    bonus = Counter()
    n = 2000
    for _ in range(n):
        drafts = torch.stack([torch.multinomial(p[i], 1, generator=gen)[0] for i in range(2)])
        k, tok = speculative_accept(drafts, p[:2], p, gen)
        assert k == 2
        bonus[tok] += 1
    assert set(bonus) <= {3, 4}, bonus
    assert abs(bonus[4] / n - 0.7) < 0.04, bonus


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tiny_checkpoint(tmp_path_factory.mktemp("bonus"), bd_size=4)
    loaded = load_checkpoint(path)
    sc = loaded.sidecar
    reference = ref.ReferenceModel(
        path, mask_id=loaded.mask_id, clean_causal=sc.clean_causal, within_block_causal=sc.within_block_causal
    )
    return loaded, reference


@pytest.mark.parametrize("canvases", ["last", "all"])
def test_top1_sampled_self_spec_equals_the_reference_greedy_self_spec(checkpoint, canvases):
    loaded, reference = checkpoint
    N = 2  # one draft a step: every accepted draft is a fully accepted step, followed by a bonus
    engine = Engine(loaded, DecodeConfig(mode="self-spec", draft_len=N, self_spec_canvases=canvases))
    max_tokens = 16
    full = 0
    for s, ids in enumerate(_prompts(loaded.tokenizer, 6, seed=2)):
        got = engine.generate(ids, SamplingParams(temperature=1.0, top_k=1, max_tokens=max_tokens, seed=s))
        want = ref.self_spec(
            reference,
            ids,
            draft_len=N,
            mask_id=loaded.mask_id,
            canvases=canvases,
            max_tokens=max_tokens,
            stop_ids=loaded.stop_ids,
        )
        assert got.tokens == want.tokens, (s, got.tokens, want.tokens)
        assert got.stats.accepted == want.accepted and got.stats.forwards == want.forwards
        full += got.stats.accepted[N - 1]
    assert full > 0, "some steps accepted every draft (the test exercises the bonus token)"
