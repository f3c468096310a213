"""The `--dllm-algorithm-config` YAML of bdstack's SGLang algorithms: one definition, two readers.

`serve.py` (our environment) writes it; the SGLang process (SGLang's own environment, other pins)
reads it back through `DecodeSettings.from_dict`. The fields and checks it shares with the vLLM backend's settings
are `inference.backend_settings.BackendSettings`'; defaults and limits come from `bdcore.decode.config`, the native
engine's own definitions.
"""

from __future__ import annotations

from dataclasses import dataclass

from inference.backend_settings import BackendSettings

DIFFUSION = "BdstackDiffusion"
SELF_SPEC = "BdstackSelfSpec"
ALGORITHMS = {"diffusion": DIFFUSION, "self-spec": SELF_SPEC}


@dataclass(frozen=True)
class DecodeSettings(BackendSettings):
    """What our algorithms read. `block_size` is the canvas: the diffusion block, or self-spec's N; the other
    fields are `BackendSettings`' (keyword only)."""

    algorithm: str  # the mode, as SGLang's --dllm-algorithm names it
    block_size: int
    mode_key, modes, canvas_key = "algorithm", tuple(ALGORITHMS.values()), "block_size"

    @property
    def mode(self) -> str:
        return next(mode for mode, algorithm in ALGORITHMS.items() if algorithm == self.algorithm)

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
