"""bdstack's decode settings inside vLLM: one definition, two readers.

`serve.py --backend vllm` (our environment) writes them into vLLM's `--additional-config` as
`{"bdstack": {...}}`; the plugin (vLLM's environment, other pins) reads them back from
`vllm_config.additional_config`. The fields and checks it shares with the SGLang backend's settings are
`inference.backend_settings.BackendSettings`'; defaults and limits come from `bdcore.decode.config`, the native
engine's own definitions. Stdlib + bdcore (stdlib only at import) only.
"""

from __future__ import annotations

from dataclasses import dataclass

from inference.backend_settings import BackendSettings

MODES = ("diffusion", "self-spec")
ADDITIONAL_CONFIG_KEY = "bdstack"


@dataclass(frozen=True)
class VllmDecodeSettings(BackendSettings):
    """What the plugin reads. `size` is the canvas: the diffusion block B, or self-spec's N; the other fields
    are `BackendSettings`' (keyword only)."""

    mode: str
    size: int
    mode_key, modes, canvas_key = "mode", MODES, "size"

    @property
    def canvas_length(self) -> int:
        """Rows of every forward after the prefill (vLLM's `canvas_length`: the drafts it schedules a
        step, `steps.py`): self-spec's verify forward [pending, N - 1 drafts, N - 1 masks], a diffusion
        block of B rows (denoise or commit). Narrower forwards are padded to it."""
        return 2 * self.size - 1 if self.mode == "self-spec" else self.size

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
