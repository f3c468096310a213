#!/usr/bin/env python
"""Block-diffusion SFT entry point: `torchrun --nproc_per_node=N train.py ...` or `python train.py ...`."""

import os
import sys

from train.cli import parse_args


def main(argv=None) -> None:
    args = parse_args(argv)  # --help and bad flags answer here, before torch is imported
    from train.parallel import shutdown
    from train.trainer import run

    run(args)
    shutdown()
    # Some torch builds abort in atexit teardown after FSDP2 with tied weights; everything is
    # written and flushed by now, so leave without running it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
