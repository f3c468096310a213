"""Whether vLLM serves a bdstack checkpoint as the plugin's settings ask, decided inside vLLM's process.

The rules are `bdcore.serving_gate`'s "vllm" backend. `serve.py` asks the gate before it builds the command
(our environment); the plugin asks it again here, from the sidecar and config.json only, when vLLM loads the
model (its environment), so a command written by hand is held to the same rules.
"""

from __future__ import annotations

from pathlib import Path

from bdcore.capabilities import Capabilities, read_capabilities
from bdcore.decode.config import ResolvedDecode
from bdcore.serving_gate import resolve
from inference.vllm_backend.settings import VllmDecodeSettings


def check_servable(model_dir: str | Path, settings: VllmDecodeSettings) -> ResolvedDecode:
    """The settings resolved on the checkpoint at `model_dir`; `CannotServe` naming the reason if vLLM cannot
    serve them there (a directory without config.json is judged as a plain checkpoint: it has no sidecar)."""
    caps = read_capabilities(model_dir) or Capabilities.from_sidecar(None)
    return resolve(caps, settings.decode_config(), "vllm")
