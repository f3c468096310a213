"""Interleaved rounds, the timing rule of the decode benchmarks (`benchmark.self_spec_canvases`,
`benchmark.serving.bench_decode`): the requests are cut into slices and each slice is run by every variant in
turn, the order rotating by slice. A shared machine's speed drifts by 10-15% over tens of seconds; variants
timed one after the other each get a different share of that drift (three `make demo` runs read self-spec
between 0.59x and 1.57x causal that way), variants timed in rounds share it alike.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# a variant: requests -> (one output per request, in order; the wall seconds they took)
Runner = Callable[[list], tuple[list, float]]


@dataclass
class Interleaved:
    outputs: dict[str, list]  # per variant, one output per request, in the requests' order
    seconds: dict[str, float]  # per variant, wall seconds over all rounds
    per_round: dict[str, list[list]]  # per variant, [tokens, seconds] of each round, in round order

    def tok_s(self, name: str) -> float:
        return sum(t for t, _ in self.per_round[name]) / self.seconds[name]

    def round_ratios(self, name: str, against: str) -> list[float]:
        """`name`'s tok/s over `against`'s in each round: the spread the total hides."""
        return [(t / s) / (t0 / s0) for (t, s), (t0, s0) in zip(self.per_round[name], self.per_round[against])]


def slices(n: int, rounds: int, concurrency: int = 1) -> list[range]:
    """`rounds` slices of n requests (fewer when a slice would not fill `concurrency` requests in flight)."""
    rounds = max(1, min(rounds, n // concurrency))
    return [range(i * n // rounds, (i + 1) * n // rounds) for i in range(rounds)]


def run_interleaved(
    runners: dict[str, Runner], requests: list, *, rounds: int, concurrency: int, tokens: Callable[[Any], int]
) -> Interleaved:
    """Every runner over `requests` in interleaved rounds; `tokens(output)` counts an output's tokens."""
    names = list(runners)
    result = Interleaved({n: [None] * len(requests) for n in names}, dict.fromkeys(names, 0.0), {n: [] for n in names})
    for r, part in enumerate(slices(len(requests), rounds, concurrency)):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            got, seconds = runners[name]([requests[i] for i in part])
            result.seconds[name] += seconds
            result.per_round[name].append([sum(tokens(g) for g in got), seconds])
            for i, g in zip(part, got):
                result.outputs[name][i] = g
    return result
