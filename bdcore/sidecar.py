"""`block_diffusion.json`: the facts a stock HF checkpoint directory carries (docs/design.md section 5)."""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from bdcore.checkpoint_files import config_value

SIDECAR_NAME = "block_diffusion.json"
FORMAT_VERSION = 2  # 2 added `draft_adapter`; a version-1 sidecar reads as a checkpoint without one
# 3 added `canvas_fill`. Written only by checkpoints whose canvases are not <|mask|> (a reader that predates the
# field would fill them with <|mask|> and draft from inputs the adapter never saw), so mask-filled checkpoints
# stay readable by every bdstack that reads version 2.
CANVAS_FILL_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
# What a canvas's undecided slots hold: the trained <|mask|> token, or uniform random ids drawn each forward
# from [0, vocab_size) (the layout SGLang's UNO drafts with; docs/design.md 8.21).
CANVAS_FILLS = ("mask", "noise")
# Fields without which a reader would have to guess the checkpoint's semantics (a wrong guess decodes
# silently differently from training), so they are refused rather than defaulted.
REQUIRED = ("bd_size", "mask_id", "shift", "clean_causal", "within_block_causal")


def _int_at_least(low: int):
    # bool is an int subclass, and `true` is no block size
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= low


def _adapter_dir(v) -> bool:
    return v is None or (isinstance(v, str) and bool(v) and "/" not in v and v[0] != ".")


# Every field's type and range, checked on read: a value of the wrong type would otherwise pass silently
# until something computes with it. Sizes bounded by the model (bd_size, mask_id) are `check_model`'s.
FIELD_RULES = {
    "bd_size": (_int_at_least(2), "an integer >= 2"),
    "mask_id": (_int_at_least(0), "a non-negative integer"),
    "mask_token": (lambda v: isinstance(v, str) and bool(v), "a non-empty string"),
    "ar_loss_weight": (
        lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0,
        "a finite number >= 0",
    ),
    "shift": (lambda v: isinstance(v, bool), "true or false"),
    "clean_causal": (lambda v: isinstance(v, bool), "true or false"),
    "within_block_causal": (lambda v: isinstance(v, bool), "true or false"),
    "views": (_int_at_least(1), "an integer >= 1 (noised views per row)"),
    "base_model": (lambda v: isinstance(v, str), "a string"),
    "global_step": (_int_at_least(0), "a non-negative integer"),
    "draft_adapter": (_adapter_dir, "null or the name of a subdirectory of the checkpoint"),
    "canvas_fill": (lambda v: v in CANVAS_FILLS, f"one of {CANVAS_FILLS}"),
}


class SidecarError(ValueError):
    """A checkpoint's sidecar is missing, malformed, of an unknown version, or disagrees with its tokenizer."""


@dataclass(frozen=True)
class Sidecar:
    bd_size: int
    mask_id: int
    mask_token: str = "<|mask|>"
    ar_loss_weight: float = 0.0
    shift: bool = True
    clean_causal: bool = True
    within_block_causal: bool = False
    views: int = 2
    base_model: str = ""
    global_step: int = 0
    # The subdirectory holding a draft-only adapter (bdcore/draft_adapter.py) over the base weights in this
    # directory; None: the weights here are the whole converted model.
    draft_adapter: str | None = None
    canvas_fill: str = "mask"  # CANVAS_FILLS
    format_version: int = FORMAT_VERSION

    def to_json(self) -> str:
        data = asdict(self)
        data.pop("format_version")
        version = FORMAT_VERSION
        if data["canvas_fill"] == "mask":
            del data["canvas_fill"]  # the meaning of every sidecar without the field
        else:
            version = CANVAS_FILL_VERSION
        return json.dumps({"format_version": version, **data}, indent=2) + "\n"

    @classmethod
    def from_dict(cls, data: dict) -> Sidecar:
        version = data.get("format_version")
        if version not in READABLE_VERSIONS:
            raise SidecarError(
                f"{SIDECAR_NAME}: format_version {version!r} is not one this bdstack reads {READABLE_VERSIONS}; "
                "upgrade bdstack or re-export the checkpoint"
            )
        known = {f.name for f in fields(cls)}
        missing = [k for k in REQUIRED if k not in data]
        if missing:
            raise SidecarError(
                f"{SIDECAR_NAME}: missing required field(s) {missing}: they decide how the checkpoint decodes, so "
                "bdstack does not guess them; re-export the checkpoint with train.py or add them by hand"
            )
        if version == 1 and data.get("draft_adapter") is not None:
            raise SidecarError(f"{SIDECAR_NAME}: draft_adapter needs format_version 2, the sidecar says 1")
        if data.get("canvas_fill", "mask") != "mask" and version < CANVAS_FILL_VERSION:
            raise SidecarError(
                f"{SIDECAR_NAME}: canvas_fill {data['canvas_fill']!r} needs format_version {CANVAS_FILL_VERSION} (a "
                f"reader of version {version} would fill canvases with <|mask|>); set format_version to "
                f"{CANVAS_FILL_VERSION} or re-export the checkpoint with train.py"
            )
        for name, (valid, what) in FIELD_RULES.items():
            if name in data and not valid(data[name]):
                raise SidecarError(
                    f"{SIDECAR_NAME}: {name} must be {what}, got {data[name]!r}; fix the field or re-export the "
                    "checkpoint with train.py"
                )
        sc = cls(**{k: v for k, v in data.items() if k in known})
        if sc.draft_adapter is not None and not sc.clean_causal:
            raise SidecarError(
                f"{SIDECAR_NAME}: a draft adapter needs clean_causal true (its clean stream is the causal base model)"
            )
        return sc

    def check_model(self, model_config) -> None:
        """Reject sizes the model cannot hold (`model_config`: an HF config, or config.json's dict): a block
        longer than its context (a canvas of bd_size rows is allocated per request, so a huge one is an
        out-of-memory kill, not an error), or a mask id outside its embedding."""
        context = config_value(model_config, "max_position_embeddings")
        if context is not None and self.bd_size > context:
            raise SidecarError(
                f"{SIDECAR_NAME}: bd_size {self.bd_size} exceeds the model's context length {context} "
                "(max_position_embeddings in config.json); fix bd_size to the block size the checkpoint was "
                "trained with"
            )
        vocab = config_value(model_config, "vocab_size")
        if vocab is not None and self.mask_id >= vocab:
            raise SidecarError(
                f"{SIDECAR_NAME}: mask_id {self.mask_id} is outside the model's embedding (vocab_size {vocab} in "
                "config.json); the sidecar and the weights come from different runs: re-export the checkpoint"
            )

    def check_tokenizer(self, tokenizer) -> None:
        """Reject a sidecar whose mask token/id disagrees with the checkpoint's tokenizer."""
        tid = tokenizer.get_vocab().get(self.mask_token)
        if tid != self.mask_id:
            raise SidecarError(
                f"{SIDECAR_NAME}: mask_id {self.mask_id} disagrees with the tokenizer, where {self.mask_token!r} "
                f"has id {tid}; the checkpoint's tokenizer and sidecar come from different runs"
            )


def write_sidecar(directory: str | os.PathLike, sidecar: Sidecar) -> None:
    Path(directory, SIDECAR_NAME).write_text(sidecar.to_json())


def read_sidecar(directory: str | os.PathLike) -> Sidecar:
    path = Path(directory, SIDECAR_NAME)
    if not path.is_file():
        raise SidecarError(f"{path} not found: not a bdstack block-diffusion checkpoint (train one with train.py)")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise SidecarError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise SidecarError(f"{path}: expected a JSON object")
    return Sidecar.from_dict(data)
