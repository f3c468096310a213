"""A checkpoint's train_state/trainer_state.json: its fields checked before a resume uses them, and the run
the checkpoint belongs to.

A run directory's `run_id` file holds a random id, written when a run starts there without --resume;
every checkpoint records it in its trainer state. A resume refuses a checkpoint that sits in a run
directory but records another run's id: copied in from another run (with the same flags, so nothing
else tells), it would continue that run's steps in this run's metrics.jsonl, with steps missing or
repeated. It is refused rather than passed over for the run's own newest checkpoint: someone put it
there for a reason a resume cannot know, and the run's next save of that name would delete it.

A fresh start in a directory an earlier run used is a new run: metrics.jsonl restarts, so that run's
checkpoints no longer continue this directory's log, and a new id makes a resume refuse them.

Without an id on either side nothing is checked: checkpoints and run directories from before run ids,
and a checkpoint moved by itself into a directory of its own (which then takes the checkpoint's id).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from bdcore.checkpoint_files import first_line
from train.config import FlagError

TRAIN_STATE = "train_state"
TRAINER_STATE = "trainer_state.json"
RUN_ID = "run_id"
_RUN_ID_FORM = re.compile(r"[0-9a-f]{32}")


def read_trainer_state(ckpt: Path) -> dict:
    return json.loads((ckpt / TRAIN_STATE / TRAINER_STATE).read_text())


def recorded_step(ckpt: Path) -> int:
    """The steps a checkpoint records, -1 where its trainer state cannot tell (sorted last)."""
    try:
        return int(read_trainer_state(ckpt)["step"])
    except (OSError, ValueError, RecursionError, KeyError, TypeError):
        return -1


def trainer_state_damage(ckpt: Path) -> str | None:
    """What is wrong with trainer_state.json (missing, cut, not JSON, a field of the wrong type), or None."""
    name = f"{TRAIN_STATE}/{TRAINER_STATE}"
    try:
        state = read_trainer_state(ckpt)
    except FileNotFoundError:
        return f"{name} is missing"
    except (ValueError, RecursionError) as e:  # cut, not UTF-8 (both ValueErrors) or nested past the parser
        return f"{name} is not valid JSON: {first_line(e)}"
    except OSError as e:
        return f"{name} cannot be read: {first_line(e)}"
    if not isinstance(state, dict):
        return f"{name} holds {_shown(state)}, not an object"
    missing = next((key for key in ("step", "data_position") if key not in state), None)
    if missing is not None:
        return f"{name} has no {missing}"
    for key in ("step", "data_position", "skipped_steps"):  # skipped_steps: absent from older checkpoints
        value = state.get(key, 0)
        if type(value) is not int or value < 0:  # a bool is an int to isinstance, and no count
            return f"{name} has {key} {_shown(value)}, not a count"
    if not isinstance(state.get("config", {}), dict):
        return f"{name} has config {_shown(state['config'])}, not an object"
    if RUN_ID in state and not is_run_id(state[RUN_ID]):
        return f"{name} has {RUN_ID} {_shown(state[RUN_ID])}, not a run id"
    return None


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def is_run_id(value) -> bool:
    return isinstance(value, str) and _RUN_ID_FORM.fullmatch(value) is not None


def read_run_id(run_dir: Path) -> str | None:
    """The id in `run_dir/run_id`; None without the file."""
    path = run_dir / RUN_ID
    if not path.is_file():
        return None
    try:
        with open(path, "rb") as f:
            text = f.read(100).decode("utf-8", errors="replace").strip()
        problem = None if is_run_id(text) else f"holds {_shown(text)}, not a run id (32 hex digits)"
    except OSError as e:
        problem = f"cannot be read ({first_line(e)})"
    if problem is not None:
        raise FlagError(
            "--resume",
            f"{path} {problem}; restore it, or delete it to resume without checking that the checkpoints in "
            f"{run_dir} belong to one run",
        )
    return text


def check_belongs(ckpt: Path, state: dict) -> None:
    """Refuse `ckpt` when the run directory it sits in names another run than its trainer state does."""
    own, recorded = read_run_id(ckpt.parent), state.get(RUN_ID)
    if own is None or recorded is None or own == recorded:
        return
    raise FlagError(
        "--resume",
        f"{ckpt} belongs to another run (run id {recorded}; {ckpt.parent / RUN_ID} says {own}), copied in or left "
        f"by a run before a fresh start there; move it out of {ckpt.parent} (--resume {ckpt.parent} then continues "
        "the newest checkpoint of its own run), or to continue that other run, resume it from a directory of its "
        "own with a new --save_dir",
    )


def continued_run_id(run_dir: Path, ckpt: Path, state: dict) -> str | None:
    """The id a run resumed from `ckpt` keeps in `run_dir`: the directory's own; else the checkpoint's when it sits
    in `run_dir` (moved there by itself: its later resumes must not take it for another run's); else None (new)."""
    own = read_run_id(run_dir)
    if own is not None:
        return own
    if os.path.realpath(ckpt.parent) == os.path.realpath(run_dir):
        return state.get(RUN_ID)
    return None
