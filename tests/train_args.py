"""train.py argument lists for the tests' tiny runs, built in one place."""

from __future__ import annotations

from pathlib import Path

# Blocks of 4 and rows of 192 tokens: a few seconds per step on CPU with the demo kits' tiny models.
TINY = {"bd_size": 4, "max_length": 192}


def train_args(kit: Path | None = None, save_dir: Path | None = None, **flags) -> list[str]:
    """argv for train.py on a demo kit (its base_model and train.jsonl) with the TINY shape.

    Every keyword is a flag by its name: a value is passed as `--name value`, True as a bare
    `--name`, False or None leaves the flag (or a TINY default) out; `model_id=` and `dataset=`
    replace the kit's. `train_args(kit, run, max_steps=3, pack=True, lr="2e-3")`.
    """
    values = {}
    if kit is not None:
        values.update(model_id=kit / "base_model", dataset=kit / "train.jsonl")
    values.update(TINY)
    values.update(flags)
    if save_dir is not None:
        values["save_dir"] = save_dir
    argv = []
    for name, value in values.items():
        if value is None or value is False:
            continue
        argv += [f"--{name}"] if value is True else [f"--{name}", str(value)]
    return argv
