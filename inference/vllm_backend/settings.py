"""bdstack's decode settings inside vLLM: one definition, two readers.

`serve.py --backend vllm` (our environment) writes them into vLLM's `--additional-config` as
`{"bdstack": {...}}`; the plugin (vLLM's environment, other pins) reads them back from
`vllm_config.additional_config`. Defaults and limits come from `bdcore.decode.config`, the native
engine's own definitions. Stdlib + bdcore (stdlib only at import) only.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from bdcore.decode.config import DecodeConfig, denoise_budget
from bdcore.sidecar import Sidecar

MODES = ("diffusion", "self-spec")
ADDITIONAL_CONFIG_KEY = "bdstack"


@dataclass(frozen=True)
class VllmDecodeSettings:
    """What the plugin reads. `size` is the canvas: the diffusion block B, or self-spec's N."""

    mode: str
    size: int
    mask_id: int
    end_of_turn_id: int
    filler_id: int
    other_stop_ids: list[int] = field(default_factory=list)
    within_block_causal: bool = False  # the checkpoint's canvas attention (sidecar)
    threshold: float = DecodeConfig.threshold  # diffusion commit confidence
    steps: int | None = None  # diffusion denoise forwards per block (None: size - 1)
    # the checkpoint's draft-only adapter directory, relative to it (the sidecar's `draft_adapter`): vLLM loads
    # it as a LoRA and the plugin routes it to canvas rows only (draft_lora.py); None: no adapter
    draft_adapter: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        for name in ("size", "mask_id", "end_of_turn_id", "filler_id"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if self.size < 2:
            raise ValueError(f"size must be >= 2, got {self.size}")
        steps = self.steps
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
            raise ValueError(f"steps must be an integer >= 1 (default: size - 1), got {self.steps!r}")
        if len({self.mask_id, self.end_of_turn_id, self.filler_id}) != 3:
            raise ValueError("mask_id, end_of_turn_id and filler_id must be three different tokens")
        if self.mask_id in self.other_stop_ids:
            raise ValueError("other_stop_ids must not contain the mask token")
        if self.draft_adapter is not None and not (isinstance(self.draft_adapter, str) and self.draft_adapter):
            raise ValueError(f"draft_adapter must be a directory name or None, got {self.draft_adapter!r}")

    @property
    def stop_ids(self) -> frozenset[int]:
        return frozenset({self.end_of_turn_id, self.filler_id, *self.other_stop_ids})

    @property
    def denoise_steps(self) -> int:
        return denoise_budget(self.size, self.steps)

    def decode_config(self) -> DecodeConfig:
        """These settings as the decode settings the serving gate judges (vLLM's commits are unfused)."""
        size = dict(draft_len=self.size) if self.mode == "self-spec" else dict(block_size=self.size)
        return DecodeConfig(self.mode, threshold=self.threshold, steps=self.steps, fuse_commit=False, **size)

    def sidecar(self) -> Sidecar:
        """What of the checkpoint's sidecar the settings carry into vLLM's process, where the sampler decodes:
        the canvas stands for the trained block (the gate held it to the block when the command was built)."""
        return Sidecar(
            bd_size=self.size,
            mask_id=self.mask_id,
            within_block_causal=self.within_block_causal,
            draft_adapter=self.draft_adapter,
        )

    @property
    def canvas_length(self) -> int:
        """Rows of every forward after the prefill (vLLM's `canvas_length`: the drafts it schedules a
        step, `steps.py`): self-spec's verify forward [pending, N - 1 drafts, N - 1 masks], a diffusion
        block of B rows (denoise or commit). Narrower forwards are padded to it."""
        return 2 * self.size - 1 if self.mode == "self-spec" else self.size

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_additional_config(cls, additional_config) -> VllmDecodeSettings:
        data = (additional_config or {}).get(ADDITIONAL_CONFIG_KEY) if isinstance(additional_config, dict) else None
        if not isinstance(data, dict):
            raise ValueError(
                f"vLLM's --additional-config has no {ADDITIONAL_CONFIG_KEY!r} mapping: serve bdstack checkpoints in "
                "diffusion/self-spec mode through `serve.py --backend vllm`, which writes it"
            )
        unknown = sorted(set(data) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"unknown key(s) {unknown} in --additional-config's {ADDITIONAL_CONFIG_KEY!r}")
        return cls(**data)
