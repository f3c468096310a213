"""Draft trees in self-spec (bdcore/decode/tree.py, issue 44): the tree's rows and mask by hand; every node's
logits equal a causal forward over its own path and every canvas's equal a linear forward's (a node that saw
a sibling branch would differ); the cache after an accepted path, on the spine or off it, equals an AR
prefill of the same tokens (dense keys/values, gated-delta states); greedy tree self-spec equals causal
decoding and the reference decoder's tree mode token for token and forward for forward, dense and hybrid,
alone and batched with linear and causal requests; sampled requests verify the chain."""

from collections import Counter

import pytest
import torch

from bdcore.decode.driver import DecodeDriver, DecodeLoop
from bdcore.decode.rows import Rows, decode_mask
from bdcore.decode.sampling import SamplingParams
from bdcore.decode.tree import TreeShape, build_tree, cut, parse_tree, tree_setting, verify_greedy
from bdcore.loading import load_checkpoint
from inference.native.engine import DecodeConfig, Engine
from tests import reference_decoder as ref
from tests.one_sequence import OneSequence
from tests.test_invariant_4_self_spec import _prompts
from tests.tiny import agreeing_checkpoint, tiny_checkpoint

SHAPES = [TreeShape((2, 2, 2), spine=True), TreeShape((3, 2)), TreeShape((2, 1, 2))]


def _candidates(depth, width=4, base=10):
    """Distinct made-up candidates per slot, best first."""
    return [[base + 10 * d + r for r in range(width)] for d in range(depth)]


# ---- the tree by hand -------------------------------------------------------------------------------------


def test_tree_rows_by_hand():
    cands = _candidates(3)
    spine = build_tree(7, TreeShape((2, 2, 2), spine=True), cands)
    # root, the argmax chain, then the side leaves breadth first
    assert spine.tokens == [7, 10, 20, 30, 11, 21, 31]
    assert spine.parents == [-1, 0, 1, 2, 0, 1, 2] and spine.depths == [0, 1, 2, 3, 1, 2, 3]
    full = build_tree(7, TreeShape((2, 2)), cands)
    assert full.tokens == [7, 10, 20, 11, 21, 20, 21]
    assert full.parents == [-1, 0, 1, 0, 1, 3, 3] and full.depths == [0, 1, 2, 1, 2, 2, 2]
    for shape in SHAPES + [TreeShape((3, 3, 2)), TreeShape((4, 2, 1), spine=True)]:
        tree = build_tree(7, shape, _candidates(shape.depth))
        assert tree.rows == 1 + shape.nodes
        assert all(tree.parents[r] < r for r in range(1, tree.rows)), "parents come before their children"
        assert [tree.depths[tree.parents[r]] + 1 for r in range(1, tree.rows)] == tree.depths[1:]
    # greedy acceptance: follow the child holding the AR token of each row
    ar = [10, 21, 0, 0, 0, 99, 0]  # root -> 10 (spine), row 1 -> 21 (a side leaf), whose AR token is 99
    verdict = verify_greedy(spine, ar)
    assert (verdict.path, verdict.last, verdict.spine_accepted, verdict.on_spine) == ([0, 1, 5], 99, 1, False)
    verdict = verify_greedy(spine, [10, 20, 30, 42, 0, 0, 0])
    assert (verdict.path, verdict.last, verdict.accepted, verdict.on_spine) == ([0, 1, 2, 3], 42, 3, True)
    assert cut(TreeShape((2,)), 3) == TreeShape((2, 1, 1)) and cut(TreeShape((1, 2)), 1) is None
    assert parse_tree("spine:2,2") == TreeShape((2, 2), spine=True) and parse_tree("4,2") == TreeShape((4, 2))
    assert all(parse_tree(tree_setting(s)) == s for s in (TreeShape((2, 2), spine=True), TreeShape((4, 2, 1))))
    for bad in ("5", "1,1", "a", "", "spine:"):
        with pytest.raises(ValueError):
            parse_tree(bad)


def test_the_tree_mask_lets_a_row_see_its_own_path_only():
    tree = build_tree(7, TreeShape((2, 2)), _candidates(2))
    c = 5
    rows = Rows().tree(tree.tokens, tree.parents, tree.depths, c)
    rows.canvas([0, 0], c + 1, view=1, after=0).canvas([0, 0], c + 2, view=2, after=1)
    mask = decode_mask(c, rows, True, False, "cpu")[0, 0]
    assert mask[:, :c].all(), "every row sees the committed prefix"
    n = tree.rows

    def path(r):
        return {r} | (path(tree.parents[r]) if tree.parents[r] >= 0 else set())

    for q in range(n):
        assert {k for k in range(n) if mask[q, c + k]} == path(q), q
    for q, follows in ((n, 0), (n + 1, 0), (n + 2, 1), (n + 3, 1)):  # each canvas: its row's path and itself
        assert {k for k in range(n) if mask[q, c + k]} == path(follows)
    assert mask[n, c + n + 1] and not mask[n, c + n + 2], "a canvas sees itself, not another canvas"
    assert rows.canvases() == [(2, 1), (2, 2)]
    with pytest.raises(ValueError, match="names the tree row"):
        Rows().clean([1], c).canvas([0], c + 1, after=0)


# ---- one forward, against causal forwards -----------------------------------------------------------------


@pytest.fixture(scope="module", params=["qwen3", "llama", "qwen3_5"])
def loaded(request, tmp_path_factory):
    return load_checkpoint(tiny_checkpoint(tmp_path_factory.mktemp(request.param), arch=request.param, bd_size=4))


def _tree_forward(loaded, ids, shape, *, canvases_after=()):
    """Prefill `ids`, then one tree forward (rollback on) with canvases of 3 masks after spine rows
    `canvases_after`: (the sequence, the tree, its logits)."""
    one = OneSequence(loaded.model, banned=loaded.mask_id)
    one.forward(Rows().clean(ids, 0), keep=len(ids))
    c = len(ids)
    tree = build_tree(5, shape, _candidates(shape.depth, base=20))
    rows = Rows().tree(tree.tokens, tree.parents, tree.depths, c)
    for view, j in enumerate(canvases_after, start=1):
        rows.canvas([loaded.mask_id] * 3, c + j + 1, view=view, after=j)
    logits = one.forward(rows, keep=tree.rows, rollback=True)
    return one, tree, logits


def _path_tokens(tree, row):
    out = []
    while row >= 0:
        out.append(tree.tokens[row])
        row = tree.parents[row]
    return out[::-1]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.label)
def test_each_node_and_canvas_equals_a_forward_over_its_own_path(loaded, shape):
    ids = _prompts(loaded.tokenizer, 1, seed=3)[0]
    spine_rows = list(range(shape.depth + 1))
    _, tree, logits = _tree_forward(loaded, ids, shape, canvases_after=spine_rows)
    for row in range(tree.rows):
        want = OneSequence(loaded.model, banned=loaded.mask_id).forward(
            Rows().clean(ids + _path_tokens(tree, row), 0), keep=0
        )[-1]
        torch.testing.assert_close(logits[row], want, atol=2e-4, rtol=2e-4, msg=f"tree row {row}")
    c, a = len(ids), tree.rows
    for j in spine_rows:  # the canvas after spine row j equals the canvas after a chain of the same tokens
        chain = Rows().clean(_path_tokens(tree, j), c).canvas([loaded.mask_id] * 3, c + j + 1)
        one = OneSequence(loaded.model, banned=loaded.mask_id)
        one.forward(Rows().clean(ids, 0), keep=c)
        want = one.forward(chain, keep=0)[j + 1 :]
        torch.testing.assert_close(logits[a : a + 3], want, atol=2e-4, rtol=2e-4, msg=f"canvas after {j}")
        a += 3


@pytest.mark.parametrize("ends", ["spine", "side leaf", "deep side branch"])
def test_the_cache_after_an_accepted_path_equals_an_ar_prefill(loaded, ends):
    ids = _prompts(loaded.tokenizer, 1, seed=4)[0]
    shape = TreeShape((2, 2, 2), spine=True) if ends != "deep side branch" else TreeShape((2, 2, 1))
    one, tree, _ = _tree_forward(loaded, ids, shape, canvases_after=[shape.depth])
    last = {"spine": 2, "side leaf": tree.rows - 1}.get(ends)  # the spine's row 2, or the last side leaf
    if last is None:  # the deepest node off the spine
        last = max(range(1, tree.rows), key=lambda r: (tree.depths[r], r))
    path = [last]
    while tree.parents[path[0]] >= 0:
        path.insert(0, tree.parents[path[0]])
    assert (ends == "spine") == (path == list(range(len(path))))
    c = len(ids)
    one.cache.keep_path(c, path)
    ar = OneSequence(loaded.model, banned=loaded.mask_id)
    ar.forward(Rows().clean(ids + [tree.tokens[r] for r in path], 0), keep=c + len(path))
    assert one.length == ar.length == c + len(path)
    for a, b in zip(one.cache.keys + one.cache.values, ar.cache.keys + ar.cache.values, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert one.cache.states.keys() == ar.cache.states.keys()
    for i in one.cache.states:  # hybrid: conv taps and recurrent state of exactly the accepted path
        torch.testing.assert_close(one.cache.states[i].rec, ar.cache.states[i].rec, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(one.cache.states[i].conv, ar.cache.states[i].conv, atol=1e-5, rtol=1e-5)


# ---- whole decodes ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["qwen3", "qwen3_5"])
def agreeing(request, tmp_path_factory):
    """A tiny checkpoint edited so drafts are often right (`tests.tiny.agreeable`), and its reference model."""
    path = agreeing_checkpoint(tmp_path_factory.mktemp(request.param), request.param)
    loaded = load_checkpoint(path)
    reference = ref.ReferenceModel(path, mask_id=loaded.mask_id, clean_causal=True, within_block_causal=False)
    return loaded, reference


TREES = [("spine:2,2,2", "last"), ("3,2", "all"), ("4,2,2", "last"), ("2", "all")]


def test_greedy_tree_self_spec_equals_causal_and_the_reference(agreeing):
    loaded, reference = agreeing
    engine = Engine(loaded)
    prompts = _prompts(loaded.tokenizer, 6, seed=11)
    causal = [engine.generate(p, SamplingParams(max_tokens=20), DecodeConfig(mode="causal")).tokens for p in prompts]
    seen = Counter()
    for tree, canvases in TREES:
        decode = DecodeConfig(mode="self-spec", draft_len=4, self_spec_canvases=canvases, tree=tree)
        for prompt, want_tokens in zip(prompts, causal):
            got = engine.generate(prompt, SamplingParams(max_tokens=20), decode)
            want = ref.self_spec(
                reference,
                prompt,
                draft_len=4,
                max_tokens=20,
                stop_ids=loaded.stop_ids,
                mask_id=loaded.mask_id,
                canvases=canvases,
                tree=parse_tree(tree),
            )
            where = f"{tree} {canvases}"
            assert got.tokens == want.tokens == want_tokens, where
            assert (got.stats.forwards, dict(got.stats.accepted)) == (want.forwards, dict(want.accepted)), where
            # which verifies accepted a path off the spine: the reference's walk says so node by node
            assert got.stats.off_spine == want.off_spine, where
            seen.update(trees=got.stats.tree_verifies, off_spine=got.stats.off_spine)
            seen.update(accepted=sum(k * v for k, v in got.stats.accepted.items()))
    # The comparison is only as good as what it exercises: side branches accepted, the spine too.
    assert seen["off_spine"] > 0 and seen["trees"] > seen["off_spine"] and seen["accepted"] > 0, seen


def test_trees_batched_with_linear_and_causal_requests_equal_one_by_one(agreeing):
    loaded, _ = agreeing
    engine = Engine(loaded)
    prompts = _prompts(loaded.tokenizer, 6, seed=12)
    decodes = [
        DecodeConfig(mode="self-spec", draft_len=4, tree="spine:2,2,2"),
        DecodeConfig(mode="self-spec", draft_len=4),
        DecodeConfig(mode="causal"),
        DecodeConfig(mode="self-spec", draft_len=4, self_spec_canvases="all", tree="3,2"),
        DecodeConfig(mode="self-spec", draft_len=3, self_spec_canvases="all"),
        DecodeConfig(mode="self-spec", draft_len=4, tree="4,2,2"),
    ]
    params = [SamplingParams(max_tokens=m) for m in (20, 9, 20, 14, 20, 20)]
    alone = [engine.generate(p, q, d) for p, q, d in zip(prompts, params, decodes)]
    loop = DecodeLoop(DecodeDriver(engine.runner), max_batch=len(prompts))
    outs = []
    for p, q, d in zip(prompts, params, decodes):
        decoder, out = engine.start(p, q, d)
        loop.admit(out, decoder)
        outs.append(out)
    loop.run()
    for a, b in zip(alone, outs):
        assert (b.tokens, b.finish, b.stats.forwards) == (a.tokens, a.finish_reason, a.stats.forwards)
    assert sum(o.stats.off_spine for o in outs) > 0, "a side branch was accepted inside the batch"


def test_sampled_requests_verify_the_chain(agreeing):
    loaded, _ = agreeing
    engine = Engine(loaded)
    prompt = _prompts(loaded.tokenizer, 1, seed=13)[0]
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=16, seed=4)
    tree = engine.generate(prompt, params, DecodeConfig(mode="self-spec", draft_len=4, tree="spine:2,2,2"))
    chain = engine.generate(prompt, params, DecodeConfig(mode="self-spec", draft_len=4))
    assert tree.stats.tree_verifies == 0 and (tree.tokens, tree.stats.forwards) == (chain.tokens, chain.stats.forwards)
