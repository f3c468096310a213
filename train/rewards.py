"""Verifiable rewards for RL (`--rl_reward`), one definition with the evaluation scorers.

A reward reads the decoded answer and the dataset's reference answer (the text of the sample's last
assistant turn) and returns a float:
- `exact`: 1.0 when the answer equals the reference after stripping whitespace (`inference.eval_tasks`'s
  `chat` scorer, which `eval.py --task chat` reports as accuracy);
- `gsm8k`: 1.0 when the answer's last number equals the number after the reference's `####` (the
  `gsm8k` scorer's flexible match, which `eval.py --task gsm8k` reports as accuracy);
- `package.module:function` (or `package.module.function`): any importable `function(answer, reference)
  -> float`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from inference.eval_tasks import TASKS, Problem, _number

Reward = Callable[[str, str], float]
BUILTIN = ("exact", "gsm8k")


def _exact(answer: str, reference: str) -> float:
    return float(TASKS["chat"].score(Problem("", [], reference), answer)["correct"])


def _gsm8k(answer: str, reference: str) -> float:
    number = _number(reference.split("####")[-1])
    return float(TASKS["gsm8k"].score(Problem("", [], number), answer)["correct"])


def load_reward(name: str) -> Reward:
    """The reward `--rl_reward` names; ValueError with the fix when it cannot be found."""
    if name == "exact":
        return _exact
    if name == "gsm8k":
        return _gsm8k
    module, sep, attr = name.partition(":") if ":" in name else name.rpartition(".")
    if not sep or not module or not attr:
        raise ValueError(f"{name!r} is neither {' nor '.join(BUILTIN)} nor a dotted path like package.module:function")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(
            f"cannot import {name!r} ({e}); the module must be importable from the working directory"
        ) from (e)
    if not callable(fn):
        raise ValueError(f"{name!r} is not callable; it must be a function(answer, reference) -> float")
    return fn
