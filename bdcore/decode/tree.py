"""Draft trees: a self-spec verify forward that checks several candidates per position.

A canvas drafts all its slots in one forward, so slot j's logits do not depend on the token chosen at slot
i < j: under every node at depth j - 1 the tree offers the same top-k_j candidates of slot j
(`TreeShape` gives the k_j, and whether only the argmax chain has children).
The verify forward carries the pending token (the root) and every node as clean rows; a node sits at the
position of its depth and sees the committed prefix and its ancestors only (`ancestry`, laid over the
attention rule by `bdcore.decode.rows.decode_mask`), so its AR logits are those of a causal forward over
the prefix and its own path. Greedy verification walks from the root, each step taking the child that
holds the AR token (`accept_greedy`): the accepted path is exactly the causal decoder's tokens, and the AR
token after its last node (the correction, or the bonus at a leaf) follows it.

Rows are ordered root, then the argmax chain ("spine": rank 0 at every depth), then the other nodes
breadth first, so every parent precedes its children (the gated-delta layers step the rows in order) and
an acceptance along the spine keeps a prefix of the rows, as a linear verify's crop does.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:  # torch is imported where it is used: the serving gate reads shapes stdlib-only
    import torch

CANDIDATES = 4  # candidates kept per drafted slot: the widest a tree may offer


@dataclass(frozen=True)
class TreeShape:
    """`widths[d]`: candidates offered at depth d + 1 (slot d + 1 of the canvas). A full tree gives every node
    at depth d `widths[d]` children; a spine gives children to the top-1 node only (a chain of argmax drafts
    with `widths[d] - 1` leaf alternatives at each depth), which costs the sum of the widths, not their
    running products."""

    widths: tuple[int, ...]
    spine: bool = False

    def __post_init__(self):
        if not self.widths or min(self.widths) < 1:
            raise ValueError(f"tree widths {self.widths}: one or more depths, each offering at least one token")

    @property
    def depth(self) -> int:
        return len(self.widths)

    @property
    def nodes(self) -> int:
        """Draft tokens one verify forward carries (its rows besides the pending token's)."""
        if self.spine:
            return sum(self.widths)
        return sum(prod(self.widths[: d + 1]) for d in range(self.depth))

    @property
    def label(self) -> str:
        widths = ",".join(map(str, self.widths))
        return f"spine({widths})" if self.spine else f"({widths})"


# The one list of tree shapes (their leading widths; deeper depths are a chain): the ones `--tree auto` weighs
# (`bdcore.decode.policy.tree_policy`) and the drafting metric reports (`bdcore.decode.policy.tree_acceptance`), as
# measured on the real checkpoint (docs/design.md 8.17), a spine offering a second candidate at every depth
# first. A full tree's nodes grow with the product of its widths, so wider ones are left to `--tree W1,W2,...`.
SHAPES = (
    TreeShape((2,) * 16, spine=True),
    TreeShape((2,)),
    TreeShape((2, 2)),
    TreeShape((4,)),
    TreeShape((4, 2)),
    TreeShape((3, 3, 2)),
)


@dataclass(frozen=True)
class DraftTree:
    """One verify forward's clean rows: row 0 the pending token, then the draft nodes."""

    tokens: list[int]
    parents: list[int]  # per row, its parent row (-1: the root, which hangs from the cache)
    depths: list[int]  # per row, its distance from the root (position = cached length + depth)
    spine: int  # rows 1..spine are the argmax chain (depth d at row d)

    @property
    def rows(self) -> int:
        return len(self.tokens)

    def children(self) -> list[dict[int, int]]:
        """Per row, its children by token (siblings hold different candidates of one slot)."""
        out: list[dict[int, int]] = [{} for _ in self.tokens]
        for row in range(1, self.rows):
            out[self.parents[row]][self.tokens[row]] = row
        return out


def build_tree(pending: int, shape: TreeShape, candidates: list[list[int]]) -> DraftTree:
    """The tree of `shape` over `candidates[j]` (slot j + 1's tokens, best first; [0] is the argmax draft).
    A spine gives children to argmax nodes only; a full tree to every node."""
    depth = shape.depth
    if len(candidates) < depth or any(len(candidates[d]) < shape.widths[d] for d in range(depth)):
        raise ValueError(f"tree {shape.label} needs {list(shape.widths)} candidates per slot; fewer were drafted")
    # A node is its rank at every depth of its path; spine nodes are all zeros.
    layers = [[()]]
    for width in shape.widths:
        grown = [(*path, r) for path in layers[-1] for r in range(width) if not (shape.spine and any(path))]
        layers.append(grown)
    spine = [(0,) * d for d in range(1, depth + 1)]
    others = [path for layer in layers[1:] for path in layer if any(path)]
    order = [(), *spine, *others]
    row_of = {path: i for i, path in enumerate(order)}
    tokens = [pending] + [candidates[len(p) - 1][p[-1]] for p in order[1:]]
    parents = [-1] + [row_of[p[:-1]] for p in order[1:]]
    return DraftTree(tokens, parents, [len(p) for p in order], depth)


def accept_greedy(tree: DraftTree, ar_tokens: list[int]) -> tuple[list[int], int]:
    """The accepted path (rows from the root, the root included) and the AR token after its last node:
    from the root, follow the child holding the AR token of the current row while there is one."""
    children = tree.children()
    path = [0]
    while (child := children[path[-1]].get(ar_tokens[path[-1]])) is not None:
        path.append(child)
    return path, ar_tokens[path[-1]]


class KeptPath(NamedTuple):
    """What a tree verify keeps cached: the tokens before `base` and the forward's rows `rows` (root first)."""

    base: int
    rows: list[int]


@dataclass(frozen=True)
class TreeVerdict:
    """A greedy tree verify: the accepted path (rows, root first), the AR token after it, and how far the
    argmax chain alone got (what a linear verify of the spine would have accepted)."""

    path: list[int]
    last: int
    spine_accepted: int

    @property
    def accepted(self) -> int:
        return len(self.path) - 1

    @property
    def on_spine(self) -> bool:
        """The path is the spine's first rows (spine row d is row d), so the canvases after them drafted on."""
        return self.path[-1] == self.accepted


def verify_greedy(tree: DraftTree, ar_tokens: list[int]) -> TreeVerdict:
    path, last = accept_greedy(tree, ar_tokens)
    spine = 0
    while spine + 1 < len(path) and path[spine + 1] == spine + 1:
        spine += 1
    return TreeVerdict(path, last, spine)


def ancestry(parents: list[int], anchors: list[int]) -> torch.Tensor:
    """[Q, Q] bool over a tree forward's new rows, the tree's rows first (`parents`: each one's parent row,
    -1 for the root): query q may see key k iff k is not a tree row (a canvas row, left to the attention
    rule) or k is the anchor of q or one of its ancestors. `anchors[q]`: the tree row whose path q continues
    (itself for a tree row, the row a canvas follows for a canvas row). Built with matrix products (a
    node's ancestors are its parent's, one step up at a time), not per element: a tree of 100 nodes would
    otherwise spend longer on its mask than on its forward."""
    import torch

    n, Q = len(parents), len(anchors)
    child = [r for r in range(n) if parents[r] >= 0]
    up = torch.zeros(n, n)
    up[child, [parents[r] for r in child]] = 1.0
    lineage = reach = torch.eye(n)
    while True:
        reach = reach @ up
        if not reach.any():
            break
        lineage = lineage + reach
    allowed = torch.ones(Q, Q, dtype=torch.bool)
    allowed[:, :n] = lineage[anchors] > 0
    return allowed


def top_candidates(rows_logits: torch.Tensor, drafts: list[int], k: int = CANDIDATES) -> list[list[int]]:
    """Per row, its k most likely tokens, best first, ties toward the lower id, led by the row's draft (its
    argmax, which a tie at the top could otherwise put second)."""
    values, ids = rows_logits.topk(min(k, rows_logits.shape[-1]), dim=-1)
    out = []
    for vals, toks, draft in zip(values.tolist(), ids.tolist(), drafts):
        ranked = [t for _, t in sorted(zip(vals, toks), key=lambda vt: (-vt[0], vt[1])) if t != draft]
        out.append([draft, *ranked][:k])
    return out


def cut(shape: TreeShape, depth: int) -> TreeShape | None:
    """`shape` over the first `depth` drafts, chain depths (width 1) added past its widths; None where that
    is a plain chain (a linear verify)."""
    widths = (*shape.widths[:depth], *(1,) * max(depth - shape.depth, 0))
    return TreeShape(widths, shape.spine) if depth and max(widths) > 1 else None


def parse_tree(spec: str) -> TreeShape:
    """A shape from its setting: leading widths "W1,W2,..." (deeper depths a chain), full, or "spine:..."
    where only the argmax chain branches. Each width in 1..CANDIDATES."""
    spine = spec.startswith("spine:")
    text = spec.removeprefix("spine:")
    try:
        widths = tuple(int(w) for w in text.split(","))
    except ValueError:
        raise ValueError(f"tree {spec!r}: give widths as W1,W2,... (e.g. 2,2 or spine:2,2,2)") from None
    if not widths or min(widths) < 1 or max(widths) > CANDIDATES or max(widths) == 1:
        raise ValueError(
            f"tree {spec!r}: widths lie in 1..{CANDIDATES} (the candidates a canvas slot keeps), one above 1"
        )
    return TreeShape(widths, spine)


def tree_setting(shape: TreeShape) -> str:
    """The setting `parse_tree` reads back as `shape` (serve.py's `--tree`)."""
    return ("spine:" if shape.spine else "") + ",".join(map(str, shape.widths))
