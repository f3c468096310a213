"""What the SGLang and vLLM backends share inside the engine's process: the decode settings' common fields and
checks, and the draft adapter's name and routing interface.

Each backend writes its settings in our environment (`serve.py`) and reads them back in the engine's own (other
torch and transformers pins), so this module imports the standard library and bdcore's stdlib-only
`decode.config` and `sidecar` only. What the backends share in our environment alone is `backend_command.py`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import KW_ONLY, asdict, dataclass, field
from typing import ClassVar

from bdcore.decode.config import DecodeConfig, denoise_budget
from bdcore.sidecar import Sidecar

DRAFT_LORA_NAME = "bdstack-draft"  # the draft adapter's name in the engine's LoRA machinery; no request can name it


@dataclass(frozen=True)
class BackendSettings:
    """What our decoders read inside an engine. A subclass adds the mode and the canvas (the diffusion block, or
    self-spec's N) as its file names them, SGLang's `algorithm` and `block_size`, vLLM's `mode` and `size`, and says
    which they are (`mode_key`, `canvas_key`), which values the mode's key takes (`modes`), and the `mode`."""

    mode_key: ClassVar[str]
    modes: ClassVar[tuple[str, ...]]
    canvas_key: ClassVar[str]
    _: KW_ONLY
    mask_id: int
    end_of_turn_id: int
    filler_id: int
    other_stop_ids: list[int] = field(default_factory=list)  # e.g. eos when it is not end-of-turn
    within_block_causal: bool = False  # the checkpoint's canvas attention (sidecar)
    threshold: float = DecodeConfig.threshold  # diffusion: commit masked slots whose confidence exceeds this
    steps: int | None = None  # diffusion: denoise forwards per block (None: the canvas - 1)
    # the checkpoint's draft-only adapter directory, relative to it (the sidecar's `draft_adapter`): the plugin has the
    # engine's LoRA machinery load it and routes it to canvas rows only (a `DraftRouter`); None: no adapter
    draft_adapter: str | None = None

    def __post_init__(self) -> None:
        """Refuse, by key, settings no decoder can run."""
        named, canvas_name = getattr(self, self.mode_key), self.canvas_key
        if named not in self.modes:
            raise ValueError(f"{self.mode_key} {named!r} is not one of {sorted(self.modes)}")
        for name in (canvas_name, "mask_id", "end_of_turn_id", "filler_id"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if self.canvas < 2:
            raise ValueError(f"{canvas_name} must be >= 2, got {self.canvas}")
        steps = self.steps
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
            raise ValueError(f"steps must be an integer >= 1 (default: {canvas_name} - 1), got {steps!r}")
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float)):
            raise ValueError(f"threshold must be a number, got {self.threshold!r}")
        if len({self.mask_id, self.end_of_turn_id, self.filler_id}) != 3:
            raise ValueError("mask_id, end_of_turn_id and filler_id must be three different tokens")
        if not isinstance(self.other_stop_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in self.other_stop_ids
        ):
            raise ValueError(f"other_stop_ids must be a list of token ids, got {self.other_stop_ids!r}")
        if self.mask_id in self.other_stop_ids:
            raise ValueError("other_stop_ids must not contain the mask token")
        if self.draft_adapter is not None and not (isinstance(self.draft_adapter, str) and self.draft_adapter):
            raise ValueError(f"draft_adapter must be a directory name or None, got {self.draft_adapter!r}")

    @property
    def canvas(self) -> int:
        return getattr(self, self.canvas_key)

    @property
    def stop_ids(self) -> frozenset[int]:
        """Every token that ends the output: end-of-turn, the block filler, and the others."""
        return frozenset({self.end_of_turn_id, self.filler_id, *self.other_stop_ids})

    @property
    def denoise_steps(self) -> int:
        return denoise_budget(self.canvas, self.steps)

    def decode_config(self) -> DecodeConfig:
        """These settings as the decode settings the serving gate judges (the engines' commits are unfused)."""
        size = dict(draft_len=self.canvas) if self.mode == "self-spec" else dict(block_size=self.canvas)
        return DecodeConfig(self.mode, threshold=self.threshold, steps=self.steps, fuse_commit=False, **size)

    def sidecar(self) -> Sidecar:
        """What of the checkpoint's sidecar the settings carry into the engine's process, where the decoders run:
        the canvas stands for the trained block (the gate held it to the block when serve.py wrote the settings and
        when the plugin loaded them)."""
        return Sidecar(
            bd_size=self.canvas,
            mask_id=self.mask_id,
            within_block_causal=self.within_block_causal,
            draft_adapter=self.draft_adapter,
        )

    def to_dict(self) -> dict:
        return asdict(self)


class DraftRouter(ABC):
    """A checkpoint's draft adapter in the engine's own LoRA machinery, routed per token: before a forward the
    decoders name the rows that draft (`Rows.drafting` of each planned forward, every token of the forward in batch
    order), which take the adapter; every other row runs the base weights. The LoRA arithmetic is the engine's."""

    @abstractmethod
    def route(self, drafting: list[bool], num_reqs: int | None = None) -> object:
        """The next forward runs the adapter at its `drafting` rows; `num_reqs`: the requests in that forward, for
        an engine whose mapping also has an entry per request."""

    @abstractmethod
    def reset(self) -> None:
        """Every row after this runs the base weights."""
