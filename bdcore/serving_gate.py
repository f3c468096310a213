"""The serving gate: whether a backend can serve a decode on a checkpoint, and the settings it then runs.

`resolve(caps, settings, backend)` is the one function that answers it (docs/design.md sections 5, 6, 8.7,
8.11, 8.13, 8.14). Every entry point asks it: the native loader and engine (at start and for every request),
the trainer's rollouts, serve.py before it builds an SGLang or vLLM command, and the SGLang and vLLM plugins
inside those engines (so a command written by hand is held to the same rules). It returns the settings with
every default filled in from the checkpoint, or raises `CannotServe`, one message per reason that names the
problem and the fix.

What each backend serves (`CHECKPOINT_RULES`; tests/test_serving_gate.py writes the table out by hand):
- native: causal on every checkpoint it decodes at all (not an unshifted one with a causal clean stream or
  with gated-delta layers: no training run writes those); diffusion on block-diffusion checkpoints; self-spec
  where there is a token-causal AR head (shifted, clean_causal) to verify drafts.
- sglang, vllm: causal on anything (their stock engine on the HF weights); diffusion and self-spec on shifted,
  causal-clean checkpoints, draft adapters included (each engine's own LoRA machinery, routed per token to
  canvas rows: inference/sglang_backend/draft_lora.py, inference/vllm_backend/draft_lora.py); SGLang takes
  hybrids only with a within-block-causal canvas and without a draft adapter, vLLM no hybrid and only the
  architectures its plugin extends. Both run fixed layouts (one canvas after the last clean row, a fixed draft
  length, a chain of drafts: no draft trees).

Stdlib only at import: the SGLang and vLLM plugins import it in those engines' own environments.
"""

from __future__ import annotations

from collections.abc import Callable
from math import isqrt

from bdcore.capabilities import MODES, Capabilities
from bdcore.decode.config import AUTO, SELF_SPEC_CANVASES, TREE_OFF, DecodeConfig, ResolvedDecode, denoise_budget
from bdcore.decode.tree import parse_tree
from bdcore.sidecar import SIDECAR_NAME

BACKENDS = ("native", "sglang", "vllm")
# The stock vLLM architectures inference/vllm_backend registers a block-diffusion class for.
VLLM_ARCHITECTURES = frozenset({"Qwen3ForCausalLM"})

NOT_WITH_NOISE_FILL = (
    "diffusion mode commits a block slot by slot and needs <|mask|> to mark the slots still undecided; this "
    "checkpoint was trained with canvases of random ids (canvas_fill: noise in block_diffusion.json), which drafts "
    "for self-spec only: serve it with --mode self-spec, or --mode causal"
)


class CannotServe(ValueError):
    """A decode a backend cannot serve on a checkpoint; the message says why and what to do. `setting` names
    what to change: "mode" (the mode, or the checkpoint), "backend", or a decode setting ("block_size",
    "draft_len", "steps", "threshold", "self_spec_canvases", "tree"), so a server can point a client at its field."""

    def __init__(self, message: str, setting: str = "mode"):
        super().__init__(message)
        self.setting = setting


def resolve(caps: Capabilities, settings: DecodeConfig, backend: str) -> ResolvedDecode:
    """`settings` on the checkpoint with capabilities `caps`, served by `backend`, with every default filled in
    from the checkpoint's trained block; `CannotServe` if the backend cannot serve them there."""
    if backend not in CHECKPOINT_RULES:
        raise CannotServe(f"unknown backend {backend!r}; choose one of {BACKENDS}", "backend")
    if settings.mode not in MODES:
        raise CannotServe(f"unknown mode {settings.mode!r}; choose one of {MODES}")
    if (why := CHECKPOINT_RULES[backend](caps, settings.mode)) is not None:
        raise CannotServe(why)
    if backend != "native":
        if settings.mode == "causal":  # the stock engine on the HF weights: none of our settings reach it
            return _filled(caps, settings)
        _check_fixed_layout(settings, "SGLang" if backend == "sglang" else "vLLM")
    _check_ranges(settings)
    resolved = _filled(caps, settings)
    if settings.mode != "causal":
        _check_limits(caps, resolved)
    return resolved


def serves(caps: Capabilities, settings: DecodeConfig, backend: str) -> bool:
    try:
        resolve(caps, settings, backend)
    except CannotServe:
        return False
    return True


def served_modes(caps: Capabilities, backend: str) -> tuple[str, ...]:
    """The modes `backend` decodes on this checkpoint (each still subject to its settings)."""
    return tuple(mode for mode in MODES if CHECKPOINT_RULES[backend](caps, mode) is None)


# -- what each backend serves on which checkpoint ----------------------------------------------------------
def _native(caps: Capabilities, mode: str) -> str | None:
    if not caps.shift and caps.clean_causal:
        return (
            f"{SIDECAR_NAME} says shift: false with clean_causal: true; an unshifted (single-stream) checkpoint sees "
            "its blocks both ways (clean_causal: false), so this pair matches no training run: fix the sidecar or "
            "re-export the checkpoint with train.py"
        )
    if not caps.shift and caps.hybrid:
        return (
            "the checkpoint is an unshifted (single-stream) checkpoint of a gated-delta hybrid; train.py writes none "
            "and the native engine does not decode one"
        )
    if mode == "causal":
        return None
    if not caps.block_diffusion:
        return (
            f"mode {mode!r} needs a block-diffusion checkpoint ({SIDECAR_NAME} with <|mask|>); this one is a "
            "plain AR model: serve it with --mode causal, or convert it with train.py"
        )
    if mode == "diffusion" and caps.canvas_fill != "mask":
        return NOT_WITH_NOISE_FILL
    if mode == "self-spec" and not caps.shift:
        return (
            "self-spec needs a token-causal AR head to verify drafts; this checkpoint is unshifted (single-stream "
            "masked diffusion, shift: false), which has none: serve it with --mode diffusion, or --mode causal "
            "(block by block, one token per step)"
        )
    if mode == "self-spec" and not caps.clean_causal:
        return (
            f"self-spec needs a causal AR head (clean_causal: true in {SIDECAR_NAME}); this checkpoint was "
            "trained with a block-causal clean stream: serve it with --mode diffusion"
        )
    return None


def _outside_native(caps: Capabilities, mode: str, engine: str) -> str | None:
    """What SGLang and vLLM share: they run every row through the same weights, encode committed tokens
    causally and decode shifted checkpoints; causal mode is the stock engine on the HF weights."""
    if mode == "causal":
        return None
    if not caps.block_diffusion:
        return (
            f"the checkpoint has no {SIDECAR_NAME}: it is not a bdstack block-diffusion checkpoint, and --mode {mode} "
            "needs a bdstack checkpoint directory; serve it with --mode causal, or convert it with train.py"
        )
    if caps.canvas_fill != "mask":
        return (
            f"the checkpoint's canvases are filled with random ids (canvas_fill: {caps.canvas_fill}), and our {engine} "
            "algorithms fill them with <|mask|>: serve it with --backend native"
        )
    if not caps.clean_causal:
        return f"{engine} encodes committed tokens causally; checkpoints with clean_causal: false need --backend native"
    if not caps.shift:
        return (
            f"the checkpoint is unshifted (shift: false); our {engine} algorithms decode shifted ones: serve it with "
            "--backend native"
        )
    return None


def _sglang(caps: Capabilities, mode: str) -> str | None:
    """Our SGLang algorithms (inference/sglang_backend)."""
    if (why := _outside_native(caps, mode, "SGLang")) is not None or mode == "causal":
        return why
    if caps.hybrid and caps.draft_adapter:
        return (
            "a draft adapter on a hybrid (gated-delta) checkpoint is not served by SGLang 0.5.23 in diffusion/"
            "self-spec modes: SGLang turns --enable-lora off for dLLM algorithms, so its Qwen3.5 layers run their "
            "fused input projection, which bypasses LoRA, and it has no LoRA layer for in_proj_ba; serve it with "
            "--backend native (--mode causal on SGLang serves the base model)"
        )
    if caps.hybrid and not caps.within_block_causal:
        return (
            "hybrid (gated-delta) checkpoints trained with a bidirectional canvas are not served by SGLang in "
            "diffusion/self-spec modes: SGLang's gated-delta kernels read out token-causally, and the canvas needs "
            "the block-end state's readout; serve them with --backend native (checkpoints trained with "
            "--within_block_causal are served)"
        )
    return None


def _vllm(caps: Capabilities, mode: str) -> str | None:
    """Our vLLM plugin (inference/vllm_backend)."""
    if (why := _outside_native(caps, mode, "vLLM")) is not None or mode == "causal":
        return why
    if caps.hybrid:
        return (
            "hybrid (gated-delta) checkpoints are not served by the vLLM plugin in diffusion/self-spec modes: its "
            "ModelState is attention-only, and the canvas's two-stream gated-delta state (block-entry state, "
            "block-end readout, per-token snapshots for rollback) is not expressed in vLLM's MambaHybridModelState; "
            "use --backend native (or --backend sglang for checkpoints trained --within_block_causal)"
        )
    if caps.architecture is not None and caps.architecture not in VLLM_ARCHITECTURES:
        return (
            f"the vLLM plugin extends {sorted(VLLM_ARCHITECTURES)}; this checkpoint is {caps.architecture or None!r}: "
            "use --backend native"
        )
    return None


CHECKPOINT_RULES: dict[str, Callable[[Capabilities, str], str | None]] = {
    "native": _native,
    "sglang": _sglang,
    "vllm": _vllm,
}


# -- the settings -----------------------------------------------------------------------------------------
def _check_fixed_layout(settings: DecodeConfig, engine: str) -> None:
    """SGLang and vLLM run our decodes with fixed settings: the policy (auto) and all-canvases self-spec
    (canvases sharing positions in one forward) are native-engine decodes. Said in serve.py's flags, the
    only place these settings reach those engines from."""
    if settings.self_spec_canvases != "last":
        raise CannotServe(
            f"--self-spec-canvases {settings.self_spec_canvases} is a native-engine decode ({engine} verifies one "
            "canvas per forward); use --backend native",
            "self_spec_canvases",
        )
    if settings.draft_len == AUTO:
        raise CannotServe(
            f"--draft-len auto is a native-engine decode (the {engine} plugin drafts a fixed length); give an "
            "integer, or use --backend native",
            "draft_len",
        )
    if settings.tree != TREE_OFF:  # the tree mask and a kept path of rows are native-only
        raise CannotServe(
            f"--tree {settings.tree} is a native-engine decode: a draft tree's verify needs a per-row ancestor "
            f"mask and keeps a path of non-adjacent rows in the KV cache, which our {engine} plugin does not "
            "express (it verifies one chain of drafts); use --tree off, or --backend native",
            "tree",
        )


def _check_ranges(s: DecodeConfig) -> None:
    """The settings' own ranges, in every mode (a request may switch the mode and keep the rest)."""
    if isinstance(s.draft_len, str) and s.draft_len != AUTO:
        raise CannotServe(f"draft_len must be an integer >= 2 or {AUTO!r}, got {s.draft_len!r}", "draft_len")
    if s.steps is not None and s.steps < 1:
        raise CannotServe(
            f"steps must be >= 1, got {s.steps}; give a positive count, or none for block_size - 1", "steps"
        )
    if s.self_spec_canvases not in SELF_SPEC_CANVASES:
        raise CannotServe(
            f"self_spec_canvases must be one of {SELF_SPEC_CANVASES}, got {s.self_spec_canvases!r}",
            "self_spec_canvases",
        )
    if s.tree not in (TREE_OFF, AUTO):
        try:
            parse_tree(s.tree)
        except ValueError as e:
            raise CannotServe(f"--tree: {e}; or off, or auto", "tree") from None
    if not s.threshold >= 0.0:  # above 1: one slot per step (nothing is ever that confident)
        raise CannotServe(
            f"threshold must be a number >= 0, got {s.threshold}; give one in [0, 1] "
            f"(default {DecodeConfig.threshold})",
            "threshold",
        )


def _check_limits(caps: Capabilities, r: ResolvedDecode) -> None:
    """The limits the checkpoint sets on a canvas: at most one trained block of drafts, and no canvas or
    forward longer than the model's context."""
    bd = caps.max_draft_len
    if r.draft_len > bd:  # a canvas longer than a trained block is a block the model never saw in training
        raise CannotServe(
            f"draft_len {r.draft_len} exceeds the trained block size {bd}; give at most {bd} (the default)", "draft_len"
        )
    # A canvas longer than the context: its positions do not exist, and its attention mask (block_size squared)
    # is allocated per request, which for a huge one is an out-of-memory kill rather than an error.
    context = caps.max_context
    if context is not None and r.block > context:
        raise CannotServe(
            f"block_size {r.block} exceeds the model's context length {context} (max_position_embeddings); "
            f"use at most that (default: the trained bd_size {bd})",
            "block_size",
        )
    if r.block < 2 or r.draft_len < 2:
        raise CannotServe(
            f"block_size and draft_len must be >= 2, got {r.block} and {r.draft_len}; give at least 2 "
            f"(default: the trained block size {bd})",
            "block_size" if r.block < 2 else "draft_len",
        )
    # All-canvases self-spec verifies draft_len squared rows a forward (a canvas after every clean row): no
    # forward may hold more rows than the context, or a long trained block is a huge forward.
    rows = r.draft_len * r.draft_len
    if r.mode == "self-spec" and r.canvases == "all" and context is not None and rows > context:
        raise CannotServe(
            f"self_spec_canvases all with draft_len {r.draft_len}: {rows} rows a forward exceed the model's context "
            f"length {context}; use a draft_len of at most {isqrt(context)}, or self_spec_canvases last or auto",
            "self_spec_canvases",
        )


def _filled(caps: Capabilities, s: DecodeConfig) -> ResolvedDecode:
    """The settings with the checkpoint's defaults: its trained block for the canvas and the draft."""
    bd = caps.max_draft_len
    block = s.block_size or bd
    auto_len = s.draft_len == AUTO
    draft = bd if auto_len else s.draft_len or bd
    budget = denoise_budget(block, s.steps, shift=caps.shift)
    return ResolvedDecode(
        s.mode, block, budget, s.threshold, draft, s.fuse_commit, s.self_spec_canvases, auto_len, tree=s.tree
    )
