"""What a run is built from, given its JobConfig: the tokenizer and its special ids, the training rows,
and the FSDP2-sharded two-stream model."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from bdcore.checkpoint_files import first_line, missing_tokenizer
from bdcore.draft_adapter import LoraSpec, add_lora, load_adapter_weights, recompute_context, saved_spec
from bdcore.gated_delta import is_hybrid
from bdcore.loading import CheckpointError, cpu_has_bf16, load_weights
from bdcore.vector_math import settle_vector_math
from train.config import FlagError, JobConfig
from train.data import DataError, DataStats, load_samples
from train.loss import liger_available
from train.model import TwoStreamLM, attention_backend, check_supported_model, is_moe
from train.packing import pack_first_fit
from train.parallel import DistInfo, deepcopy_config, fsdp_shard, materialize_sharded, non_persistent_buffers
from train.rows import Sample, SpecialIds
from train.single_stream import sample_length
from train.special_tokens import (
    add_mask_to_tokenizer,
    end_of_turn_id,
    filler_id,
    init_mask_rows,
    vocab_rows_needed,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def check_runtime(config: JobConfig, info: DistInfo) -> None:
    """Flags that only the device can rule out, checked before anything is loaded."""
    cuda = info.device.type == "cuda"
    if config.efficiency.activation_offload and not cuda:
        raise FlagError("--activation_offload", "needs a CUDA device (activations already live in host memory)")
    if config.efficiency.fused_ce == "on" and not liger_available():
        raise FlagError("--fused_ce on", "needs CUDA and liger-kernel (pip install liger-kernel), or use auto/off")
    if config.model.dtype == "bf16" and not cuda and not cpu_has_bf16():
        raise FlagError(
            "--dtype bf16", "this CPU has no native bf16 (AVX512-BF16 or AMX), where bf16 is slower; use fp32"
        )


def compute_dtype(config: JobConfig, info: DistInfo) -> torch.dtype | None:
    """FSDP's parameter dtype for compute; None keeps the fp32 master weights."""
    dtype = config.model.dtype
    return torch.bfloat16 if (dtype == "bf16" or (dtype == "auto" and info.device.type == "cuda")) else None


def write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, default=str) + "\n")


@dataclass
class TokenizerParts:
    tokenizer: PreTrainedTokenizerBase
    end_of_turn: int
    special: SpecialIds
    num_real: int | None  # ids before the <|mask|> this run added; None when it added none


def _load_tokenizer(config: JobConfig):
    from transformers import AutoTokenizer

    model_id = config.model.model_id
    try:
        return AutoTokenizer.from_pretrained(model_id, trust_remote_code=config.model.trust_remote_code)
    except (OSError, ValueError) as e:  # the hub client's errors: not found, offline, gated, no tokenizer
        if (missing := missing_tokenizer(model_id)) is not None:  # transformers' message: converter packages
            raise FlagError("--model_id", missing) from e
        reason = first_line(e)
        raise FlagError(
            "--model_id",
            f"cannot load {model_id} ({reason}); check the hub id and the network (HF_HUB_OFFLINE), "
            "or pass a local directory written by save_pretrained",
        ) from e


def build_tokenizer(config: JobConfig) -> TokenizerParts:
    """The tokenizer with <|mask|> added (none for --ar_only), and the ids rows are built with."""
    tok = _load_tokenizer(config)
    eot = end_of_turn_id(tok)
    ar_only = config.diffusion.ar_only
    try:
        fill = filler_id(tok, eot)
    except ValueError:
        if not ar_only:
            raise
        fill = eot  # AR-only rows have no noised blocks; the filler only pads
    if ar_only:
        return TokenizerParts(tok, eot, SpecialIds(mask_id=-1, filler_id=fill), None)
    mask_id, num_real = add_mask_to_tokenizer(tok)
    noise_vocab = 0
    if config.diffusion.canvas_fill == "noise":  # UNO draws from the served embedding's rows: the converted model's
        from transformers import AutoConfig

        model_config = AutoConfig.from_pretrained(
            config.model.model_id, trust_remote_code=config.model.trust_remote_code
        )
        noise_vocab = vocab_rows_needed(model_config.get_text_config(), mask_id)
    return TokenizerParts(tok, eot, SpecialIds(mask_id=mask_id, filler_id=fill, noise_vocab=noise_vocab), num_real)


@dataclass
class Rows:
    rows: list[list[Sample]]  # the samples of each training row, in the run's seeded order
    lengths: list[int]  # each row's two-stream length
    stats: DataStats


def build_rows(config: JobConfig, info: DistInfo, tokens: TokenizerParts, run_dir: Path) -> Rows:
    """Rows of samples; data_stats.json is written even when the data cannot start a run."""
    data, d = config.data, config.diffusion
    try:
        samples, stats = load_samples(
            data.dataset,
            tokens.tokenizer,
            tokens.end_of_turn,
            multiturn=data.multiturn,
            max_length=data.max_length,
            max_response_length=data.max_response_length,
            bd_size=d.bd_size,
            views=d.views,
            single_stream=d.single_stream,
            progress=info.is_main,
        )
    except DataError as e:
        if info.is_main:
            write_json(run_dir / "data_stats.json", {**(e.stats or DataStats()).to_dict(), "rows": 0})
        raise
    order = list(range(len(samples)))
    random.Random(config.training.seed).shuffle(order)
    lengths = [sample_length(samples[i], d) for i in order]
    if data.pack:
        groups = pack_first_fit(lengths, data.max_length)
    else:
        groups = [[j] for j in range(len(order))]
    rows = [[samples[order[j]] for j in g] for g in groups]
    row_lengths = [sum(lengths[j] for j in g) for g in groups]
    if info.is_main:
        write_json(run_dir / "data_stats.json", {**stats.to_dict(), "rows": len(rows)})
    return Rows(rows, row_lengths, stats)


def continue_draft_adapter(model, model_id: str, lora: LoraSpec) -> None:
    """A draft-adapter run from a bdstack checkpoint that has a draft adapter continues that adapter (an
    on-policy stage after SFT): its weights and `<|mask|>` row replace the fresh ones `add_lora` gave `model`."""
    from bdcore.sidecar import SIDECAR_NAME, read_sidecar

    path = Path(model_id)
    if not (path / SIDECAR_NAME).is_file():
        return
    name = read_sidecar(path).draft_adapter
    if name is None:
        return
    saved = saved_spec(path / name)
    if (saved.rank, saved.alpha) != (lora.rank, lora.alpha):  # the modules it targets: load_adapter_weights
        raise FlagError(
            "--lora_rank",
            f"{model_id}'s draft adapter (rank {saved.rank}, alpha {saved.alpha:g}) is continued by this run, "
            f"which asks for rank {lora.rank}, alpha {lora.alpha:g}: pass --lora_rank {saved.rank} "
            f"--lora_alpha {saved.alpha:g}",
        )
    try:
        load_adapter_weights(model, path / name)
    except ValueError as e:
        raise FlagError("--model_id", str(e)) from e
    print(f"continuing the draft adapter of {model_id} (rank {saved.rank})", flush=True)


def build_model(config: JobConfig, info: DistInfo, tokens: TokenizerParts) -> tuple[TwoStreamLM, torch.dtype]:
    """The sharded two-stream model and the dtype its checkpoints are saved in.

    Rank 0 reads the weights on CPU; every rank builds a meta model, shards it and receives its shards."""
    from transformers import AutoConfig, AutoModelForCausalLM

    settle_vector_math()  # before the first forward, also of a model built from a config (bdcore/vector_math.py)
    model_id, remote = config.model.model_id, config.model.trust_remote_code
    efficiency = config.efficiency
    hf_config = AutoConfig.from_pretrained(model_id, trust_remote_code=remote)
    if getattr(hf_config, "text_config", None) is not None and getattr(hf_config, "vocab_size", None) is None:
        # A vision-language checkpoint (e.g. Qwen3_5ForConditionalGeneration): train its text model alone.
        hf_config = hf_config.get_text_config()
    if config.diffusion.single_stream and is_hybrid(hf_config):
        raise FlagError(
            "--objective",
            f"single_stream needs every layer to see its whole block both ways; {model_id} has gated-delta "
            "(recurrent) layers, which have no such form yet: use --objective two_stream",
        )
    attn = attention_backend(hf_config, cuda=info.device.type == "cuda")
    router_aux = config.model.router_aux_loss_coef
    if router_aux is None:
        router_aux = float(getattr(hf_config, "router_aux_loss_coef", 0.0) or 0.0) if is_moe(hf_config) else 0.0
    elif router_aux > 0 and not is_moe(hf_config):
        raise FlagError("--router_aux_loss_coef", f"{model_id} is not a mixture-of-experts model; leave it out")
    save_dtype = getattr(hf_config, "dtype", None) or torch.float32
    if isinstance(save_dtype, str):
        save_dtype = getattr(torch, save_dtype)
    mask_id = tokens.special.mask_id
    lora = config.lora.spec()
    full_sd = buffers = None
    if info.is_main:
        try:
            cpu_model = load_weights(model_id, dtype=torch.float32, attn_implementation=attn, trust_remote_code=remote)
        except CheckpointError as e:
            raise FlagError("--model_id", str(e)) from e
        check_supported_model(cpu_model)
        if tokens.num_real is not None:
            init_mask_rows(cpu_model, mask_id, tokens.num_real)
        if lora is not None:  # rank 0's adapter initialisation is every rank's (broadcast with the weights)
            torch.manual_seed(config.training.seed)
            add_lora(cpu_model, lora, mask_id)
            if lora.draft_only:
                continue_draft_adapter(cpu_model, model_id, lora)
        full_sd, buffers = cpu_model.state_dict(), non_persistent_buffers(cpu_model)
        del cpu_model
    if not config.diffusion.ar_only:
        hf_config.vocab_size = vocab_rows_needed(hf_config, mask_id)

    def build_meta():
        model = AutoModelForCausalLM.from_config(
            deepcopy_config(hf_config), attn_implementation=attn, dtype=torch.float32, trust_remote_code=remote
        )
        if lora is not None:
            add_lora(model, lora, mask_id)
        if efficiency.activation_checkpointing:
            # a draft adapter's recomputed layers need the gate their forward ran with (recompute_context)
            kwargs = {"use_reentrant": False, "context_fn": recompute_context(model)}
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        fused = liger_available() if efficiency.fused_ce == "auto" else efficiency.fused_ce == "on"
        frozen = config.lora.draft_adapter and config.lora.draft_step == "cached"
        return TwoStreamLM(
            model,
            config.diffusion,
            fused_ce=fused,
            router_aux_coef=router_aux,
            frozen_clean=frozen,
            mask_id=None if mask_id < 0 else mask_id,
        )

    def shard(lm):
        layers = lm.model.get_decoder().layers
        if efficiency.compile:
            for layer in layers:
                layer.compile()
        fsdp_shard(lm, layers, compute_dtype(config, info))

    lm = materialize_sharded(build_meta, full_sd, buffers, info, shard, weights_of=lambda root: root.model)
    lm.train()
    return lm, save_dtype
