"""Copies of a model directory with one file damaged, as downloads and hand edits leave them, and the words
the one-line error must use for each (tests/test_checkpoint.py, test_cli.py, test_serve_cli.py)."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path


def _weights(d: Path) -> Path:
    return d / "model.safetensors"


def _cut(d: Path, keep: int) -> None:
    data = _weights(d).read_bytes()
    _weights(d).write_bytes(data[:keep])


def _header_length(d: Path, length: int) -> None:
    data = _weights(d).read_bytes()
    _weights(d).write_bytes(struct.pack("<Q", length) + data[8:])


def _bad_dtype(d: Path) -> None:
    """A header that parses and fits the file, with a dtype safetensors does not know: only safetensors'
    own reader sees it."""
    data = _weights(d).read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    name = next(k for k in header if k != "__metadata__")
    header[name]["dtype"] = "Q9"
    raw = json.dumps(header, separators=(",", ":")).encode().ljust(length)  # as compact as the writer
    assert len(raw) == length
    _weights(d).write_bytes(data[:8] + raw + data[8 + length :])


def _edit_config(d: Path, **change) -> None:
    config = json.loads((d / "config.json").read_text())
    config.update(change)
    (d / "config.json").write_text(json.dumps(config))


def _header_end(d: Path) -> int:
    return 8 + struct.unpack("<Q", _weights(d).read_bytes()[:8])[0]


# name: (damage a directory in place, a phrase the error must contain)
DAMAGES = {
    "empty_weights": (lambda d: _cut(d, 0), "model.safetensors is empty"),
    "cut_in_header": (lambda d: _cut(d, 100), "model.safetensors is truncated or corrupt"),
    "cut_in_tensors": (lambda d: _cut(d, _header_end(d) + 10), "model.safetensors is truncated"),
    "huge_header": (lambda d: _header_length(d, 2**40), "header claims 1099511627776 bytes"),
    "unknown_dtype": (_bad_dtype, "cannot load the weights"),
    "malformed_config": (lambda d: (d / "config.json").write_text('{"model_type": "qwen3", '), "not valid JSON"),
    "vocab_mismatch": (
        lambda d: _edit_config(d, vocab_size=json.loads((d / "config.json").read_text())["vocab_size"] + 7),
        "embed_tokens.weight has",
    ),
    "no_tokenizer": (lambda d: (d / "tokenizer.json").unlink(), "has no tokenizer files"),
}


def damaged_copy(src: Path, dst: Path, damage: str) -> tuple[Path, str]:
    """A copy of the model directory `src` at `dst` with `damage` done; returns it and the expected phrase."""
    shutil.copytree(src, dst)
    do, phrase = DAMAGES[damage]
    do(dst)
    return dst, phrase
