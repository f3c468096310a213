"""`train.py` flags whose defaults are the config dataclasses' fields (train/config.py): each default is written
once, in its section, and `--help` prints it from there (`%(default)s`). Imports no torch."""

from __future__ import annotations

import argparse
from dataclasses import MISSING, fields

# The field annotations are strings (`from __future__ import annotations`); these are the scalar ones a flag
# parses by itself. Anything else (a tuple) passes its own `type=`.
_SCALARS = {"int": int, "float": float, "str": str}


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
