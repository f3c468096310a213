"""What a bdstack checkpoint can be served as in vLLM: the refusals, with the reason and the fix.

The rules are `bdcore.capabilities`' "vllm" backend; this adds the one only the plugin knows (which stock
architectures it extends). `serve.py` asks before it builds the command (our environment); the plugin asks
again, from the sidecar and config.json only, when vLLM loads the model (its environment), so a command
written by hand is held to the same rules.
"""

from __future__ import annotations

import json
from pathlib import Path

from bdcore.capabilities import Capabilities
from bdcore.sidecar import SIDECAR_NAME, read_sidecar


def refusal(model_dir: str | Path, mode: str) -> str | None:
    """Why `model_dir` cannot be served in `mode` (diffusion / self-spec) by vLLM; None if it can."""
    model_dir = Path(model_dir)
    if not (model_dir / SIDECAR_NAME).is_file():
        return f"{model_dir} has no {SIDECAR_NAME}: --mode {mode} needs a bdstack checkpoint directory"
    config = model_dir / "config.json"
    model_config = json.loads(config.read_text()) if config.is_file() else None
    why = Capabilities.from_sidecar(read_sidecar(model_dir), model_config).backend_refusal("vllm", mode)
    if why is not None:
        return why
    from inference.vllm_backend.command import ARCHITECTURES

    stock = ((model_config or {}).get("architectures") or [None])[0]
    if stock not in ARCHITECTURES:
        return f"the vLLM plugin extends {sorted(ARCHITECTURES)}; this checkpoint is {stock!r}: use --backend native"
    return None
