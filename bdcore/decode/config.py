"""The decode settings: one definition for the native engine, the SGLang and vLLM backends and the trainer.

What a backend serves of them on a checkpoint, and their defaults from it, is `bdcore.serving_gate.resolve`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from bdcore.capabilities import MODES
from bdcore.decode.tree import TreeShape, parse_tree

__all__ = ["AUTO", "MODES", "SELF_SPEC_CANVASES", "TREE_OFF", "AutoDraft", "DecodeConfig", "ResolvedDecode"]
# Self-spec verify forwards: one drafting canvas after the last clean row ("last": a rejection costs a cold
# step), one after every clean row ("all": whatever prefix is accepted, its drafts are ready), or chosen each
# step from the measured forward cost and acceptance ("auto", bdcore/decode/policy/speculation.py).
SELF_SPEC_CANVASES = ("last", "all", "auto")
AUTO = "auto"  # draft_len / self_spec_canvases / tree: chosen each step by the engine
# Self-spec draft trees (greedy requests; sampled ones verify the chain): "off", "auto" (the policy weighs
# trees beside the chains where it chooses the layout; with a fixed layout, chains) or a shape every verify
# step uses, "W1,W2,..." or "spine:W1,..." (bdcore/decode/tree.py). Native engine only.
TREE_OFF = "off"


def denoise_budget(block: int, steps: int | None, *, shift: bool = True) -> int:
    """Denoise forwards a diffusion block may take: `steps`, by default one per slot the canvas predicts
    (a shifted block's seed comes from the forward before; an unshifted block predicts every slot)."""
    return steps or max(1, block - 1 if shift else block)


@dataclass(frozen=True)
class DecodeConfig:
    """The decode settings, and the one home of their defaults: serve.py's flags, both GPU backends' settings
    and commands and the trainer's rollout thresholds read them here (`DecodeConfig.threshold`, ...)."""

    mode: str = "causal"
    block_size: int | None = None  # diffusion canvas (default: the checkpoint's bd_size)
    threshold: float = 0.9  # diffusion: commit masked slots whose confidence exceeds this
    steps: int | None = None  # diffusion: denoise steps per block (default: block_size - 1)
    draft_len: int | str | None = None  # self-spec N (default and maximum: bd_size), or "auto" (up to bd_size)
    fuse_commit: bool = True  # diffusion: fuse each commit (the prefill too) with the next block's first denoise
    self_spec_canvases: str = "last"  # self-spec: a drafting canvas after the last clean row, or after every one
    tree: str = TREE_OFF  # self-spec: verify draft trees ("off", "auto", or a shape: "2,2", "spine:2,2,2")


@dataclass(frozen=True)
class AutoDraft:
    """What a self-spec request leaves to the policy (`bdcore.decode.policy`): its longest draft and its canvas
    choice. Settings, not policy: the policy reads them, the settings never read the policy."""

    max_drafts: int  # N - 1
    canvases: str  # "last" | "all" | "auto"
    fixed_drafts: int | None  # None: the draft length is chosen too
    trees: str | TreeShape = "off"  # "off", "auto" (weighed beside the chains) or the shape every verify uses


@dataclass(frozen=True)
class ResolvedDecode:
    """Settings with every default filled in from the checkpoint's block size."""

    mode: str
    block: int  # diffusion canvas
    budget: int  # diffusion: denoise forwards per block at most
    threshold: float
    draft_len: int  # self-spec N (with auto_draft_len: the longest the engine may choose)
    fuse_commit: bool
    canvases: str = DecodeConfig.self_spec_canvases  # self-spec: SELF_SPEC_CANVASES
    auto_draft_len: bool = False  # self-spec: the engine chooses the draft length each step (0: a causal step)
    tree: str = TREE_OFF  # self-spec draft trees: "off", "auto" or a shape
    # The shape every verify step uses when the settings force one (self-spec with a shape for `tree`); None
    # otherwise. Parsed once, here, from `tree` (checked by the serving gate before): the rest reads this.
    tree_shape: TreeShape | None = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        forced = self.mode == "self-spec" and self.tree not in (TREE_OFF, AUTO)
        object.__setattr__(self, "tree_shape", parse_tree(self.tree) if forced else None)

    def auto_draft(self) -> AutoDraft | None:
        """What the engine's speculation policy chooses for this request; None: fixed settings."""
        if self.mode != "self-spec" or not (self.auto_draft_len or self.canvases == AUTO):
            return None
        fixed = None if self.auto_draft_len else self.draft_len - 1
        return AutoDraft(self.draft_len - 1, self.canvases, fixed, self.tree_shape or self.tree)
