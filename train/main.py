"""The trainer's entry point (`train.py`, `bdstack-train`): parse flags, run, and turn what the user can
fix into one line. `--help` and bad flags answer before torch is imported, with exit status 2 as argparse's own
errors; what stops a run after it started (data, model, resume, a diverging loss) exits with status 1."""

from __future__ import annotations

import os
import sys

from train.cli import parse_args
from train.cli_recipes import check_save_dir
from train.config import FlagError, JobConfig


def main(argv=None) -> None:
    try:
        config = JobConfig.from_args(parse_args(argv))
        check_save_dir(config.checkpoint.save_dir)  # before any model load: a run that cannot save is refused now
    except FlagError as e:
        _exit_on(e, status=2)
    from train.parallel import shutdown
    from train.trainer import run

    try:
        run(config)
    except FlagError as e:
        _leave_process_group()
        _exit_on(e, status=1)
    shutdown()
    # Some torch builds abort in atexit teardown after FSDP2 with tied weights; everything is
    # written and flushed by now, so leave without running it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _exit_on(error: FlagError, *, status: int):
    """What the user can fix (a flag, the data, the model id) is one line, not a traceback."""
    print(f"train.py: error: {error}", file=sys.stderr)
    sys.exit(status)


def _leave_process_group() -> None:
    """Without the barrier of `shutdown`: other ranks may have stopped on the same error already."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
