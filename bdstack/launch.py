"""The bdstack-* console scripts: enable bdstack's source root, then run the program's own main()."""

from __future__ import annotations

import importlib

from bdstack import enable


def _run(module: str) -> object:
    enable()
    return importlib.import_module(module).main()


def train() -> object:
    return _run("train.main")


def serve() -> object:
    return _run("inference.serve")


def chat() -> object:
    return _run("inference.chat")


def evaluate() -> object:
    return _run("inference.eval")


def vllm_plugin() -> object:
    """vLLM's `vllm.general_plugins` entry point: register bdstack's model classes in every vLLM process."""
    enable()
    return importlib.import_module("inference.vllm_backend.plugin").register()
