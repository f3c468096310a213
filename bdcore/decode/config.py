"""The decode settings: one definition for the native engine, the SGLang backend and the trainer."""

from __future__ import annotations

from dataclasses import dataclass

from bdcore.capabilities import MODES, Capabilities
from bdcore.decode.speculation import AutoDraft

__all__ = ["AUTO", "MODES", "SELF_SPEC_CANVASES", "DecodeConfig", "DecodeSettingsError", "ResolvedDecode"]
# Self-spec verify forwards: one drafting canvas after the last clean row ("last": a rejection costs a cold
# step), one after every clean row ("all": whatever prefix is accepted, its drafts are ready), or chosen each
# step from the measured forward cost and acceptance ("auto", bdcore/decode/speculation.py).
SELF_SPEC_CANVASES = ("last", "all", "auto")
AUTO = "auto"  # draft_len / self_spec_canvases: chosen each step by the engine


class DecodeSettingsError(ValueError):
    """Decode settings a checkpoint cannot run; the message names the setting and the limit."""


def denoise_budget(block: int, steps: int | None, *, shift: bool = True) -> int:
    """Denoise forwards a diffusion block may take: `steps`, by default one per slot the canvas predicts
    (a shifted block's seed comes from the forward before; an unshifted block predicts every slot)."""
    return steps or max(1, block - 1 if shift else block)


@dataclass(frozen=True)
class ResolvedDecode:
    """Settings with every default filled in from the checkpoint's block size."""

    mode: str
    block: int  # diffusion canvas
    budget: int  # diffusion: denoise forwards per block at most
    threshold: float
    draft_len: int  # self-spec N (with auto_draft_len: the longest the engine may choose)
    fuse_commit: bool
    canvases: str = "last"  # self-spec: SELF_SPEC_CANVASES
    auto_draft_len: bool = False  # self-spec: the engine chooses the draft length each step (0: a causal step)

    def auto_draft(self) -> AutoDraft | None:
        """What the engine's speculation policy chooses for this request; None: fixed settings."""
        if self.mode != "self-spec" or not (self.auto_draft_len or self.canvases == AUTO):
            return None
        return AutoDraft(self.draft_len - 1, self.canvases, None if self.auto_draft_len else self.draft_len - 1)


@dataclass(frozen=True)
class DecodeConfig:
    mode: str = "causal"
    block_size: int | None = None  # diffusion canvas (default: the checkpoint's bd_size)
    threshold: float = 0.9  # diffusion: commit masked slots whose confidence exceeds this
    steps: int | None = None  # diffusion: denoise steps per block (default: block_size - 1)
    draft_len: int | str | None = None  # self-spec N (default and maximum: bd_size), or "auto" (up to bd_size)
    fuse_commit: bool = True  # diffusion: fuse each commit (the prefill too) with the next block's first denoise
    self_spec_canvases: str = "last"  # self-spec: a drafting canvas after the last clean row, or after every one

    def resolve(self, caps: Capabilities) -> ResolvedDecode:
        """Fill the defaults from the checkpoint's trained block size and check the settings against what
        it can run (`caps`: `Capabilities.from_sidecar`)."""
        caps.check_mode(self.mode, DecodeSettingsError)
        bd = caps.max_draft_len
        block = self.block_size or bd
        auto_len = self.draft_len == AUTO
        if isinstance(self.draft_len, str) and not auto_len:
            raise DecodeSettingsError(f"draft_len must be an integer >= 2 or {AUTO!r}, got {self.draft_len!r}")
        draft = bd if auto_len else self.draft_len or bd
        if self.steps is not None and self.steps < 1:
            raise DecodeSettingsError(
                f"steps must be >= 1, got {self.steps}; give a positive count, or none for block_size - 1"
            )
        if self.self_spec_canvases not in SELF_SPEC_CANVASES:
            raise DecodeSettingsError(
                f"self_spec_canvases must be one of {SELF_SPEC_CANVASES}, got {self.self_spec_canvases!r}"
            )
        if not self.threshold >= 0.0:  # above 1: one slot per step (nothing is ever that confident)
            raise DecodeSettingsError(
                f"threshold must be a number >= 0, got {self.threshold}; give one in [0, 1] (default 0.9)"
            )
        if self.mode != "causal":
            if (too_long := caps.draft_len_refusal(draft) or caps.block_size_refusal(block)) is not None:
                raise DecodeSettingsError(too_long)
            if block < 2 or draft < 2:
                raise DecodeSettingsError(
                    f"block_size and draft_len must be >= 2, got {block} and {draft}; give at least 2 "
                    f"(default: the trained block size {bd})"
                )
            if self.mode == "self-spec" and self.self_spec_canvases == "all":
                if (too_many := caps.canvas_rows_refusal(draft * draft)) is not None:
                    raise DecodeSettingsError(f"self_spec_canvases all with draft_len {draft}: {too_many}")
        budget = denoise_budget(block, self.steps, shift=caps.shift)
        return ResolvedDecode(
            self.mode, block, budget, self.threshold, draft, self.fuse_commit, self.self_spec_canvases, auto_len
        )
