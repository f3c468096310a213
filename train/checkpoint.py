"""Checkpoints: a stock HF directory (+ block_diffusion.json) with the train state inside it.

    <save_dir>/step_<N>/  config.json, model*.safetensors, tokenizer files, block_diffusion.json,
                          train_state/  (torch.distributed.checkpoint: model + optimizer shards,
                                         trainer_state.json, rng_rank<r>.pt)
    <save_dir>/final/     the same, at the end of the run
    <save_dir>/latest     the name of the newest complete checkpoint
    <save_dir>/run_id     the run's id, which each checkpoint's trainer_state.json records (train/trainer_state.py)

A checkpoint is complete when its train_state/trainer_state.json exists: that file is written
last, after everything else in the directory is fsynced. Saving `<name>`:

    1. write `.tmp-<name>/`, fsync it, then write its trainer_state.json (the completion mark)
    2. if `<name>/` exists, rename it to `.old-<name>/`
    3. rename `.tmp-<name>/` to `<name>/`
    4. remove `.old-<name>/` (its completion mark first), then replace `latest` atomically

Once a run has saved once, a kill at any instant (mid-save included) leaves a complete copy that
`resolve_resume` finds: the one `latest` names, else that name's `.tmp-` copy (newer) or `.old-` copy
(between steps 2 and 3), else the newest complete checkpoint in the run directory (a kill before the
first `latest` was written). A run killed before its first save has none. The next save of a name
whose directory went missing first renames its complete copy back into place. A complete copy damaged
after the fact (shards shorter than its dcp metadata says, a trainer_state.json cut, not JSON or with fields
of the wrong type, or gone from the checkpoint `latest` names) is passed over for the next; one that belongs
to another run is refused.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
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

from bdcore.checkpoint_files import first_line
from bdcore.draft_adapter import ADAPTER_DIR, base_state_dict, has_lora, merged_state_dict, save_adapter
from bdcore.sidecar import Sidecar, write_sidecar
from bdcore.tokens import MASK_TOKEN
from train.config import RESUME_MUST_MATCH, SCHEDULE_FLAGS, FlagError, JobConfig
from train.parallel import DistInfo
from train.recipes import recipe_of_record
from train.trainer_state import (
    RUN_ID,
    TRAIN_STATE,
    TRAINER_STATE,
    check_belongs,
    continued_run_id,
    read_trainer_state,
    recorded_step,
    trainer_state_damage,
)

LATEST = "latest"


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for directory, _, files in os.walk(root):
        for f in files:
            _fsync(Path(directory) / f)
        _fsync(Path(directory))


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync(path.parent)


def _marker(ckpt: Path) -> Path:
    return ckpt / TRAIN_STATE / TRAINER_STATE


def is_complete(ckpt: Path) -> bool:
    return _marker(ckpt).is_file()


def _remove(ckpt: Path) -> None:
    """Delete a checkpoint directory; its completion mark goes first, so no half-deleted copy looks complete."""
    _marker(ckpt).unlink(missing_ok=True)
    shutil.rmtree(ckpt, ignore_errors=True)


def _copies(run_dir: Path, name: str) -> tuple[Path, Path, Path]:
    """Where checkpoint `name` can be: in place, being written (newer), set aside mid-swap (older)."""
    return run_dir / name, run_dir / f".tmp-{name}", run_dir / f".old-{name}"


def _heal(run_dir: Path, name: str) -> None:
    """A kill between the two renames of a save left `name` missing: rename its complete copy back."""
    final, *spares = _copies(run_dir, name)
    if final.exists():
        return
    for spare in spares:
        if is_complete(spare):
            os.rename(spare, final)
            _fsync(run_dir)
            return


def _commit(run_dir: Path, name: str, trainer_state: dict) -> None:
    """Rank 0: mark `.tmp-<name>` complete and swap it in (steps 1-4 of the module docstring)."""
    final, tmp, old = _copies(run_dir, name)
    _fsync_tree(tmp)
    _write_atomic(_marker(tmp), json.dumps(trainer_state))
    if final.exists():
        _remove(old)
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync(run_dir)
    _remove(old)
    _write_atomic(run_dir / LATEST, name + "\n")


def export_hf(model, tokenizer, directory: Path, info: DistInfo, *, sidecar: Sidecar | None, save_dtype) -> None:
    """Gather the full weights (collective) and write a from_pretrained-loadable directory on rank 0.

    `model` is the HF model (inside the FSDP-sharded wrapper)."""
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not info.is_main:
        return
    full = {k: v.to(save_dtype) if v.is_floating_point() else v for k, v in full.items()}
    config = model.config
    config.dtype = save_dtype
    weights = full
    if has_lora(model):  # a draft adapter: the base as it was plus the adapter; plain LoRA: merged weights
        draft = sidecar is not None and sidecar.draft_adapter is not None
        weights = base_state_dict(full) if draft else merged_state_dict(model, full)
        if draft:
            save_adapter(model, full, directory / sidecar.draft_adapter)
    model.save_pretrained(directory, state_dict=weights, safe_serialization=True)
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
    """Write `run_dir/name` atomically (collective: every rank calls it). Returns the final path.
    Weights that hold NaN or inf are never written (FlagError on every rank, nothing on disk changes)."""
    check_finite_weights(model, info, name)
    final, tmp, _ = _copies(run_dir, name)
    if info.is_main:
        _heal(run_dir, name)
        _remove(tmp)
        (tmp / TRAIN_STATE).mkdir(parents=True)
    dist.barrier()
    export_hf(model.model, tokenizer, tmp, info, sidecar=sidecar, save_dtype=save_dtype)
    msd, osd = get_state_dict(model, optimizer)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp / TRAIN_STATE), no_dist=_alone(info))
    rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    torch.save(rng, tmp / TRAIN_STATE / f"rng_rank{info.rank}.pt")
    dist.barrier()
    if before_commit is not None:  # tests: simulate a crash before the rename
        before_commit()
    if info.is_main:
        _commit(run_dir, name, {**trainer_state, "world_size": info.world_size})
    dist.barrier()
    return final


def _alone(info: DistInfo) -> bool:
    """One rank: save and load without dcp's collectives. On CPU they leave a gloo work thread behind
    (`pt_gloo_runloop`) after which libgomp's threads stop spinning at barriers and sleep instead:
    every later training step of a 2-core run was 1.3-1.6x slower (thousands of context switches a second,
    element-wise ops 3-5x slower). Several ranks need the collectives (and run one OpenMP thread each
    on CPU under torchrun)."""
    return info.world_size == 1


def check_finite_weights(model, info: DistInfo, name: str) -> None:
    """Collective: every rank checks its shards, and all ranks raise together, so none waits in a save."""
    bad = [n for n, p in model.named_parameters() if not bool(torch.isfinite(_local(p.detach())).all())]
    count = torch.tensor([len(bad)], dtype=torch.float64, device=info.device)
    dist.all_reduce(count)
    if count.item() > 0:
        example = f" (e.g. {bad[0]})" if bad else ""
        raise FlagError(
            f"saving {name}",
            f"{int(count.item())} parameter shards hold NaN or inf{example}; nothing was written and the previous "
            "checkpoint stays the latest; lower --lr or --grad_clip, or check the data and --rl_reward",
        )


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def resolve_resume(path: str | os.PathLike, warn: Callable[[str], None] | None = None) -> Path:
    """The complete checkpoint `--resume path` means: `path` itself, or in a run directory the one
    `latest` names; failing those, the complete copy a killed save left (see the module docstring).
    In a run directory a damaged checkpoint (a shard shorter than its metadata says, an unusable trainer state) is
    passed over for the next newest complete one, and `warn` is told; named by itself, it is refused. So is one
    that belongs to another run than its run directory (train/trainer_state.py)."""
    warn = warn or (lambda message: print(f"warning: {message}", file=sys.stderr))
    p = Path(path)
    if is_complete(p) or _lost_its_mark(p):
        damage = _damage(p)
        if damage is None:
            check_belongs(p, read_trainer_state(p))
            return p
        intact = next((c for c in _complete_newest_first(p.parent) if c != p and _damage(c) is None), None)
        fix = f"resume from {intact}, the newest intact checkpoint of its run" if intact else "start the run again"
        raise FlagError("--resume", f"{p} is damaged ({damage}); {fix}")
    candidates = list(_copies(p.parent, p.name)[1:])
    name = _latest_name(p)
    if name is not None:
        candidates = [*_copies(p, name), *candidates]
    named = [p / name] if name is not None and _lost_its_mark(p / name) else []
    damaged = []
    for ckpt in dict.fromkeys(named + [c for c in candidates if is_complete(c)] + _complete_newest_first(p)):
        damage = _damage(ckpt)
        if damage is None:
            check_belongs(ckpt, read_trainer_state(ckpt))
            return ckpt
        damaged.append(f"{ckpt}: {damage}")
        warn(f"--resume: {ckpt} is damaged ({damage}); passed over for the newest complete checkpoint before it")
    if damaged:
        raise FlagError(
            "--resume",
            f"{path} holds no intact checkpoint (damaged: {', '.join(damaged)}); restore the damaged files, or start "
            "the run again without --resume",
        )
    raise FlagError(
        "--resume",
        f"{path} holds no complete checkpoint (a directory with {TRAIN_STATE}/{TRAINER_STATE}, or a run directory "
        "that holds one; a run killed before its first save has none); pass a checkpoint or run directory written "
        "by train.py, or start the run again without --resume",
    )


def _latest_name(run_dir: Path) -> str | None:
    """The checkpoint name `run_dir/latest` holds (None without the file). It names a directory of this run:
    a path elsewhere (another run's step_8) would resume a run whose metrics.jsonl misses steps."""
    latest = run_dir / LATEST
    if not latest.is_file():
        return None
    fix = (
        f"pass the checkpoint to continue from (--resume {run_dir}/step_N), or write the name of one of its "
        "checkpoints (e.g. step_N) into latest"
    )
    try:
        name = latest.read_bytes().decode("utf-8").strip()
    except UnicodeDecodeError:
        raise FlagError("--resume", f"{latest} is not text (not UTF-8); {fix}") from None
    if not name or name in (".", "..") or "/" in name or os.sep in name:
        raise FlagError("--resume", f"{latest} holds {name!r}, not the name of a checkpoint inside {run_dir}; {fix}")
    return name


def _complete_newest_first(run_dir: Path) -> list[Path]:
    """run_dir's complete checkpoints, most steps first (in-place names before .tmp-/.old- copies on ties)."""
    if not run_dir.is_dir():
        return []
    complete = [d for d in run_dir.iterdir() if is_complete(d)]
    return sorted(complete, key=lambda d: (recorded_step(d), not d.name.startswith(".")), reverse=True)


def _lost_its_mark(ckpt: Path) -> bool:
    """A checkpoint in place without its trainer_state.json: a save renames only complete copies into place, so
    the file went missing after the fact (a `.tmp-` or `.old-` copy without one is a save's debris instead)."""
    return (ckpt / TRAIN_STATE).is_dir() and not is_complete(ckpt)


def _damage(ckpt: Path) -> str | None:
    """What makes `ckpt`'s train state unusable: its trainer_state.json, or its shards as far as their sizes tell,
    or None. Read before anything is loaded, so a resume can pass over a damaged copy."""
    return trainer_state_damage(ckpt) or _shard_damage(ckpt)


def _shard_damage(ckpt: Path) -> str | None:
    state = ckpt / TRAIN_STATE
    try:
        metadata = dcp.FileSystemReader(str(state)).read_metadata()
    except Exception as e:  # a missing or cut .metadata: unpickling raises many types
        return f"{TRAIN_STATE}/.metadata cannot be read: {first_line(e)}"
    needed: dict[str, int] = {}
    for item in (metadata.storage_data or {}).values():
        needed[item.relative_path] = max(needed.get(item.relative_path, 0), item.offset + item.length)
    for name, size in sorted(needed.items()):
        shard = state / name
        if not shard.is_file():
            return f"{TRAIN_STATE}/{name} is missing"
        if shard.stat().st_size < size:
            return f"{TRAIN_STATE}/{name} is truncated: {shard.stat().st_size} of {size} bytes"
    return None


def load_train_state(ckpt: Path, model, optimizer, info: DistInfo) -> dict:
    """Restore model shards, optimizer state and this rank's RNG; return the trainer state."""
    msd, osd = get_state_dict(model, optimizer)
    state = {"model": msd, "optim": osd}
    rng_file = ckpt / TRAIN_STATE / f"rng_rank{info.rank}.pt"
    try:
        dcp.load(state, checkpoint_id=str(ckpt / TRAIN_STATE), no_dist=_alone(info))
        rng = torch.load(rng_file, weights_only=False) if rng_file.is_file() else None
    except Exception as e:  # damage the shards' sizes do not show (resolve_resume passed it); dcp wraps many types
        raise FlagError(
            "--resume",
            f"{ckpt} cannot be loaded ({first_line(e)}); resume from an earlier checkpoint of its run "
            f"(--resume {ckpt.parent}/step_N)",
        ) from e
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    if rng is not None:
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    return read_trainer_state(ckpt)


@dataclass(frozen=True)
class ResumePoint:
    checkpoint: Path
    step: int  # optimizer steps done
    data_position: int  # global rows consumed
    schedule_changes: dict  # {flag: [old, new]}, allowed only with --allow_schedule_change
    skipped_steps: int = 0  # steps whose non-finite update was never applied
    warnings: tuple[str, ...] = ()  # damaged checkpoints passed over for this one
    run_id: str | None = None  # the id the run goes on under in --save_dir; None: a new one


def check_resume(config: JobConfig) -> ResumePoint | None:
    """Before any loading: where `--resume` continues from, or None for a fresh run. The flags that
    shape rows and data order must match the checkpoint's run; the lr schedule flags may change
    only with --allow_schedule_change."""
    if config.checkpoint.resume is None:
        return None
    warnings: list[str] = []
    ckpt = resolve_resume(config.checkpoint.resume, warn=warnings.append)
    state = read_trainer_state(ckpt)
    run_id = continued_run_id(Path(config.checkpoint.save_dir), ckpt, state)
    saved, now = recipe_of_record(state.get("config", {})), config.flags()

    def same(key, old, new):
        if key == "dataset" and isinstance(old, str) and isinstance(new, str):  # one file, spelled two ways
            return old == new or os.path.realpath(old) == os.path.realpath(new)
        return old == new

    def changed(keys):
        return {k: [saved[k], now[k]] for k in keys if k in saved and not same(k, saved[k], now[k])}

    def listed(diff):
        return ", ".join(f"--{k} {old} -> {new}" for k, (old, new) in diff.items())

    fixed, schedule = changed(RESUME_MUST_MATCH), changed(SCHEDULE_FLAGS)
    if fixed:
        raise FlagError("--resume", f"{ckpt} was written with other flags ({listed(fixed)}); resume with its values")
    if schedule and not config.checkpoint.allow_schedule_change:
        raise FlagError(
            "--resume",
            f"{ckpt} was written with another lr schedule ({listed(schedule)}); resume with its values, or add "
            f"--allow_schedule_change to follow the new schedule from step {state['step']}",
        )
    skipped = state.get("skipped_steps", 0)
    return ResumePoint(ckpt, state["step"], state["data_position"], schedule, skipped, tuple(warnings), run_id)


def start_run(run_dir: Path, resume: ResumePoint | None) -> str:
    """Rank 0, once `run_dir` exists: write the id this run's checkpoints record to `run_dir/run_id` and return
    it; a fresh start is a new run (train/trainer_state.py)."""
    run_id = (resume.run_id if resume is not None else None) or uuid.uuid4().hex
    _write_atomic(run_dir / RUN_ID, run_id + "\n")
    return run_id


def sidecar_for(config: JobConfig, mask_id: int, global_step: int) -> Sidecar | None:
    """The block_diffusion.json of a checkpoint of this run; None for --recipe ar_sft (a plain AR checkpoint)."""
    d = config.diffusion
    if d.ar_only:
        return None
    sidecar = d.sidecar(mask_id, draft_adapter=ADAPTER_DIR if config.lora.draft_adapter else None)
    return replace(sidecar, mask_token=MASK_TOKEN, base_model=config.model.model_id, global_step=global_step)
