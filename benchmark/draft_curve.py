"""Acceptance against training tokens and minutes: a run's held-out drafting metric, and a fit that says what
more tokens would give.

    python -m benchmark.draft_curve runs/curve/kl [--record docs/results/data/scaling-....json]

Reads `metrics.jsonl` of a `train.py --eval_data ... --eval_every N` run: at every evaluated step, the
training tokens seen so far (every row token the steps read, `tokens_per_s x step_time_s` summed), the
training minutes (the steps' own time, evaluation excluded) and the figures the trainer's drafting metric
gives (`train/evaluation.py`: implied linear and all-canvases tokens per forward, first-draft acceptance).
Then a least-squares fit of each tokens-per-forward series against log(tokens), `y = a + b ln(tokens)`, the
simplest form that follows such curves over a decade or two (say so when R^2 is poor), and what it implies
at 10x the last point's tokens. The fit extrapolates: read it as a budget estimate, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path

SERIES = ("draft_tpf_linear", "draft_tpf_all")


@dataclass(frozen=True)
class CurvePoint:
    step: int
    tokens: int  # training tokens read up to this step
    minutes: float  # training minutes up to this step (evaluation excluded)
    implied_linear: float
    implied_all: float
    first_accept: float


@dataclass(frozen=True)
class LogFit:
    a: float
    b: float
    r2: float

    def at(self, tokens: float) -> float:
        return self.a + self.b * math.log(tokens)


def read_curve(run: Path, *, median_rate: bool = False) -> list[CurvePoint]:
    """Every evaluated step of the run, in order. `median_rate`: minutes are the tokens read over the run's
    median tokens per second (what the steps would have taken on an idle machine, when other jobs slowed some
    of them); else the steps' own time."""
    path = Path(run) / "metrics.jsonl"
    if not path.is_file():
        raise SystemExit(f"draft_curve: {path} not found: give a train.py run directory")
    records = [json.loads(line) for line in path.read_text().splitlines()]
    rates = sorted(r["tokens_per_s"] for r in records)
    median = rates[len(rates) // 2]
    points, tokens, seconds = [], 0.0, 0.0
    for r in records:
        read = r["tokens_per_s"] * r["step_time_s"]
        tokens += read
        seconds += read / median if median_rate else r["step_time_s"]
        if all(k in r for k in SERIES):
            points.append(
                CurvePoint(
                    r["step"],
                    round(tokens),
                    seconds / 60,
                    r["draft_tpf_linear"],
                    r["draft_tpf_all"],
                    r["draft_first_accept"],
                )
            )
    if len(points) < 2:
        raise SystemExit(f"draft_curve: {path} has {len(points)} evaluated steps; a curve needs --eval_every")
    return points


def log_fit(xs: list[float], ys: list[float]) -> LogFit:
    """Least squares of y = a + b ln(x)."""
    lx = [math.log(x) for x in xs]
    n, mx, my = len(xs), sum(lx) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in lx)
    b = sum((x - mx) * (y - my) for x, y in zip(lx, ys)) / sxx
    a = my - b * mx
    ss_res = sum((y - (a + b * x)) ** 2 for x, y in zip(lx, ys))
    ss_tot = sum((y - my) ** 2 for y in ys) or 1e-30
    return LogFit(a, b, 1 - ss_res / ss_tot if n > 2 else 1.0)


def report(points: list[CurvePoint]) -> str:
    lines = [
        "| step | tokens | minutes | first draft accepted | implied linear tok/fwd | implied all-canvases tok/fwd |",
        "|---|---|---|---|---|---|",
    ]
    for p in points:
        lines.append(
            f"| {p.step} | {p.tokens:,} | {p.minutes:.1f} | {p.first_accept:.1%} | {p.implied_linear:.3f} | "
            f"{p.implied_all:.3f} |"
        )
    last = points[-1].tokens
    lines.append("")
    for name, ys in (("linear", [p.implied_linear for p in points]), ("all canvases", [p.implied_all for p in points])):
        f = log_fit([p.tokens for p in points], ys)
        lines.append(
            f"{name}: y = {f.a:.3f} + {f.b:.4f} ln(tokens), R^2 {f.r2:.3f}; +{f.b * math.log(10):.3f} tok/fwd per 10x "
            f"tokens; at 10x ({10 * last:,} tokens) {f.at(10 * last):.3f}, at 100x {f.at(100 * last):.3f}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", type=Path, help="a train.py run directory (its metrics.jsonl)")
    p.add_argument("--record", type=Path, default=None, help="also write a scaling record (benchmark/record.py)")
    p.add_argument("--title", default=None, help="the record's title (default: the run's directory)")
    p.add_argument("--machine", default=None, help="the record's machine, in words (default: this machine)")
    p.add_argument(
        "--median-rate",
        action="store_true",
        help="minutes as tokens over the run's median tokens/s: idle-machine minutes for a run that other jobs "
        "slowed at times (the default is the steps' own time)",
    )
    args = p.parse_args(argv)
    points = read_curve(args.run, median_rate=args.median_rate)
    print(report(points))
    if args.record is not None:
        from benchmark import record

        rows = [
            {
                "minutes": round(pt.minutes, 2),
                "step": pt.step,
                "tokens": pt.tokens,
                "implied_linear": round(pt.implied_linear, 4),
                "implied_all": round(pt.implied_all, 4),
            }
            for pt in points
        ]
        fits = [
            log_fit([pt.tokens for pt in points], [getattr(pt, k) for pt in points])
            for k in ("implied_linear", "implied_all")
        ]
        made = record.make(
            "scaling",
            rows,
            title=args.title or f"{args.run}: drafting against training tokens",
            command=f"python -m benchmark.draft_curve {args.run}",
            source="written by benchmark.draft_curve --record",
            notes=(
                f"Fit y = a + b ln(tokens): linear +{fits[0].b * math.log(10):.3f} tok/fwd per 10x tokens (R^2 "
                f"{fits[0].r2:.2f}), all canvases +{fits[1].b * math.log(10):.3f} (R^2 {fits[1].r2:.2f})."
            ),
            **({"machine": args.machine} if args.machine else {}),
        )
        record.write(args.record, made)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
