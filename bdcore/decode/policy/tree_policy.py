"""Draft trees in the self-spec policy: which shapes it weighs, and what one tree verify yields.

`bdcore.decode.policy.speculation` rates every layout by the tokens a verify step emits and the chance that the
next step is a cold one or drafts stale tokens; this module gives those figures for a tree layout
(`tree_outcome`) from the per-slot argmax acceptance and the `AlternativeEstimate` rates (how often the AR
token is a side candidate when the argmax is rejected). The next step's drafts come from the canvases after
the spine's rows (`bdcore.decode.tree`): a path that ends on the spine leaves drafts as a linear layout's
would; a path that leaves it (a side candidate accepted) leaves none, so a cold step follows.
"""

from __future__ import annotations

from dataclasses import dataclass

from bdcore.decode.tree import SHAPES, TreeShape, cut

TREE_CHOICES = ("off", "auto")  # or a shape: "W1,W2,..." / "spine:W1,..." (bdcore.decode.tree.parse_tree)


def tree_shapes(depth: int, setting: str | TreeShape) -> list[TreeShape]:
    """The tree shapes a step of `depth` drafts may verify under the `tree` setting ("off": none; "auto":
    `bdcore.decode.tree.SHAPES`; a shape, parsed once where the settings are resolved: that one), the first of
    those that cut to the same tree at `depth`; none that cuts to a chain (that is the linear layout)."""
    if setting == "off":
        return []
    family = SHAPES if setting == "auto" else (setting,)
    by_cut: dict[TreeShape, TreeShape] = {}
    for shape in family:
        tree = cut(shape, depth)
        if tree is not None:
            by_cut.setdefault(tree, shape)
    return list(by_cut.values())


@dataclass(frozen=True)
class TreeWalk:
    """A tree's greedy walk through each depth n (index n) for one draft source: the expected tokens a verify
    of depth n emits, the chance its path ends off the spine (a side candidate accepted: a cold step next),
    and the chance it ends on spine row j < n, summed over j (`stops[n]`). A tree of depth n is the first n
    depths of a deeper one, so one walk serves every depth."""

    tokens: list[float]
    off_spine: list[float]
    stops: list[float]

    def outcome(self, depth: int, first_canvas: int) -> tuple[float, float, float]:
        """(tokens, P(cold next), P(stale next)) of the tree cut to `depth`, canvases after spine rows
        `first_canvas`..: a path ending on spine row j leaves stale drafts when j >= first_canvas (none, so a
        cold step, before), one ending off the spine leaves none."""
        m = min(first_canvas, depth)
        return self.tokens[depth], self.off_spine[depth] + self.stops[m], self.stops[depth] - self.stops[m]


def tree_walk(
    widths: tuple[int, ...], spine: bool, rates: list[float], alternatives: list[tuple[float, ...]]
) -> TreeWalk:
    """The walk of a tree offering `widths[j]` candidates at depth j + 1 (1 past its widths) over
    `len(rates)` depths. `rates[j]`: the argmax of slot j + 1 accepted given the spine accepted so far;
    `alternatives[j][w - 1]`: the AR token among the top w given the argmax was rejected. Off the spine (full
    trees) a node's children are taken to be right as often as the spine's (the canvas saw neither path)."""
    on, off, lost = 1.0, 0.0, 0.0  # alive on the spine; alive off it; ended off it
    tokens, off_spine, stops = [1.0], [0.0], [0.0]
    for j, a in enumerate(rates):
        width = widths[j] if j < len(widths) else 1
        side = (1.0 - a) * (alternatives[j][width - 1] if j < len(alternatives) else 0.0)
        stops.append(stops[-1] + on * (1.0 - a - side))  # rejected below spine row j: the path ends there
        if spine:  # side candidates are leaves: one token each, then the path ends
            tokens.append(tokens[-1] + on * (a + side))
            lost += on * side
            on *= a
        else:
            lost += off * (1.0 - a - side)
            off = off * (a + side) + on * side
            on *= a
            tokens.append(tokens[-1] + on + off)
        off_spine.append(lost + off)
    return TreeWalk(tokens, off_spine, stops)


def tree_outcome(
    shape: TreeShape, first_canvas: int, rates: list[float], alternatives: list[tuple[float, ...]]
) -> tuple[float, float, float]:
    """One verify step of `shape` (depth = its drafts) with canvases after spine rows `first_canvas`..:
    (expected tokens emitted, chance the next step is cold, chance its drafts are stale)."""
    walk = tree_walk(shape.widths, shape.spine, rates[: shape.depth], alternatives)
    return walk.outcome(shape.depth, first_canvas)
