"""Checkpoints: a stock HF directory (+ block_diffusion.json) with the train state inside it.

    <save_dir>/step_<N>/  config.json, model*.safetensors, tokenizer files, block_diffusion.json,
                          train_state/  (torch.distributed.checkpoint: model + optimizer shards,
                                         trainer_state.json, rng_rank<r>.pt)
    <save_dir>/final/     the same, at the end of the run
    <save_dir>/latest     the name of the newest complete checkpoint

Every checkpoint is written to `.tmp-<name>` and renamed into place only when complete, and
`latest` is replaced atomically after that, so a run killed mid-save leaves the previous
checkpoint (and the pointer to it) intact.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from bdcore.sidecar import Sidecar, write_sidecar
from train.parallel import DistInfo

TRAIN_STATE = "train_state"
LATEST = "latest"
TRAINER_STATE = "trainer_state.json"


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def export_hf(model, tokenizer, directory: Path, info: DistInfo, *, sidecar: Sidecar | None, save_dtype) -> None:
    """Gather the full weights (collective) and write a from_pretrained-loadable directory on rank 0.

    `model` is the HF model (inside the FSDP-sharded wrapper)."""
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not info.is_main:
        return
    full = {k: v.to(save_dtype) if v.is_floating_point() else v for k, v in full.items()}
    config = model.config
    config.dtype = save_dtype
    model.save_pretrained(directory, state_dict=full, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    if sidecar is not None:
        write_sidecar(directory, sidecar)


def save_checkpoint(
    run_dir: Path,
    name: str,
    *,
    model,
    optimizer,
    tokenizer,
    info: DistInfo,
    sidecar: Sidecar | None,
    trainer_state: dict,
    save_dtype,
    before_commit=None,
) -> Path:
    """Write `run_dir/name` atomically (collective: every rank calls it). Returns the final path."""
    tmp, final = run_dir / f".tmp-{name}", run_dir / name
    if info.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / TRAIN_STATE).mkdir(parents=True)
    dist.barrier()
    export_hf(model.model, tokenizer, tmp, info, sidecar=sidecar, save_dtype=save_dtype)
    msd, osd = get_state_dict(model, optimizer)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp / TRAIN_STATE))
    rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    torch.save(rng, tmp / TRAIN_STATE / f"rng_rank{info.rank}.pt")
    dist.barrier()
    if before_commit is not None:  # tests: simulate a crash before the rename
        before_commit()
    if info.is_main:
        (tmp / TRAIN_STATE / TRAINER_STATE).write_text(json.dumps({**trainer_state, "world_size": info.world_size}))
        old = run_dir / f".old-{name}"
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
        _write_atomic(run_dir / LATEST, name + "\n")
    dist.barrier()
    return final


def resolve_resume(path: str | os.PathLike) -> Path:
    """A checkpoint directory, or a run directory whose `latest` names one."""
    p = Path(path)
    if (p / TRAIN_STATE / TRAINER_STATE).is_file():
        return p
    if (p / LATEST).is_file():
        target = p / (p / LATEST).read_text().strip()
        if (target / TRAIN_STATE / TRAINER_STATE).is_file():
            return target
    raise SystemExit(
        f"train.py: error: --resume: {path} holds no complete checkpoint (expected {TRAIN_STATE}/{TRAINER_STATE}, "
        f"or a run directory with a '{LATEST}' file)"
    )


def load_train_state(ckpt: Path, model, optimizer, info: DistInfo) -> dict:
    """Restore model shards, optimizer state and this rank's RNG; return the trainer state."""
    msd, osd = get_state_dict(model, optimizer)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=str(ckpt / TRAIN_STATE))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    rng_file = ckpt / TRAIN_STATE / f"rng_rank{info.rank}.pt"
    if rng_file.is_file():
        rng = torch.load(rng_file, weights_only=False)
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    return json.loads((ckpt / TRAIN_STATE / TRAINER_STATE).read_text())
