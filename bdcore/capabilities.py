"""What a checkpoint can run: a plain value read off its sidecar and model config (docs/design.md sections 5, 6).

`Capabilities.from_sidecar(sidecar, model_config)` is the one constructor: the loader, the serve command
builders, the SGLang and vLLM plugins and the trainer (its student mapped into a `Sidecar`) all build it
there, so no two places can disagree about what a field means. `read_capabilities(path)` reads one off a
checkpoint directory without its weights. What a backend serves on it is `bdcore.serving_gate`'s.

Stdlib only at import: the SGLang and vLLM plugins import it in those engines' own environments.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from math import isqrt
from pathlib import Path

from bdcore.checkpoint_files import config_value, read_config
from bdcore.sidecar import SIDECAR_NAME, Sidecar, read_sidecar

MODES = ("causal", "diffusion", "self-spec")

NOT_WITH_DRAFT_ADAPTER = (
    "the checkpoint carries a draft-only adapter, which acts at canvas rows only; {engine} runs every row of a "
    "forward through the same weights, so its diffusion and self-spec would not be what was trained: serve it "
    "with --backend native (--mode causal on {engine} serves the base model, which the directory holds as is)"
)


class CapabilityError(ValueError):
    """A mode, setting or backend the checkpoint cannot serve; the message says why and what to do."""


@dataclass(frozen=True)
class Capabilities:
    """A checkpoint's decode facts. `bd_size` None: a plain AR checkpoint (causal rows only)."""

    bd_size: int | None = None
    mask_id: int | None = None
    shift: bool = True  # False: unshifted (single-stream); canvas row j predicts slot j, no AR head
    clean_causal: bool = True  # committed tokens attend causally (False: block-causally)
    within_block_causal: bool = False  # canvas rows attend causally within their block (False: both ways)
    draft_adapter: bool = False  # a draft-only adapter acts at canvas rows only
    hybrid: bool | None = None  # gated-delta layers (None: the model config was not read)
    max_context: int | None = None  # max_position_embeddings (None: the model config was not read)
    architecture: str | None = None  # config.json's architectures[0] (None: the model config was not read)
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
            stop_ids=stop_ids,
            **facts,
        )

    # -- modes ---------------------------------------------------------------------------------------
    @property
    def block_diffusion(self) -> bool:
        return self.bd_size is not None

    @property
    def ar_head(self) -> bool:
        """A token-causal AR head over a causal clean stream: what verifies drafts and scores AR answers."""
        return self.shift and self.clean_causal

    def mode_refusal(self, mode: str) -> str | None:
        """Why the native engine cannot decode `mode` on this checkpoint; None: it can."""
        if mode not in MODES:
            return f"unknown mode {mode!r}; choose one of {MODES}"
        if mode == "causal":
            return None
        if not self.block_diffusion:
            return (
                f"mode {mode!r} needs a block-diffusion checkpoint ({SIDECAR_NAME} with <|mask|>); this one is a "
                "plain AR model: serve it with --mode causal, or convert it with train.py"
            )
        if mode == "self-spec" and not self.shift:
            return (
                "self-spec needs a token-causal AR head to verify drafts; this checkpoint is unshifted (single-stream "
                "masked diffusion, shift: false), which has none: serve it with --mode diffusion, or --mode causal "
                "(block by block, one token per step)"
            )
        if mode == "self-spec" and not self.clean_causal:
            return (
                f"self-spec needs a causal AR head (clean_causal: true in {SIDECAR_NAME}); this checkpoint was "
                "trained with a block-causal clean stream: serve it with --mode diffusion"
            )
        return None

    @property
    def modes(self) -> tuple[str, ...]:
        """The modes the native engine decodes on this checkpoint."""
        return tuple(m for m in MODES if self.mode_refusal(m) is None)

    def check_mode(self, mode: str, error: type[Exception] = CapabilityError) -> None:
        if (why := self.mode_refusal(mode)) is not None:
            raise error(why)

    # -- attention and drafts ------------------------------------------------------------------------
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

    def block_size_refusal(self, block_size: int) -> str | None:
        """A canvas longer than the model's context: its positions do not exist, and its attention mask
        (block_size squared) is allocated per request, which for a huge one is an out-of-memory kill."""
        if self.max_context is not None and block_size > self.max_context:
            return (
                f"block_size {block_size} exceeds the model's context length {self.max_context} "
                f"(max_position_embeddings); use at most that (default: the trained bd_size {self.max_draft_len})"
            )
        return None

    def canvas_rows_refusal(self, rows: int) -> str | None:
        """All-canvases self-spec verifies draft_len squared rows a forward (a canvas after every clean row):
        no forward may hold more rows than the model's context, or a long trained block is a huge forward."""
        if self.max_context is not None and rows > self.max_context:
            return (
                f"{rows} rows a forward exceed the model's context length {self.max_context}; use a draft_len of "
                f"at most {isqrt(self.max_context)}, or self_spec_canvases last or auto"
            )
        return None

    def draft_len_refusal(self, draft_len: int) -> str | None:
        """A canvas longer than a trained block is a block the model never saw in training."""
        if draft_len > self.max_draft_len:
            return (
                f"draft_len {draft_len} exceeds the trained block size {self.max_draft_len}; give at most "
                f"{self.max_draft_len} (the default)"
            )
        return None

    # -- backends ------------------------------------------------------------------------------------
    def backend_refusal(self, backend: str, mode: str) -> str | None:
        """Why `backend` cannot serve `mode` on this checkpoint; None: it can."""
        if backend not in BACKENDS:
            return f"unknown backend {backend!r}; choose one of {sorted(BACKENDS)}"
        return BACKENDS[backend](self, mode)

    def serves(self, backend: str, mode: str) -> bool:
        return self.backend_refusal(backend, mode) is None


def _native(caps: Capabilities, mode: str) -> str | None:
    return caps.mode_refusal(mode)


def _refusal_outside_native(caps: Capabilities, mode: str, name: str) -> str | None:
    """What SGLang and vLLM share: they run every row through the same weights, encode committed tokens
    causally and decode shifted checkpoints; causal mode is the stock engine on the HF weights."""
    if mode == "causal":
        return None
    if mode not in MODES:
        return f"unknown mode {mode!r}; choose one of {MODES}"
    if not caps.block_diffusion:
        return f"--mode {mode} needs a bdstack checkpoint directory (with {SIDECAR_NAME})"
    if caps.draft_adapter:
        return NOT_WITH_DRAFT_ADAPTER.format(engine=name)
    if not caps.clean_causal:
        return f"{name} encodes committed tokens causally; checkpoints with clean_causal: false need --backend native"
    if not caps.shift:
        return f"the checkpoint is unshifted (shift: false); our {name} algorithms decode shifted ones"
    return None


def _sglang(caps: Capabilities, mode: str) -> str | None:
    """Our SGLang algorithms (inference/sglang_backend)."""
    if (why := _refusal_outside_native(caps, mode, "SGLang")) is not None or mode == "causal":
        return why
    if caps.hybrid and not caps.within_block_causal:
        return (
            "hybrid (gated-delta) checkpoints trained with a bidirectional canvas are not served by SGLang in "
            "diffusion/self-spec modes: SGLang's gated-delta kernels read out token-causally, and the canvas needs "
            "the block-end state's readout; serve them with --backend native (checkpoints trained with "
            "--within_block_causal are served)"
        )
    return None


def _vllm(caps: Capabilities, mode: str) -> str | None:
    """Our vLLM plugin (inference/vllm_backend); which architectures it extends is its own check."""
    if (why := _refusal_outside_native(caps, mode, "vLLM")) is not None or mode == "causal":
        return why
    if caps.hybrid:
        return (
            "hybrid (gated-delta) checkpoints are not served by the vLLM plugin in diffusion/self-spec modes: its "
            "ModelState is attention-only, and the canvas's two-stream gated-delta state (block-entry state, "
            "block-end readout, per-token snapshots for rollback) is not expressed in vLLM's MambaHybridModelState; "
            "use --backend native (or --backend sglang for checkpoints trained --within_block_causal)"
        )
    return None


BACKENDS: dict[str, Callable[[Capabilities, str], str | None]] = {"native": _native, "sglang": _sglang, "vllm": _vllm}


def register_backend(name: str, refusal: Callable[[Capabilities, str], str | None]) -> None:
    """Add a serving backend's rule: `refusal(caps, mode)` says why it cannot serve, or None."""
    BACKENDS[name] = refusal


def _model_facts(model_config) -> dict:
    from bdcore.gated_delta import is_hybrid  # imports torch: only where a model config is read

    architectures = config_value(model_config, "architectures") or [None]
    return dict(
        hybrid=is_hybrid(model_config),
        max_context=config_value(model_config, "max_position_embeddings"),
        architecture=architectures[0],
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
