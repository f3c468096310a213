"""What a tree of drafts would accept, read from the drafting metric's ranks (`bdcore/decode/policy/draft_quality.py`).

A canvas drafts all its slots in one forward from the same masks, so slot j's logits do not depend on the
candidate chosen at slot i < j: a tree built from each slot's top-k tokens offers, under every node at
depth d - 1, the same top-k_d candidates of slot d. Greedy verification follows the AR argmax, so the tree
accepts through depth d iff the AR token at every depth j <= d is within slot j's top k_j (rank_j < k_j).
The AR head verifying a node conditions on that node's tree path, which is the AR path exactly while the
path agrees with it, so for greedy verification this count is the tree's accepted length, not an estimate.

Per anchor the input is the list of ranks `SampleDrafts.ranks` keeps: rank j is where the AR token at
a+j+1 stands among slot j's draft logits (0: the draft's argmax, so the linear chain accepts the run of
leading zeros, today's `accepted`).
"""

from __future__ import annotations

from collections.abc import Iterable

from bdcore.decode.tree import CANDIDATES, SHAPES, TreeShape

TOP_K = CANDIDATES  # the per-slot table's widest k: the most candidates a tree offers


def linear_shape(draft_len: int) -> TreeShape:
    """Today's self-spec: one chain of the N - 1 argmax drafts."""
    return TreeShape((1,) * (draft_len - 1))


def default_shapes(draft_len: int) -> list[TreeShape]:
    """The shapes the benchmark reports: the chain, then `bdcore.decode.tree.SHAPES`' full trees cut or padded
    with chain depths to the canvas's N - 1 slots, then its spines offering their width at every slot."""
    depth = draft_len - 1
    full = [TreeShape((*s.widths, *(1,) * depth)[:depth]) for s in SHAPES if not s.spine]
    spines = [TreeShape((s.widths[0],) * depth, spine=True) for s in SHAPES if s.spine]
    return list(dict.fromkeys([linear_shape(draft_len), *full, *spines]))  # a short canvas can make two the same


def accepted_depth(ranks: list[int], shape: TreeShape) -> int:
    """Drafts the tree accepts at one anchor: depths whose AR token is among the offered candidates, in a
    run from the first; the canvas's slots past the shape, or the shape's past the answer, add nothing."""
    depth = 0
    for rank, width in zip(ranks, shape.widths):
        if rank >= width:
            break
        depth += 1
        if shape.spine and rank > 0:  # an alternative off the argmax chain is a leaf
            break
    return depth


def topk_path_acceptance(anchors: Iterable[list[int]], top_k: int = TOP_K) -> list[dict]:
    """Per slot i (1-based), for k = 1..top_k: of the anchors whose path was accepted through slot i - 1
    with every AR token in its slot's top k (and whose canvas has a slot i), the share whose AR token at
    slot i is in its top k too. `anchors` counts the anchors that reach slot i under k = 1; a share with
    no anchor to count is None."""
    reached, kept = {}, {}
    for ranks in anchors:
        for k in range(1, top_k + 1):
            for slot, rank in enumerate(ranks, start=1):
                reached[slot, k] = reached.get((slot, k), 0) + 1
                if rank >= k:
                    break
                kept[slot, k] = kept.get((slot, k), 0) + 1
    slots = max((slot for slot, _ in reached), default=0)
    return [
        {
            "slot": slot,
            "anchors": reached.get((slot, 1), 0),
            **{f"top{k}": _share(kept.get((slot, k), 0), reached.get((slot, k), 0)) for k in range(1, top_k + 1)},
        }
        for slot in range(1, slots + 1)
    ]


def tree_table(anchors: list[list[int]], shapes: list[TreeShape], draft_len: int) -> list[dict]:
    """Per shape: its node count and the mean accepted drafts per verify over the anchors, beside the linear
    chain's (the metric's `draft_mean_accepted`)."""
    slots = draft_len - 1
    too_deep = [s.label for s in shapes if s.depth > slots]
    if too_deep:
        raise ValueError(f"tree shapes {too_deep} are deeper than the canvas's {slots} draft slots (N = {draft_len})")
    linear = _mean_accepted(anchors, linear_shape(draft_len))
    rows = []
    for shape in shapes:
        mean = _mean_accepted(anchors, shape)
        rows.append(
            {
                "shape": shape.label,
                "widths": list(shape.widths),
                "spine": shape.spine,
                "nodes": shape.nodes,
                "mean_accepted": mean,
                "vs_linear": _share(mean, linear),
            }
        )
    return rows


def _mean_accepted(anchors: list[list[int]], shape: TreeShape) -> float:
    return sum(accepted_depth(ranks, shape) for ranks in anchors) / max(1, len(anchors))


def _share(part: float, whole: float) -> float | None:
    return part / whole if whole else None
