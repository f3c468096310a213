"""A checkpoint's draft adapter directory as the GPU engines read it: its peft config, the projections it adapts,
and the trained `<|mask|>` input row.

The trainer writes the directory (`bdcore.draft_adapter.save_adapter`): a stock peft LoRA adapter
(`adapter_config.json`, `adapter_model.safetensors`) plus `mask_row.safetensors`. SGLang and vLLM load the peft part
with their own LoRA loaders; the mask row is not a LoRA term, so their plugins read it here and swap it in on the
input embedding (`bdcore.draft_adapter.attach_mask_row`, the native engine's rule).

Stdlib and torch only at import (safetensors inside `load_mask_row`): the SGLang launcher imports this in SGLang's
environment, and serve.py in ours.
"""

from __future__ import annotations

import json
from pathlib import Path

from bdcore.draft_adapter import MASK_ROW, MASK_ROW_FILE


class DraftAdapterError(ValueError):
    """A draft adapter an engine cannot load as asked; the message says why."""


def adapter_config(adapter_dir: str | Path) -> dict:
    path = Path(adapter_dir) / "adapter_config.json"
    if not path.is_file():
        raise DraftAdapterError(f"{path} is missing: copy the whole checkpoint directory (its draft adapter)")
    return json.loads(path.read_text())


def target_modules(config: dict) -> list[str]:
    """The adapted projections' names (peft writes the resolved module paths; the engines match their last part)."""
    targets = config.get("target_modules")
    names = [targets] if isinstance(targets, str) else list(targets or ())
    if not names or "all-linear" in names:
        raise DraftAdapterError(f"adapter_config.json names no resolved target modules ({targets!r})")
    return sorted({name.rsplit(".", 1)[-1] for name in names})


def load_mask_row(adapter_dir: str | Path, hidden_size: int):
    """The trained `<|mask|>` input row [hidden_size] of the adapter at `adapter_dir`."""
    from safetensors.torch import load_file

    path = Path(adapter_dir) / MASK_ROW_FILE
    if not path.is_file():
        raise DraftAdapterError(f"{path} is missing: copy the whole checkpoint directory (its draft adapter)")
    row = load_file(str(path))[MASK_ROW]
    if tuple(row.shape) != (hidden_size,):
        raise DraftAdapterError(f"{path}: a row of {tuple(row.shape)} for a model of hidden size {hidden_size}")
    return row
