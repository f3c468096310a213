"""The `--dllm-algorithm-config` YAML of bdstack's SGLang algorithms: one definition, two readers.

`serve.py` (our environment) writes it; the SGLang process (SGLang's own environment, other pins)
reads it back through `DecodeSettings.from_dict`. Defaults and limits come from `bdcore.decode.config`,
the native engine's own definitions.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from bdcore.decode.config import DecodeConfig, denoise_budget
from bdcore.sidecar import Sidecar

DIFFUSION = "BdstackDiffusion"
SELF_SPEC = "BdstackSelfSpec"
ALGORITHMS = {"diffusion": DIFFUSION, "self-spec": SELF_SPEC}


@dataclass(frozen=True)
class DecodeSettings:
    """What our algorithms read. `block_size` is the canvas: the diffusion block, or self-spec's N."""

    algorithm: str
    block_size: int
    mask_id: int
    end_of_turn_id: int
    filler_id: int
    other_stop_ids: list[int] = field(default_factory=list)  # e.g. eos when it is not end-of-turn
    within_block_causal: bool = False  # the checkpoint's canvas attention (sidecar)
    threshold: float = DecodeConfig.threshold  # diffusion: commit masked slots whose confidence exceeds this
    steps: int | None = None  # diffusion: denoise forwards per block (None: block_size - 1)
    # the checkpoint's draft-only adapter directory, relative to it (the sidecar's `draft_adapter`): the plugin loads
    # it with SGLang's LoRA manager and routes it to canvas rows only (draft_lora.py); None: no adapter
    draft_adapter: str | None = None

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS.values():
            raise ValueError(f"algorithm {self.algorithm!r} is not one of {sorted(ALGORITHMS.values())}")
        for name in ("block_size", "mask_id", "end_of_turn_id", "filler_id", "steps"):
            value = getattr(self, name)
            if name == "steps" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {self.block_size}")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"steps must be >= 1 (default: block_size - 1), got {self.steps}")
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
    def stop_ids(self) -> frozenset[int]:
        """Every token that ends the output: end-of-turn, the block filler, and the others."""
        return frozenset({self.end_of_turn_id, self.filler_id, *self.other_stop_ids})

    @property
    def denoise_steps(self) -> int:
        return denoise_budget(self.block_size, self.steps)

    @property
    def mode(self) -> str:
        return next(mode for mode, algorithm in ALGORITHMS.items() if algorithm == self.algorithm)

    def decode_config(self) -> DecodeConfig:
        """These settings as the decode settings the serving gate judges (SGLang's commits are unfused)."""
        size = dict(draft_len=self.block_size) if self.mode == "self-spec" else dict(block_size=self.block_size)
        return DecodeConfig(self.mode, threshold=self.threshold, steps=self.steps, fuse_commit=False, **size)

    def sidecar(self) -> Sidecar:
        """What of the checkpoint's sidecar the settings carry into SGLang's process, where the algorithms decode:
        the canvas stands for the trained block (the gate held it to the block when serve.py wrote the settings
        and when the plugin loaded them)."""
        return Sidecar(
            bd_size=self.block_size,
            mask_id=self.mask_id,
            within_block_causal=self.within_block_causal,
            draft_adapter=self.draft_adapter,
        )

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: object) -> DecodeSettings:
        if not isinstance(data, dict):
            raise ValueError(f"the bdstack dLLM algorithm config must be a mapping, got {type(data).__name__}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown key(s) {unknown} in the bdstack dLLM algorithm config; known: {sorted(known)}")
        required = ("algorithm", "block_size", "mask_id", "end_of_turn_id", "filler_id")
        missing = sorted(k for k in required if k not in data)
        if missing:
            raise ValueError(f"missing key(s) {missing} in the bdstack dLLM algorithm config")
        return cls(**data)
