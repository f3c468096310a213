"""Answer scoring shared by evaluation (`inference/eval_tasks.py`), RL rewards (`train/rewards.py`) and the
benchmarks (`benchmark/conversion_eval.py`, `data/demo_check.py`).

One definition of what a number in an answer is and when two answers match, so a reward trains exactly
what the evaluation reports. A reference that cannot be read is an error of the data, never a match:
`None == None` must not score a number-free answer as correct.
"""

from __future__ import annotations

import re

NUMBER = re.compile(r"-?[\d,]*\.?\d+")
STRICT = re.compile(r"####\s*(-?[\d,]*\.?\d+)")


def number(text: str) -> str | None:
    """The canonical form of a number written as text ("1,000." -> "1000", "2.50" -> "2.5"), or None."""
    text = text.replace(",", "").replace("$", "").strip().rstrip(".")
    try:
        value = float(text)
    except ValueError:
        return None
    if value != value or value in (float("inf"), float("-inf")):  # "nan" and "inf" parse but are no answer
        return None
    return str(int(value)) if value.is_integer() else str(value)


def gsm8k_reference(text: str) -> str | None:
    """The number a GSM8K-style reference ends with (after its last '####', or the whole text); None when
    there is none (the row cannot be scored)."""
    return number(text.split("####")[-1])


def last_number(text: str) -> str | None:
    """lm-eval's flexible match: the last number of the answer."""
    found = NUMBER.findall(text)
    return number(found[-1]) if found else None


def strict_number(text: str) -> str | None:
    """lm-eval's strict match: the number after the answer's '####'."""
    found = STRICT.search(text)
    return number(found.group(1)) if found else None


def numbers_match(extracted: str | None, reference: str) -> bool:
    """An extracted answer matches a (readable) reference; an answer with no number never does."""
    if reference is None:
        raise ValueError("an unreadable reference cannot be scored; refuse the row where it is loaded")
    return extracted is not None and extracted == reference


def exact_match(answer: str, reference: str) -> bool:
    """The chat task's match: equal after stripping surrounding whitespace."""
    return answer.strip() == reference.strip()
