"""What a bdstack checkpoint can be served as in vLLM: the refusals, with the reason and the fix.

`serve.py` asks before it builds the command (our environment: sidecar and tokenizer); the plugin asks
again, from the sidecar and config.json only, when vLLM loads the model (its environment), so a command
written by hand is held to the same rules.
"""

from __future__ import annotations

import json
from pathlib import Path

from bdcore.gated_delta import is_hybrid
from bdcore.sidecar import SIDECAR_NAME, read_sidecar

NOT_ON_VLLM_ADAPTER = (
    "the checkpoint carries a draft-only adapter, which acts at canvas rows only; vLLM runs every row of a "
    "forward through the same weights, so its diffusion and self-spec would not be what was trained: serve it "
    "with --backend native (--mode causal on vLLM serves the base model, which the directory holds as is)"
)
NOT_ON_VLLM_HYBRID = (
    "hybrid (gated-delta) checkpoints are not served by the vLLM plugin in diffusion/self-spec modes: its "
    "ModelState is attention-only, and the canvas's two-stream gated-delta state (block-entry state, block-end "
    "readout, per-token snapshots for rollback) is not expressed in vLLM's MambaHybridModelState; use "
    "--backend native (or --backend sglang for checkpoints trained --within_block_causal)"
)


def refusal(model_dir: str | Path, mode: str) -> str | None:
    """Why `model_dir` cannot be served in `mode` (diffusion / self-spec) by vLLM; None if it can."""
    model_dir = Path(model_dir)
    if not (model_dir / SIDECAR_NAME).is_file():
        return f"{model_dir} has no {SIDECAR_NAME}: --mode {mode} needs a bdstack checkpoint directory"
    sidecar = read_sidecar(model_dir)
    if sidecar.draft_adapter is not None:
        return NOT_ON_VLLM_ADAPTER
    if not sidecar.shift:
        return (
            "the checkpoint is unshifted (shift: false): its canvas row j predicts slot j, which the vLLM plugin "
            "does not decode; use --backend native"
        )
    if not sidecar.clean_causal:
        return "vLLM encodes committed tokens causally; checkpoints with clean_causal: false need --backend native"
    config = model_dir / "config.json"
    if config.is_file() and is_hybrid(json.loads(config.read_text())):
        return NOT_ON_VLLM_HYBRID
    from inference.vllm_backend.command import ARCHITECTURES

    stock = (json.loads(config.read_text()).get("architectures") or [None])[0] if config.is_file() else None
    if stock not in ARCHITECTURES:
        return f"the vLLM plugin extends {sorted(ARCHITECTURES)}; this checkpoint is {stock!r}: use --backend native"
    return None
