"""How much self-spec drafts a step: what one step's forward holds (`Layout`), decoder and policy alike.

A step verifies `drafts` drafts and drafts the next step with canvases after some of its clean rows; the
decoders (`bdcore.decode.modes`) and the SGLang and vLLM backends run a layout, and the self-spec policy
(`bdcore.decode.policy.speculation`) picks one a step where a request leaves the choice to it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from bdcore.decode.tree import TreeShape, cut


@dataclass(frozen=True)
class Layout:
    """One self-spec step: verify `drafts` drafts (clean rows [pending, d1..d_drafts]), and draft the next
    step with canvases of `canvas` masks after the clean rows `first_canvas`..`drafts`.

    `seeded`: a drafting forward of its own instead, for a backend whose forwards are all causal or all
    bidirectional (SGLang): one canvas [pending, MASK x canvas] at the pending token's position, the pending
    token its visible slot 0 as a diffusion block's seed, drafts the `canvas` tokens after it; it verifies
    and emits nothing, and keeps nothing cached. No policy picks it.

    `tree`: verify a draft tree of this shape cut to `drafts` depths (`bdcore.decode.tree.cut`: widths past
    them unused, depths past its widths a chain) instead of the chain of argmax drafts; the canvases follow
    the spine's rows (`bdcore.decode.tree`). Layouts of one shape cut to several depths share its walk."""

    drafts: int
    canvas: int
    first_canvas: int = 0
    seeded: bool = False
    tree: TreeShape | None = None

    @cached_property  # the policy reads it for every option a step
    def rows(self) -> int:
        if self.seeded:
            return 1 + self.canvas
        tree = cut(self.tree, self.drafts) if self.tree is not None else None
        verified = 1 + (tree.nodes if tree is not None else self.drafts)
        return verified + (self.drafts + 1 - self.first_canvas) * self.canvas if self.canvas else verified

    def canvas_rows(self) -> range:
        """The clean rows (0 = the pending token) a canvas follows."""
        return range(self.first_canvas, self.drafts + 1) if self.canvas else range(0)


def fixed_layout(draft_len: int, canvases: str, tree: TreeShape | None = None) -> Layout:
    """The fixed settings: N - 1 drafts a step, canvases of N - 1 after the last row or after every row, the
    drafts a chain or a tree of shape `tree`."""
    n = draft_len - 1
    return Layout(n, n, n if canvases == "last" else 0, tree=tree if tree is not None and cut(tree, n) else None)
