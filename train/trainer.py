"""The training loop: data -> rows -> FSDP2 block-diffusion SFT -> checkpoints, resumable exactly."""

from __future__ import annotations

import contextlib
import json
import random
import time
from pathlib import Path

import torch
import torch.distributed as dist

from bdcore.sidecar import Sidecar
from train.checkpoint import load_train_state, read_trainer_state, resolve_resume, save_checkpoint
from train.config import BlockDiffusionConfig, FlagError
from train.data import DataError, DataStats, load_samples
from train.loss import diffusion_weights, liger_available
from train.metrics import RunLogger, peak_memory_mib
from train.model import TwoStreamLM, attention_backend, check_supported_model
from train.noise import noise_generator
from train.optim import build_optimizer, build_scheduler, fast_forward
from train.packing import RowStream, bucket_length, pack_first_fit
from train.parallel import (
    DistInfo,
    all_reduce_sum,
    deepcopy_config,
    fsdp_shard,
    init_distributed,
    materialize_sharded,
    non_persistent_buffers,
)
from train.rows import SpecialIds, build_batch, two_stream_length
from train.special_tokens import (
    MASK_TOKEN,
    add_mask_to_tokenizer,
    end_of_turn_id,
    filler_id,
    init_mask_rows,
    vocab_rows_needed,
)

# Fields a resumed run must share with the run that wrote the checkpoint.
RESUME_MUST_MATCH = (
    "bd_size",
    "views",
    "ar_only",
    "within_block_causal",
    "max_length",
    "pack",
    "multiturn",
    "seed",
    "micro_batch_size",
    "grad_accum",
)
# Fields that shape the learning-rate schedule: a resume may change them only with --allow_schedule_change.
SCHEDULE_FLAGS = ("max_steps", "lr", "warmup", "lr_min_ratio")


def _check_runtime_flags(args, info: DistInfo) -> None:
    cuda = info.device.type == "cuda"
    if args.activation_offload and not cuda:
        raise FlagError("--activation_offload", "needs a CUDA device (activations already live in host memory)")
    if args.fused_ce == "on" and not liger_available():
        raise FlagError("--fused_ce on", "needs CUDA and liger-kernel (pip install liger-kernel), or use auto/off")
    if args.dtype == "bf16" and not cuda:
        raise FlagError("--dtype bf16", "CPU training runs in fp32; use --dtype auto or fp32 on CPU")


def _check_resume(args) -> tuple[Path, dict, dict]:
    """Before any loading: the checkpoint --resume means, its trainer state, and the schedule flags
    that change ({flag: [old, new]}, allowed only with --allow_schedule_change)."""
    ckpt = resolve_resume(args.resume)
    state = read_trainer_state(ckpt)
    saved = state.get("config", {})

    def changed(keys):
        return {k: [saved[k], getattr(args, k)] for k in keys if k in saved and saved[k] != getattr(args, k)}

    def listed(diff):
        return ", ".join(f"--{k} {old} -> {new}" for k, (old, new) in diff.items())

    fixed, schedule = changed(RESUME_MUST_MATCH), changed(SCHEDULE_FLAGS)
    if fixed:
        raise FlagError("--resume", f"{ckpt} was written with other flags ({listed(fixed)}); resume with its values")
    if schedule and not args.allow_schedule_change:
        raise FlagError(
            "--resume",
            f"{ckpt} was written with another lr schedule ({listed(schedule)}); resume with its values, or add "
            f"--allow_schedule_change to follow the new schedule from step {state['step']}",
        )
    return ckpt, state, schedule


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, default=str) + "\n")


def _load_tokenizer(args):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(args.model_id, trust_remote_code=args.trust_remote_code)
    except (OSError, ValueError) as e:  # the hub client's errors: not found, offline, gated, no tokenizer
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise FlagError(
            "--model_id",
            f"cannot load {args.model_id} ({reason}); check the hub id and the network (HF_HUB_OFFLINE), "
            "or pass a local directory written by save_pretrained",
        ) from e


def _tokenizer_and_ids(args):
    tok = _load_tokenizer(args)
    eot = end_of_turn_id(tok)
    try:
        fill = filler_id(tok, eot)
    except ValueError:
        if not args.ar_only:
            raise
        fill = eot  # AR-only rows have no noised blocks; the filler only pads
    if args.ar_only:
        return tok, eot, SpecialIds(mask_id=-1, filler_id=fill), None
    mask_id, num_real = add_mask_to_tokenizer(tok)
    return tok, eot, SpecialIds(mask_id=mask_id, filler_id=fill), num_real


def _build_model(args, info: DistInfo, ids: SpecialIds, num_real, param_dtype, cfg: BlockDiffusionConfig):
    """Rank 0 reads the weights on CPU; every rank builds a meta model, shards it and receives its shards."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(args.model_id, trust_remote_code=args.trust_remote_code)
    if getattr(config, "text_config", None) is not None and getattr(config, "vocab_size", None) is None:
        # A vision-language checkpoint (e.g. Qwen3_5ForConditionalGeneration): train its text model alone.
        config = config.get_text_config()
    attn = attention_backend(config, cuda=info.device.type == "cuda")
    save_dtype = getattr(config, "dtype", None) or torch.float32
    if isinstance(save_dtype, str):
        save_dtype = getattr(torch, save_dtype)
    full_sd = buffers = None
    if info.is_main:
        cpu_model = AutoModelForCausalLM.from_pretrained(
            args.model_id, dtype=torch.float32, attn_implementation=attn, trust_remote_code=args.trust_remote_code
        )
        check_supported_model(cpu_model)
        if num_real is not None:
            init_mask_rows(cpu_model, ids.mask_id, num_real)
        full_sd, buffers = cpu_model.state_dict(), non_persistent_buffers(cpu_model)
        del cpu_model
    if not args.ar_only:
        config.vocab_size = vocab_rows_needed(config, ids.mask_id)

    def build_meta():
        model = AutoModelForCausalLM.from_config(
            deepcopy_config(config),
            attn_implementation=attn,
            dtype=torch.float32,
            trust_remote_code=args.trust_remote_code,
        )
        if args.activation_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        fused = liger_available() if args.fused_ce == "auto" else args.fused_ce == "on"
        return TwoStreamLM(model, cfg, fused_ce=fused)

    def shard(lm):
        layers = lm.model.get_decoder().layers
        if args.compile:
            for layer in layers:
                layer.compile()
        fsdp_shard(lm, layers, param_dtype)

    lm = materialize_sharded(build_meta, full_sd, buffers, info, shard, weights_of=lambda root: root.model)
    lm.train()
    return lm, save_dtype


def _build_rows(args, info: DistInfo, tok, eot: int, run_dir: Path):
    """Rows of samples; data_stats.json is written even when the data cannot start a run."""
    try:
        samples, stats = load_samples(
            args.dataset,
            tok,
            eot,
            multiturn=args.multiturn,
            max_length=args.max_length,
            max_response_length=args.max_response_length,
            bd_size=args.bd_size,
            views=args.views,
            progress=info.is_main,
        )
    except DataError as e:
        if info.is_main:
            _write_json(run_dir / "data_stats.json", {**(e.stats or DataStats()).to_dict(), "rows": 0})
        raise
    order = list(range(len(samples)))
    random.Random(args.seed).shuffle(order)
    lengths = [two_stream_length(samples[i], args.bd_size, args.views) for i in order]
    if args.pack:
        groups = pack_first_fit(lengths, args.max_length)
    else:
        groups = [[j] for j in range(len(order))]
    rows = [[samples[order[j]] for j in g] for g in groups]
    row_lengths = [sum(lengths[j] for j in g) for g in groups]
    if info.is_main:
        _write_json(run_dir / "data_stats.json", {**stats.to_dict(), "rows": len(rows)})
    return rows, row_lengths, stats


def run(args) -> dict:
    """Train; returns a summary (final losses, steps, wall time). Every rank calls it."""
    t_start = time.time()
    info = init_distributed()
    _check_runtime_flags(args, info)
    run_dir = Path(args.save_dir)
    ckpt, resumed, schedule_changes = _check_resume(args) if args.resume else (None, None, {})
    if info.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        _write_json(run_dir / "run_config.json", {**vars(args), "schedule_changes": schedule_changes})
    cuda = info.device.type == "cuda"
    param_dtype = torch.bfloat16 if (args.dtype == "bf16" or (args.dtype == "auto" and cuda)) else None

    tok, eot, ids, num_real = _tokenizer_and_ids(args)
    cfg = BlockDiffusionConfig(
        bd_size=args.bd_size,
        views=args.views,
        ar_loss_weight=args.ar_loss_weight,
        within_block_causal=args.within_block_causal,
        loss_weighting=args.loss_weighting,
    )
    rows, row_lengths, stats = _build_rows(args, info, tok, eot, run_dir)

    lm, save_dtype = _build_model(args, info, ids, num_real, param_dtype, cfg)
    opt = build_optimizer(lm, lr=args.lr, weight_decay=args.weight_decay)
    sched = build_scheduler(opt, warmup=args.warmup, max_steps=args.max_steps, min_ratio=args.lr_min_ratio)
    stream = RowStream(
        len(rows), seed=args.seed, world_size=info.world_size, rank=info.rank, micro_batch_size=args.micro_batch_size
    )
    start_step = 0
    if ckpt is not None:
        load_train_state(ckpt, lm, opt, info)
        start_step, stream.position = resumed["step"], resumed["data_position"]
        fast_forward(sched, start_step)

    logger = RunLogger(
        run_dir,
        enabled=info.is_main,
        max_steps=args.max_steps,
        start_step=start_step,
        wandb_project=args.wandb,
        tensorboard=args.tensorboard,
        config=vars(args),
    )
    if info.is_main:
        logger.write(
            f"{len(rows)} rows from {stats.kept}/{stats.records} records "
            f"(skipped: {dict(stats.skipped) or 'none'}); world size {info.world_size}, device {info.device}"
        )
        if schedule_changes:
            logger.write(
                f"warning: --resume {ckpt}: the lr schedule changes from step {start_step}: {schedule_changes}"
            )
    sidecar_base = (
        None
        if args.ar_only
        else dict(
            bd_size=cfg.bd_size,
            mask_id=ids.mask_id,
            mask_token=MASK_TOKEN,
            ar_loss_weight=cfg.ar_loss_weight,
            clean_causal=cfg.clean_causal,
            within_block_causal=cfg.within_block_causal,
            views=cfg.views,
            base_model=args.model_id,
        )
    )

    def save(name: str, steps_done: int):
        sidecar = None if sidecar_base is None else Sidecar(**sidecar_base, global_step=steps_done)
        state = {
            "step": steps_done,
            "data_position": stream.position,
            "config": {k: getattr(args, k) for k in RESUME_MUST_MATCH + SCHEDULE_FLAGS},
        }
        path = save_checkpoint(
            run_dir,
            name,
            model=lm,
            optimizer=opt,
            tokenizer=tok,
            info=info,
            sidecar=sidecar,
            trainer_state=state,
            save_dtype=save_dtype,
        )
        logger.write(f"saved {path}")

    history = []
    offload = torch.autograd.graph.save_on_cpu(pin_memory=True) if args.activation_offload else contextlib.nullcontext()
    for step in range(start_step, args.max_steps):
        t0 = time.perf_counter()
        batches = []
        for micro in range(args.grad_accum):
            ids_now = stream.next_micro_batch()
            length = bucket_length(max(row_lengths[i] for i in ids_now), args.length_buckets)
            gen = noise_generator(args.seed, info.rank, step, micro)
            batches.append(build_batch([rows[i] for i in ids_now], cfg, ids, gen, row_length=length))
        local = [
            sum(float(diffusion_weights(b.diff_rate, cfg).sum()) for b in batches),
            sum(b.ar_index.numel() for b in batches),
            sum(b.diff_index.numel() for b in batches),
            sum(b.num_real_tokens for b in batches),
        ]
        d_norm, a_norm, n_diff, n_tokens = all_reduce_sum(local, info.device)
        W = info.world_size
        sums = torch.zeros(3, dtype=torch.float64, device=info.device)
        for micro, batch in enumerate(batches):
            lm.set_requires_gradient_sync(micro == len(batches) - 1)
            with offload:
                parts = lm(batch.to(info.device), diff_norm=d_norm / W, ar_norm=a_norm / W)
                parts.loss.backward()
            sums += torch.stack([parts.loss.detach(), parts.diff, parts.ar]).double()
        norm = torch.nn.utils.clip_grad_norm_(lm.parameters(), args.grad_clip if args.grad_clip > 0 else float("inf"))
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        lr = opt.param_groups[0]["lr"]
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        dist.all_reduce(sums)
        loss, diff_l, ar_l = (sums / W).tolist()
        dt = time.perf_counter() - t0
        history.append(loss)
        done = step + 1
        record = None
        if done % args.log_every == 0 or done == args.max_steps:
            record = {
                "step": done,
                "loss": loss,
                "diff": diff_l,
                "ar": ar_l,
                "lr": lr,
                "grad_norm": float(norm),
                "tokens_per_s": n_tokens / dt,
                "supervised_tokens_per_s": (n_diff + a_norm) / dt,
                "diff_tokens": int(n_diff),
                "ar_tokens": int(a_norm),
                "epoch": stream.epoch,
                "peak_mem_mib": peak_memory_mib(info.device),
                "step_time_s": dt,
            }
        logger.step(record)
        if args.save_every and done % args.save_every == 0 and done != args.max_steps:
            save(f"step_{done}", done)
    save("final", args.max_steps)
    logger.close()
    summary = {
        "steps": args.max_steps,
        "final_loss": history[-1] if history else None,
        "losses": history,
        "wall_s": time.time() - t_start,
        "checkpoint": str(run_dir / "final"),
    }
    if info.is_main:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
