#!/usr/bin/env python
"""Block-diffusion SFT entry point: `torchrun --nproc_per_node=N train.py ...` or `python train.py ...`
(installed: `bdstack-train ...`). The program lives in `train/main.py`."""

from train.main import main

if __name__ == "__main__":
    main()
