"""Tree acceptance read from the drafting metric's ranks (bdcore/decode/policy/tree_acceptance.py): depths, node counts
and the per-slot top-k path table by hand; on a tiny model, the linear chain against today's `accepted` and
every tree against a brute-force walk over the tree's own tokens, from one forward per anchor."""

import pytest
import torch

from bdcore.decode.policy.draft_quality import draft_quality, rank_among
from bdcore.decode.policy.tree_acceptance import (
    accepted_depth,
    default_shapes,
    linear_shape,
    topk_path_acceptance,
    tree_table,
)
from bdcore.decode.rows import Forward, Rows
from bdcore.decode.runner import ModelRunner
from bdcore.decode.sequence import SequenceCache
from bdcore.decode.tree import TreeShape
from bdcore.loading import load_checkpoint
from benchmark.draft_quality import markdown_tables
from tests.test_invariant_4_self_spec import _prompts
from tests.tiny import tiny_checkpoint

N = 8  # draft_len: seven canvas slots, room for deep shapes


def test_rank_zero_is_exactly_the_argmax_ties_included():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0]] * 4)
    # token 1 is the argmax (the first of the tied maxima); a tie at a lower id ranks above
    assert rank_among(logits, torch.tensor([1, 2, 0, 3])).tolist() == [0, 1, 2, 3]


def test_accepted_depth_by_hand():
    ranks = [0, 1, 3]  # the AR token is slot 1's argmax, slot 2's second, slot 3's fourth
    assert accepted_depth(ranks, TreeShape((1, 1, 1))) == 1
    assert accepted_depth(ranks, TreeShape((2, 1, 1))) == 1
    assert accepted_depth(ranks, TreeShape((2, 2, 3))) == 2  # rank 3 needs four candidates
    assert accepted_depth(ranks, TreeShape((1, 2, 4))) == 3
    assert accepted_depth(ranks, TreeShape((1, 2))) == 2  # a shape shorter than the canvas stops there
    assert accepted_depth(ranks[:1], TreeShape((1, 2, 4))) == 1  # as does an answer's end
    # a spine's alternatives are leaves: accepting slot 2's second candidate ends the path
    assert accepted_depth(ranks, TreeShape((1, 2, 4), spine=True)) == 2
    assert accepted_depth([1, 0, 0], TreeShape((2, 2, 2), spine=True)) == 1
    assert accepted_depth([1, 0, 0], TreeShape((2, 1, 1))) == 3


def test_node_counts():
    assert TreeShape((1, 1, 1)).nodes == 3
    assert TreeShape((4, 2, 1)).nodes == 4 + 8 + 8
    assert TreeShape((3, 3, 2, 1)).nodes == 3 + 9 + 18 + 18
    assert TreeShape((4, 2, 1), spine=True).nodes == 7
    with pytest.raises(ValueError):
        TreeShape((2, 0))


def test_topk_path_acceptance_by_hand():
    """Shares conditioned on the path: a slot counts only anchors whose earlier slots were all in their top k
    (and whose canvas reaches it); k itself, not k - 1, is the width."""
    anchors = [[0, 1, 0], [1, 0, 5], [2, 0], [0]]
    table = topk_path_acceptance(anchors, top_k=3)
    assert [r["anchors"] for r in table] == [4, 1, 0]
    assert [r["top1"] for r in table] == [2 / 4, 0 / 1, None]  # unconditioned, slot 2 would be 2 / 3
    assert [r["top2"] for r in table] == [3 / 4, 2 / 2, 1 / 2]
    assert [r["top3"] for r in table] == [4 / 4, 3 / 3, 1 / 2]


def test_default_shapes_fill_the_canvas():
    shapes = default_shapes(8)
    assert shapes[0] == linear_shape(8) == TreeShape((1,) * 7)
    assert TreeShape((4, 2, 1, 1, 1, 1, 1)) in shapes and TreeShape((3, 3, 2, 1, 1, 1, 1)) in shapes
    assert all(s.depth == 7 for s in shapes)
    short = default_shapes(3)  # two slots: (3, 3, 2) is cut to (3, 3); (2, 2) and the spine (2, 2) differ
    assert TreeShape((3, 3)) in short and len(short) == len(set(short))
    with pytest.raises(ValueError, match="deeper than the canvas"):
        tree_table([[0, 0]], [TreeShape((1, 1, 1))], 3)


def test_the_benchmark_tables():
    trees = {
        "topk_path_acceptance": topk_path_acceptance([[0, 1], [1, 0]], top_k=2),
        "tree_shapes": tree_table([[0, 1], [1, 0]], [TreeShape((1, 1)), TreeShape((2, 1))], 3),
    }
    text = markdown_tables(trees)
    assert "| slot | anchors reaching it (top-1) | top-1 path | top-2 path |" in text
    assert "| 1 | 2 | 0.5000 | 1.0000 |" in text and "| 2 | 1 | 0.0000 | 1.0000 |" in text
    assert "| (1,1) | 2 | 0.5000 | 1.00x |" in text and "| (2,1) | 4 | 1.5000 | 3.00x |" in text


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    ckpt = load_checkpoint(tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), bd_size=N))
    runner = ModelRunner.for_checkpoint(ckpt.model, ckpt.capabilities)
    samples = [(ids + ids[:14], len(ids)) for ids in _prompts(ckpt.tokenizer, 3, seed=11)]
    return runner, ckpt.mask_id, samples, draft_quality(runner, samples, mask_id=ckpt.mask_id, draft_len=N)


def test_the_linear_chain_is_todays_accepted(measured):
    *_, quality = measured
    for s in quality.per_sample:
        assert [accepted_depth(r, linear_shape(N)) for r in s.ranks] == s.accepted
    linear = quality.trees(N)["tree_shapes"][0]
    assert linear["shape"] == "(1,1,1,1,1,1,1)" and linear["nodes"] == N - 1
    assert linear["mean_accepted"] == pytest.approx(quality.summary()["draft_mean_accepted"])


def _anchor_logits(runner, mask_id, ids, a, start):
    """One forward per anchor (unlike the metric's one for all): the AR argmax and this canvas's logits."""
    size = N if a == start else N - 1
    rows = Rows().clean(ids, 0).canvas([mask_id] * size, a, view=1)
    logits = runner.forward([(SequenceCache(), Forward(rows, 0, rollback=True))])[0]
    return logits[: len(ids)].argmax(-1), logits[len(ids) :]


def _brute_force_depth(slot_logits, ar_tokens, shape):
    """Build the tree's tokens (each slot's top k by a stable sort, so ties go to the lower id as argmax's)
    and return the longest root path whose tokens are the AR argmax tokens at their positions."""
    offered = [
        torch.sort(slot_logits[d], descending=True, stable=True).indices[:width].tolist()
        for d, width in enumerate(shape.widths[: len(ar_tokens)])
    ]
    argmax_chain = [tokens[0] for tokens in offered]
    best, level = 0, [()]
    for d, tokens in enumerate(offered):
        parents = [p for p in level if not shape.spine or list(p) == argmax_chain[:d]]
        level = [(*p, t) for p in parents for t in tokens]
        if any(list(p) == ar_tokens[: d + 1] for p in level):
            best = d + 1
    return best


SHAPES = [
    TreeShape((1,) * 7),
    TreeShape((16, 12, 8, 4, 1, 1, 1)),
    TreeShape((3,) * 7),
    TreeShape((12,) * 7, spine=True),
    TreeShape((40, 1, 1, 1, 1, 1, 1)),
]


def test_trees_against_a_brute_force_walk(measured):
    runner, mask_id, samples, quality = measured
    deepest = 0
    for (ids, start), s in zip(samples, quality.per_sample):
        for a in range(start, len(ids) - 1):
            ar, canvas = _anchor_logits(runner, mask_id, ids, a, start)
            n = min(N - 1, len(ids) - 1 - a)
            for shape in SHAPES:
                want = _brute_force_depth(canvas[:n], ar[a : a + n].tolist(), shape)
                assert accepted_depth(s.ranks[a - start], shape) == want, (a, shape)
                deepest = max(deepest, want)
    assert deepest >= 3, "some tree accepted three drafts: the walk was seen past its first depths"


def test_widening_a_tree_never_accepts_less(measured):
    *_, quality = measured
    anchors = [r for s in quality.per_sample for r in s.ranks]
    grew = False
    for shape in SHAPES + default_shapes(N):
        for d in range(shape.depth):
            wider = TreeShape(shape.widths[:d] + (shape.widths[d] + 1,) + shape.widths[d + 1 :], shape.spine)
            before = [accepted_depth(r, shape) for r in anchors]
            after = [accepted_depth(r, wider) for r in anchors]
            assert all(x <= y for x, y in zip(before, after)), (shape, wider)
            grew |= after != before
        if shape.spine:  # the full tree of the same widths holds the spine
            full = TreeShape(shape.widths)
            assert all(accepted_depth(r, shape) <= accepted_depth(r, full) for r in anchors)
    assert grew, "some widening accepted more: the comparison was not between equal tables"
