"""A checkpoint's draft adapter directory as the engines read it: its peft config, the projections it adapts,
and the trained `<|mask|>` input row, each checked before any engine builds on it (`check_draft_adapter`).

The trainer writes the directory (`bdcore.draft_adapter.save_adapter`): a stock peft LoRA adapter
(`adapter_config.json`, `adapter_model.safetensors`) plus `mask_row.safetensors`. SGLang and vLLM load the peft part
with their own LoRA loaders; the mask row is not a LoRA term, so their plugins read it here and swap it in on the
input embedding (`bdcore.draft_adapter.attach_mask_row`, the native engine's rule).

Stdlib and torch only at import (safetensors inside the functions that read tensors): the SGLang launcher imports
this in SGLang's environment, and serve.py in ours.
"""

from __future__ import annotations

import math
from pathlib import Path

from bdcore.checkpoint_files import RESAVE, CheckpointError, first_line, read_json_object, safetensors_header
from bdcore.draft_adapter import MASK_ROW, MASK_ROW_FILE

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
COPY_WHOLE = "copy the whole checkpoint directory (its draft adapter)"
# The largest factor peft may scale a LoRA term by (lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora).
# Trained adapters use 0.5-16 (the trainer's default alpha = 2r gives 2; rsLoRA at r = 256 with alpha = 2r, 32),
# so 1024 leaves them a margin of 64x; a scale past 2**16 overflows fp16 on a term of size 1 alone. What lies
# above the bound is an edited or corrupt config, not a trained adapter (served with an infinite lora_alpha,
# greedy self-spec answers one empty token where causal gives eight).
MAX_LORA_SCALING = 1024.0


class DraftAdapterError(CheckpointError):
    """A draft adapter an engine cannot load as asked; the message says why (a `CheckpointError`: serve.py and the
    loaders report it as any damaged checkpoint, in one line)."""


def adapter_config(adapter_dir: str | Path) -> dict:
    """`adapter_config.json` as a dict, its LoRA sizes checked (`check_lora_config`)."""
    path = Path(adapter_dir) / CONFIG_FILE
    if not path.is_file():
        raise DraftAdapterError(f"{path} is missing: {COPY_WHOLE}")
    config = read_json_object(path, DraftAdapterError)
    check_lora_config(config, path)
    return config


def _is_rank(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _is_alpha(value) -> bool:
    # Python's json reads the literals Infinity and NaN: finiteness is checked, not assumed. Zero switches the
    # adapter off and a negative alpha flips its terms' sign; the trainer refuses both (`--lora_alpha`).
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def check_lora_config(config: dict, path: str | Path = CONFIG_FILE) -> None:
    """The LoRA sizes of a peft config: every rank a positive integer, every alpha a finite number > 0, and the
    largest scale peft derives from them at most `MAX_LORA_SCALING`."""
    fields = {"r": (_is_rank, "a positive integer (the LoRA rank)"), "lora_alpha": (_is_alpha, "a finite number > 0")}
    for key, (valid, what) in fields.items():
        if not valid(config.get(key)):
            raise DraftAdapterError(f"{path}: {key} must be {what}, got {config.get(key)!r}; {RESAVE}")
    ranks, alphas = [config["r"]], [config["lora_alpha"]]
    for key, (base, found) in {"rank_pattern": ("r", ranks), "alpha_pattern": ("lora_alpha", alphas)}.items():
        pattern = config.get(key) or {}
        valid, what = fields[base]
        if not isinstance(pattern, dict) or not all(valid(v) for v in pattern.values()):
            raise DraftAdapterError(f"{path}: {key} must map each module name to {what}, got {pattern!r}; {RESAVE}")
        found += pattern.values()
    for key in ("use_rslora", "use_dora"):
        if config.get(key) not in (None, True, False):
            raise DraftAdapterError(f"{path}: {key} must be true or false, got {config.get(key)!r}; {RESAVE}")
    rslora = config.get("use_rslora") is True
    # bounded over every pairing of an alpha with a rank (peft's patterns pair them by module name)
    scale = max(alphas) / (math.sqrt(min(ranks)) if rslora else min(ranks))
    if scale > MAX_LORA_SCALING:
        rule = "lora_alpha / sqrt(r) (use_rslora)" if rslora else "lora_alpha / r"
        raise DraftAdapterError(
            f"{path}: lora_alpha {max(alphas)!r} and r {min(ranks)} scale a LoRA term by {scale:.4g} ({rule}), "
            f"past the {MAX_LORA_SCALING:g} any trained adapter uses; restore the config its training run saved"
        )


def target_modules(config: dict) -> list[str]:
    """The adapted projections' names (peft writes the resolved module paths; the engines match their last part)."""
    targets = config.get("target_modules")
    names = [targets] if isinstance(targets, str) else list(targets or ())
    if not names or "all-linear" in names:
        raise DraftAdapterError(f"{CONFIG_FILE} names no resolved target modules ({targets!r})")
    return sorted({name.rsplit(".", 1)[-1] for name in names})


def check_draft_adapter(adapter_dir: str | Path, hidden_size: int | None = None) -> dict:
    """Everything an engine reads of a draft adapter directory, checked before it loads: the config
    (`adapter_config`), the weights and the mask row present with sound headers, the saved ranks equal to the
    config's `r` (an edited `r` would otherwise size the injected layers before the shapes are compared), the mask
    row's shape, and every weight finite (a NaN drafts nothing but NaN, and its keys reach the verified rows
    through attention; the served adapter's SVD refuses it with a traceback). Reads the adapter's tensors one at a
    time: a few MB to a few hundred, against the base's GBs. Returns the config."""
    adapter_dir = Path(adapter_dir)
    config = adapter_config(adapter_dir)
    for name in (WEIGHTS_FILE, MASK_ROW_FILE):
        if not (adapter_dir / name).is_file():
            raise DraftAdapterError(f"{adapter_dir / name} is missing: {COPY_WHOLE}")
    headers = {file: safetensors_header(file) for file in sorted(adapter_dir.glob("*.safetensors"))}
    if not config.get("rank_pattern"):  # per-module ranks are matched by peft's patterns, at injection
        for name, entry in headers[adapter_dir / WEIGHTS_FILE].items():
            shape = entry.get("shape") if isinstance(entry, dict) else None
            if not (isinstance(shape, list) and len(shape) == 2):
                continue
            rank = shape[0] if name.endswith("lora_A.weight") else shape[1] if name.endswith("lora_B.weight") else None
            if rank is not None and rank != config["r"]:
                raise DraftAdapterError(
                    f"{adapter_dir / WEIGHTS_FILE}: {name} has rank {rank}, but {CONFIG_FILE} says r {config['r']}: "
                    f"the config and the weights come from different saves; {RESAVE}"
                )
    row = headers[adapter_dir / MASK_ROW_FILE].get(MASK_ROW)
    want = [hidden_size] if isinstance(hidden_size, int) else None
    if not isinstance(row, dict) or (want is not None and row.get("shape") != want):
        held = f"a row of shape {row.get('shape')}" if isinstance(row, dict) else f"no tensor {MASK_ROW}"
        raise DraftAdapterError(
            f"{adapter_dir / MASK_ROW_FILE} holds {held} for a model of hidden size {hidden_size}; {RESAVE}"
        )
    for file in headers:
        _check_finite(file)
    return config


def _check_finite(file: Path) -> None:
    import torch
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), framework="pt") as f:
            counts = {name: _non_finite(f.get_tensor(name), torch) for name in f.keys()}
    except SafetensorError as e:
        raise DraftAdapterError(f"cannot read {file} ({first_line(e)}); {RESAVE}") from e
    for name, bad in counts.items():
        if bad:
            raise DraftAdapterError(
                f"{file}: {name} holds {bad} non-finite value{'s' * (bad > 1)} (NaN or inf), which every draft would "
                "carry; the training diverged or the file is damaged: serve an earlier checkpoint, or retrain"
            )


def _non_finite(tensor, torch) -> int:
    return int((~torch.isfinite(tensor)).sum()) if tensor.is_floating_point() else 0


def load_mask_row(adapter_dir: str | Path, hidden_size: int):
    """The trained `<|mask|>` input row [hidden_size] of the adapter at `adapter_dir`."""
    from safetensors.torch import load_file

    path = Path(adapter_dir) / MASK_ROW_FILE
    if not path.is_file():
        raise DraftAdapterError(f"{path} is missing: {COPY_WHOLE}")
    row = load_file(str(path))[MASK_ROW]
    if tuple(row.shape) != (hidden_size,):
        raise DraftAdapterError(f"{path}: a row of {tuple(row.shape)} for a model of hidden size {hidden_size}")
    return row
