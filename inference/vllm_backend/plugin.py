"""bdstack's vLLM plugin (checked against vLLM 0.33.0): `register()` is the `vllm.general_plugins` entry point.

vLLM loads every `vllm.general_plugins` entry point in each of its processes (`vllm/plugins/__init__.py`:
`load_general_plugins`, filtered by the VLLM_PLUGINS allow-list), so `register()` must be cheap and
idempotent: it only tells vLLM's ModelRegistry, lazily ("module:Class", nothing imported, no CUDA
touched), which class serves each architecture `serve.py --backend vllm` writes into `--hf-overrides`.
"""

from __future__ import annotations

import logging

from inference.vllm_backend.command import ARCHITECTURES

logger = logging.getLogger("bdstack.vllm")
TESTED_VLLM = "0.33.0"
MODEL_MODULE = "inference.vllm_backend.model"


class PluginError(ValueError):
    """A bdstack checkpoint or setting vLLM cannot serve as asked."""


def registrations() -> dict[str, str]:
    """architecture -> "module:Class", as ModelRegistry.register_model takes them."""
    return {ours: f"{MODEL_MODULE}:{ours}" for ours in ARCHITECTURES.values()}


def register() -> None:
    try:
        import vllm
        from vllm import ModelRegistry
    except ImportError as e:
        raise PluginError(
            f"vLLM is not installed in this interpreter ({e}); see inference/vllm_backend/README.md"
        ) from e
    version = getattr(vllm, "__version__", "unknown")
    if version != TESTED_VLLM:
        logger.warning("bdstack's vLLM plugin was written against vLLM %s; this is %s", TESTED_VLLM, version)
    for arch, target in registrations().items():
        if arch not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(arch, target)
