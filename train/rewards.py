"""Verifiable rewards for RL (`--rl_reward`), scored by the evaluation's own rules (`bdcore/scoring.py`).

A reward reads the decoded answer and the dataset's reference answer (the text of the sample's last
assistant turn) and returns a finite number:
- `exact`: 1.0 when the answer equals the reference after stripping whitespace (what `eval.py --task chat`
  reports as accuracy);
- `gsm8k`: 1.0 when the answer's last number equals the number after the reference's `####` (or the
  reference, when it is a bare number): `eval.py --task gsm8k`'s flexible match. A reference with no number
  cannot be scored: such samples are refused at data load (`unreadable_references`), never paid for;
- `package.module:function` (or `package.module.function`): any importable `function(answer, reference)
  -> float`. What it returns is checked on every call (`checked_reward`): a bool, int or float that is
  finite, else the run stops with one line naming `--rl_reward`, the function, the value and the sample.
"""

from __future__ import annotations

import importlib
import math
import numbers
from collections.abc import Callable

from bdcore.scoring import exact_match, gsm8k_reference, last_number, numbers_match
from train.config import FlagError

Reward = Callable[[str, str], float]
BUILTIN = ("exact", "gsm8k")


def _exact(answer: str, reference: str) -> float:
    return float(exact_match(answer, reference))


def _gsm8k(answer: str, reference: str) -> float:
    return float(numbers_match(last_number(answer), gsm8k_reference(reference)))


# Why a builtin reward cannot score a reference (None: it can), checked once per sample at data load.
REFERENCE_CHECKS: dict[str, Callable[[str], str | None]] = {
    "exact": lambda ref: None,
    "gsm8k": lambda ref: None if gsm8k_reference(ref) is not None else "no number after '####' and not a number",
}


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


def unreadable_references(name: str, references: list[str]) -> dict[int, str]:
    """{sample index: why} for the references reward `name` cannot score (a custom reward: none known)."""
    check = REFERENCE_CHECKS.get(name)
    if check is None:
        return {}
    return {i: why for i, ref in enumerate(references) if (why := check(ref)) is not None}


def _short(text: str, limit: int = 60) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


def checked_reward(name: str, reward: Reward, answer: str, reference: str) -> float:
    """`reward(answer, reference)` as a float; FlagError (one line) when it raises or returns anything but a
    finite number. A string such as "1.0" is refused too: a reward that returns text is a bug, not a score."""
    where = f"the reward {name} on the answer {_short(answer)} (reference {_short(reference)})"
    try:
        value = reward(answer, reference)
    except Exception as e:  # the user's code: its failure is a line naming it, not a traceback from the trainer
        raise FlagError("--rl_reward", f"{where} raised {type(e).__name__}: {e}; fix the function") from e
    if isinstance(value, numbers.Real) and math.isfinite(float(value)):  # bool and int count; str does not
        return float(value)
    raise FlagError(
        "--rl_reward", f"{where} returned {value!r}, not a finite number; a reward must return a finite float"
    )
