"""Load a bdstack checkpoint (docs/design.md section 5) to decode it: the server, the benchmarks and
self-distillation all load through here, which validates the sidecar against the tokenizer."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from bdcore.capabilities import Capabilities
from bdcore.checkpoint_files import (
    RESAVE,
    CheckpointError,
    check_model_dir,
    config_value,
    first_line,
    missing_tokenizer,
    weight_files,
)
from bdcore.decode.config import DecodeConfig
from bdcore.decode.packed_linear import pack_linears
from bdcore.decode.policy.acceptance import read_draft_prior
from bdcore.draft_adapter import load_draft_adapter
from bdcore.draft_adapter_files import check_draft_adapter
from bdcore.draft_adapter_serving import DRAFT_ENERGY, prepare_serving, truncate_adapter
from bdcore.serving_gate import resolve
from bdcore.sidecar import SIDECAR_NAME, Sidecar, read_sidecar
from bdcore.tokens import MASK_TOKEN, stop_ids, token_id
from bdcore.vector_math import settle_vector_math

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: PreTrainedTokenizerBase
    sidecar: Sidecar | None  # None: a plain AR checkpoint (causal mode only)
    mask_id: int | None
    stop_ids: frozenset[int]  # end-of-turn, eos, and the block filler
    name: str
    path: Path | None = None  # where it was loaded from (the forward-cost measurement is cached per checkpoint)
    draft_prior: list[float] | None = None  # self-spec acceptance per draft, from the checkpoint's draft_quality.json
    capabilities: Capabilities = field(default_factory=lambda: Capabilities.from_sidecar(None))  # what it can run


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}  # the dtype names the loader takes


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def cpu_has_bf16() -> bool:
    """Native bf16 matrix units (AVX512-BF16 / AMX), as oneDNN reports them."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def serving_dtype(name: str, device: str | torch.device) -> str:
    """The server's `--dtype auto`: bf16 on CUDA and on a CPU with native bf16, else fp32. Measured on
    SmolLM2-135M (AVX512-BF16, 2 cores; docs/history/results-notebook.md): a bf16 forward takes 0.33-0.66x
    the fp32 time at every row count, and 64 rows cost 2.25x one row instead of 3.85x, so drafting is cheaper too. The
    library's `load_checkpoint(dtype="auto")` keeps fp32 on CPU (tests and references compare exactly)."""
    if name != "auto":
        return name
    device = torch.device(device)
    return "bf16" if device.type == "cuda" or (device.type == "cpu" and cpu_has_bf16()) else "fp32"


def load_tokenizer(path: Path, **kwargs) -> PreTrainedTokenizerBase:
    """AutoTokenizer on a checkpoint directory, its failure one line that names the directory."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, **kwargs)
    except Exception as e:  # the tokenizers library raises a bare Exception on a corrupt tokenizer.json
        why = missing_tokenizer(path)  # transformers' own message for this case is about converter packages
        raise CheckpointError(why or f"cannot load the tokenizer in {path} ({first_line(e)}); {RESAVE}") from e


def load_weights(model_id: str | os.PathLike, **kwargs):
    """AutoModelForCausalLM.from_pretrained, its failure one line that names the file (the loaders of the
    engine, the trainer and the OPD teacher share it; `check_model_dir` has already read the headers)."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    settle_vector_math()  # before the first forward of any process that loads a model (bdcore/vector_math.py)
    try:
        return AutoModelForCausalLM.from_pretrained(model_id, **kwargs)
    except SafetensorError as e:  # its message names no file: find the one its reader refuses
        where = _unreadable_weights(Path(model_id)) or model_id
        raise CheckpointError(f"cannot load the weights in {where} ({first_line(e)}); {RESAVE}") from e
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot load the weights in {model_id} ({first_line(e)}); {RESAVE}") from e


def _unreadable_weights(path: Path) -> Path | None:
    from safetensors import SafetensorError, safe_open

    for file in weight_files(path) if path.is_dir() else []:
        try:
            with safe_open(str(file), framework="pt"):  # reads the header only
                pass
        except SafetensorError:
            return file
    return None


def check_checkpoint(path: str | os.PathLike) -> tuple[dict, PreTrainedTokenizerBase, Sidecar | None]:
    """Everything a loader checks before the weights, in one place: the files (`check_model_dir`: a bad
    one is named before transformers reads it), the tokenizer, the sidecar against both, and the draft adapter
    it names (`check_draft_adapter`: its config, files and finite weights). Returns config.json, the tokenizer
    and the sidecar (None: a plain AR checkpoint). The native engine loads the weights next; the SGLang and
    vLLM command builders stop here (their engines read the weights)."""
    path = Path(path)
    config = check_model_dir(path)
    tok = load_tokenizer(path)
    sidecar = read_sidecar(path) if (path / SIDECAR_NAME).is_file() else None
    if sidecar is not None:
        sidecar.check_tokenizer(tok)
        sidecar.check_model(config)
    if sidecar is not None and sidecar.draft_adapter is not None:
        adapter = path / sidecar.draft_adapter
        if not (adapter / "adapter_config.json").is_file():
            raise CheckpointError(
                f"{path / SIDECAR_NAME} names the draft adapter {sidecar.draft_adapter!r}, but {adapter} holds no "
                "adapter_config.json; copy the whole checkpoint directory"
            )
        check_draft_adapter(adapter, config_value(config, "hidden_size"))
    return config, tok, sidecar


def load_checkpoint(
    path: str | os.PathLike,
    *,
    device: str = "cpu",
    dtype: str = "auto",
    draft_energy: float = DRAFT_ENERGY,
    packed: bool = True,
) -> LoadedModel:
    """`draft_energy`: the share of a draft adapter's LoRA energy kept when served (`truncate_adapter`).
    `packed`: a bf16 model on the CPU runs its linears on weights packed once for oneDNN (`pack_linears`:
    the same outputs, a decode forward 1.13-1.27x faster); False leaves them plain (a side-by-side measurement)."""
    path = Path(path)
    config, tok, sidecar = check_checkpoint(path)
    # Every checkpoint the engine decodes at all decodes causally: asking the gate for causal mode refuses,
    # before the weights load, the ones it decodes in no mode (an unshifted sidecar no training run writes).
    resolve(Capabilities.from_sidecar(sidecar, config), DecodeConfig(mode="causal"), "native")
    dev = torch.device(device)
    model = load_weights(path, dtype=resolve_dtype(dtype, dev), attn_implementation="sdpa")
    if sidecar is not None and sidecar.draft_adapter is not None:
        try:  # its files were checked with the checkpoint's (`check_checkpoint`)
            load_draft_adapter(model, path / sidecar.draft_adapter, sidecar.mask_id)
        except ValueError as e:
            raise CheckpointError(str(e)) from e
    model = model.to(dev).eval()
    if packed:
        pack_linears(model)
    if sidecar is not None and sidecar.draft_adapter is not None:
        # drafts only: the served tokens stay the base model's whatever the cut (docs/design.md 8.13)
        truncate_adapter(model, draft_energy)
        prepare_serving(model)  # after the move: its factors are plain tensors, not the module's
    name = path.name if path.name != "final" else path.parent.name
    try:
        prior = read_draft_prior(path)
    except ValueError as e:
        raise CheckpointError(str(e)) from e
    mask_id, stops = token_id(tok, MASK_TOKEN), stop_ids(tok)
    caps = Capabilities.from_sidecar(sidecar, model.config, mask_id=mask_id, stop_ids=stops)
    return LoadedModel(model, tok, sidecar, mask_id, stops, name, path, prior, caps)
