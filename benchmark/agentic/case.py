"""One request the probe sends (`probe.py`): the shared type of probe_cases.py and probe_korean.py."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Case:
    name: str
    used_by: str
    body: dict
    path: str = "/chat/completions"
    check: dict = field(default_factory=dict)  # no_calls, name, max_calls, forced
    method: str = "POST"
