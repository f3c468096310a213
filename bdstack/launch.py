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
