"""What a checkpoint can run: a plain value read off its sidecar and model config (docs/design.md sections 5, 6).

`Capabilities.from_sidecar(sidecar, model_config)` is the one constructor: the loader, the serve command
builders, the SGLang and vLLM plugins and the trainer (its student mapped into a `Sidecar`) all build it
there, so no two places can disagree about what a field means. `read_capabilities(path)` reads one off a
checkpoint directory without its weights. What a backend serves on it is `bdcore.serving_gate`'s.

Stdlib only at import: the SGLang and vLLM plugins import it in those engines' own environments.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from bdcore.checkpoint_files import config_value, read_config
from bdcore.sidecar import SIDECAR_NAME, Sidecar, read_sidecar

MODES = ("causal", "diffusion", "self-spec")


@dataclass(frozen=True)
class Capabilities:
    """A checkpoint's decode facts. `bd_size` None: a plain AR checkpoint (causal rows only)."""

    bd_size: int | None = None
    mask_id: int | None = None
    shift: bool = True  # False: unshifted (single-stream); canvas row j predicts slot j, no AR head
    clean_causal: bool = True  # committed tokens attend causally (False: block-causally)
    within_block_causal: bool = False  # canvas rows attend causally within their block (False: both ways)
    draft_adapter: bool = False  # a draft-only adapter acts at canvas rows only
    canvas_fill: str = "mask"  # what undecided canvas slots hold: <|mask|>, or "noise" (uniform ids, sidecar.py)
    vocab_size: int | None = None  # the embedding's rows, noise's range (None: the model config was not read)
    hybrid: bool | None = None  # gated-delta layers (None: the model config was not read)
    max_context: int | None = None  # max_position_embeddings (None: the model config was not read)
    # config.json's architectures[0], "" when it names none (None: the model config was not read)
    architecture: str | None = None
    stop_ids: frozenset[int] = frozenset()  # end-of-turn, eos, the block filler (from the tokenizer)

    @classmethod
    def from_sidecar(
        cls,
        sidecar: Sidecar | None,
        model_config=None,
        *,
        mask_id: int | None = None,
        stop_ids: frozenset[int] = frozenset(),
    ) -> Capabilities:
        """What the checkpoint with this sidecar (None: a plain AR checkpoint, no block_diffusion.json) can run.
        `model_config` (an HF config, or config.json's dict) adds what the sidecar does not hold: gated-delta
        layers, the context length, the architecture. `mask_id`: the tokenizer's id of <|mask|> where the
        caller has the tokenizer (the sidecar's otherwise); `stop_ids`: the tokenizer's stop tokens."""
        facts = {} if model_config is None else _model_facts(model_config)
        if sidecar is None:
            return cls(mask_id=mask_id, stop_ids=stop_ids, **facts)
        return cls(
            bd_size=sidecar.bd_size,
            mask_id=sidecar.mask_id if mask_id is None else mask_id,
            shift=sidecar.shift,
            clean_causal=sidecar.clean_causal,
            within_block_causal=sidecar.within_block_causal,
            draft_adapter=sidecar.draft_adapter is not None,
            canvas_fill=sidecar.canvas_fill,
            stop_ids=stop_ids,
            **facts,
        )

    @property
    def block_diffusion(self) -> bool:
        return self.bd_size is not None

    @property
    def ar_head(self) -> bool:
        """A token-causal AR head over a causal clean stream: what verifies drafts and scores AR answers."""
        return self.shift and self.clean_causal

    def attention(self, mode: str) -> dict[str, str]:
        """The attention of each row kind in a forward of `mode`: committed tokens, and canvas rows."""
        clean = "causal" if self.clean_causal else "block-causal"
        if mode == "causal" or not self.block_diffusion:
            return {"clean": clean}
        return {"clean": clean, "canvas": "causal within the block" if self.within_block_causal else "bidirectional"}

    @property
    def max_draft_len(self) -> int:
        """The longest self-spec draft (or diffusion canvas) the checkpoint was trained on: its block."""
        return self.bd_size or 1


def _model_facts(model_config) -> dict:
    from bdcore.gated_delta import is_hybrid  # imports torch: only where a model config is read

    architectures = config_value(model_config, "architectures") or [""]
    return dict(
        hybrid=is_hybrid(model_config),
        max_context=config_value(model_config, "max_position_embeddings"),
        architecture=architectures[0],
        vocab_size=config_value(model_config, "vocab_size"),
    )


def read_capabilities(path: str | os.PathLike) -> Capabilities | None:
    """What the checkpoint at `path` can decode, read off its sidecar and config.json alone (no weights, no
    tokenizer: stop ids are not filled in), so settings are checked before a long load; None: not a model
    directory (`bdcore.loading.load_checkpoint` says why)."""
    path = Path(path)
    if not (path / "config.json").is_file():
        return None
    if not (path / SIDECAR_NAME).is_file():
        return Capabilities.from_sidecar(None)
    config, sidecar = read_config(path), read_sidecar(path)  # a malformed file: one line naming it
    sidecar.check_model(config)  # a size the model cannot hold is the sidecar's fault, not a flag's
    return Capabilities.from_sidecar(sidecar, config)
