"""`train.py` flags whose defaults are the config dataclasses' fields (train/config.py): each default is written
once, in its section, and `--help` prints it from there (`%(default)s`); the range every float flag must lie in.
Imports no torch."""

from __future__ import annotations

import argparse
import math
from dataclasses import MISSING, fields

# The field annotations are strings (`from __future__ import annotations`); these are the scalar ones a flag
# parses by itself. Anything else (a tuple) passes its own `type=`.
_SCALARS = {"int": int, "float": float, "str": str}
# Every float flag must be finite and at most its limit: no weight, rate, ratio, temperature, alpha, gamma or clip
# of train.py means anything beyond 1e6, and a loss or activation scaled by more can overflow fp32.
FLOAT_LIMIT = (1e6, "no float flag of train.py means anything beyond it, and a loss scaled by more can overflow fp32")
FLOAT_LIMITS = {
    # AdamW moves each weight by about lr a step (10 x lr on the first, its bias correction): more than 1 wrecks
    # a pretrained model at once, and --lr 1e38 --warmup 0 overflowed fp32 inside the first optimizer step.
    "lr": (
        1.0,
        "AdamW moves each weight by about lr a step, so more than 1 wrecks the model (the recipes use 1e-5 to 3e-3)",
    ),
}
# A positive value below its floor breaks a run: a rollout divides fp32 logits by its temperature, and 1e-40 (0 in
# fp32) made every probability NaN; below 1e-6 a temperature samples the argmax anyway.
FLOAT_FLOORS = {"opd_temperature": 1e-6, "rl_temperature": 1e-6}


def field_flag(group, section: type, name: str, help: str, *, resolved: bool = False, **kwargs) -> argparse.Action:
    """`--name`, defaulting to `section`'s field `name`: a field without a default is a required flag, a bool
    field a switch (off by default). `resolved=True`: the flag defaults to None and `train.cli.validate`
    resolves it (to the field's default where nothing else decides, e.g. --lr by the LoRA recipe)."""
    field = {f.name: f for f in fields(section)}[name]
    annotation = str(field.type).removesuffix(" | None")
    if annotation == "bool":
        if field.default is not False:
            raise TypeError(f"{section.__name__}.{name}: a switch is off by default")
        return group.add_argument(f"--{name}", action="store_true", help=help, **kwargs)
    if "type" not in kwargs:
        if annotation not in _SCALARS:
            raise TypeError(f"{section.__name__}.{name}: {field.type} needs its own type= to parse")
        kwargs["type"] = _SCALARS[annotation]
    if field.default is MISSING:
        kwargs["required"] = True
    else:
        kwargs["default"] = None if resolved else field.default
    return group.add_argument(f"--{name}", help=help, **kwargs)


def check_floats(args, bad) -> None:
    """A float flag that is NaN, inf, beyond its limit (FLOAT_LIMITS) or a positive value under its floor
    (FLOAT_FLOORS) would break a run steps later (a NaN lr passes every `<= 0` test): refuse it here, by name."""
    for name, value in vars(args).items():
        if not isinstance(value, float):
            continue
        if not math.isfinite(value):
            bad(f"--{name}", f"{value} is not a finite number; pass a number (train.py --help gives its meaning)")
        limit, why = FLOAT_LIMITS.get(name, FLOAT_LIMIT)
        if abs(value) > limit:
            bad(f"--{name}", f"{value:g} is beyond {limit:g}: {why}; pass at most {limit:g}")
        floor = FLOAT_FLOORS.get(name, 0.0)
        if 0 < value < floor:
            bad(f"--{name}", f"{value:g} underflows: logits / temperature overflow fp32; pass at least {floor:g}")
