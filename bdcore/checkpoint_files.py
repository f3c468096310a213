"""Cheap checks of a model directory's files before transformers reads them (docs/design.md section 5).

A corrupt or mismatched file otherwise surfaces as a deep library traceback (safetensors' header errors,
transformers' size-mismatch report) or, worse, as memory the loader tries to allocate. `check_model_dir`
reads only `config.json` and the safetensors headers, so every loader runs it first: through
`bdcore.loading.check_checkpoint`, the native engine's loader and serve.py's SGLang and vLLM command
builders; and `train.py` (`--model_id`, `--opd_teacher`) at flag-parse time.
Stdlib only at import: `train.py` checks its flags before it imports torch.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

RESAVE = "re-save or re-download the checkpoint"
# Real headers hold a few kilobytes per tensor (a few MB for the largest models); a length above this is
# a corrupt file, and reading it would allocate that much.
MAX_SAFETENSORS_HEADER = 100 * 2**20
INDEX_NAME = "model.safetensors.index.json"
# What AutoTokenizer can build a tokenizer from; a directory with none of them has no tokenizer at all.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "vocab.json",
    "vocab.txt",
    "tokenizer.tiktoken",
)


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded, or cannot serve the requested mode; the message says why and
    what to do."""


def first_line(error: BaseException) -> str:
    """The gist of a library's error (hub clients and JSON parsers write several lines) for a one-line message."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def read_config(path: Path) -> dict:
    """`config.json` of a model directory as a dict, or a `CheckpointError` naming the file."""
    file = path / "config.json"
    if not file.is_file():
        raise CheckpointError(
            f"{path} is not a model directory (no config.json); pass a checkpoint such as runs/x/final"
        )
    return read_json_object(file)


def read_json_object(file: Path, error: type[CheckpointError] = CheckpointError) -> dict:
    """A checkpoint's JSON file that must hold an object, or `error` naming the file and the fix."""
    try:
        data = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{file} is not valid JSON ({first_line(e)}); {RESAVE}") from e
    if not isinstance(data, dict):
        raise error(f"{file} is not a JSON object; {RESAVE}")
    return data


def config_value(config, name: str):
    """A field of a model config (an HF config object, or config.json's dict), looked up in its text model
    too: a vision-language checkpoint keeps `vocab_size` and `max_position_embeddings` under `text_config`."""
    if isinstance(config, dict):
        text = config.get("text_config") or {}
        return config[name] if name in config else text.get(name) if isinstance(text, dict) else None
    value = getattr(config, name, None)
    text = getattr(config, "text_config", None)
    return value if value is not None or text is None else getattr(text, name, None)


def _positive_int_field(config: dict, name: str, file: Path) -> None:
    value = config_value(config, name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise CheckpointError(f"{file}: {name} must be a positive integer, got {value!r}; {RESAVE}")


def safetensors_header(file: Path) -> dict:
    """The header of a safetensors file, after checking that its length fits the file and that every tensor
    lies inside the file (a truncated download keeps its header and loses the tensors' bytes)."""
    size = file.stat().st_size
    if size < 8:
        raise CheckpointError(f"{file} is {'empty' if size == 0 else 'truncated'} ({size} bytes); {RESAVE}")
    with file.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))  # the format: u64 little-endian header length, then JSON
        if length > size - 8 or length > MAX_SAFETENSORS_HEADER:
            raise CheckpointError(
                f"{file} is truncated or corrupt: its header claims {length} bytes and the file has {size}; {RESAVE}"
            )
        raw = f.read(length)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file} is corrupt: its header is not valid JSON ({e}); {RESAVE}") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{file} is corrupt: its header is not a JSON object; {RESAVE}")
    end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            raise CheckpointError(f"{file} is corrupt: tensor {name!r} has no valid data_offsets; {RESAVE}")
        end = max(end, offsets[1])
    if 8 + length + end > size:
        raise CheckpointError(
            f"{file} is truncated: its tensors need {8 + length + end} bytes and the file has {size}; {RESAVE}"
        )
    return header


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a model directory: the shards its index names (each must exist), else
    every `*.safetensors` beside config.json."""
    index = path / INDEX_NAME
    if not index.is_file():
        return sorted(path.glob("*.safetensors"))
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        shards = sorted(set(weight_map.values()))
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{index} is not a valid shard index ({type(e).__name__}: {e}); {RESAVE}") from e
    missing = [s for s in shards if not (path / s).is_file()]
    if missing:
        raise CheckpointError(f"{index} names shards that are missing: {', '.join(missing)}; {RESAVE}")
    return [path / s for s in shards]


# Tensors whose first dimension is the vocabulary (a tied model saves the embedding alone).
VOCAB_TENSORS = ("embed_tokens.weight", "lm_head.weight", "wte.weight", "word_embeddings.weight")


def check_model_dir(path: str | os.PathLike) -> dict:
    """Check a local model directory before transformers reads it: `config.json` parses and its sizes are
    positive integers, each safetensors file is sound, and config's `vocab_size` equals the rows of the
    embedding and output layer the weights hold. Returns config.json as a dict."""
    path = Path(path)
    config = read_config(path)
    for name in ("vocab_size", "max_position_embeddings"):
        _positive_int_field(config, name, path / "config.json")
    vocab = config_value(config, "vocab_size")
    for file in weight_files(path):
        for name, entry in safetensors_header(file).items():
            shape = entry.get("shape") if name != "__metadata__" else None
            if vocab is None or not name.endswith(VOCAB_TENSORS) or not shape:
                continue
            if shape[0] != vocab:
                raise CheckpointError(
                    f"{path / 'config.json'} says vocab_size {vocab}, but {file.name}'s {name} has {shape[0]} "
                    f"rows: the config and the weights come from different saves; {RESAVE}"
                )
    return config


def missing_tokenizer(path: str | os.PathLike) -> str | None:
    """Why a local directory has no tokenizer to load (None: it has one, or it is not a directory). Asked
    after AutoTokenizer failed, whose own message for this case is about converter packages."""
    path = Path(path)
    if not path.is_dir() or any((path / name).is_file() for name in TOKENIZER_FILES) or any(path.glob("*.tiktoken")):
        return None
    return (
        f"{path} has no tokenizer files (none of {', '.join(TOKENIZER_FILES)}); copy them from the model it was "
        "trained from (tokenizer.save_pretrained writes them), or re-download the checkpoint"
    )
