"""The decode forward's cost by rows, per dtype, side by side: what the self-spec policy's cost model sees.

    python -m benchmark.row_cost runs/smollm2/base --dtypes fp32,bf16 --json runs/row_cost.json

For each dtype the checkpoint is loaded and `bdcore.decode.policy.cost.calibrate` times forwards of 1, 2, 4, ...
rows over a cached context (median of `--repeats` after a warm-up; the engine's own start-up measurement,
not read from the cache). The table gives seconds per forward by rows, each dtype's ratio to the first one
at that row count, and each curve's cost relative to its own 1-row forward (how much a row costs: the slope
that decides how much self-spec can draft for free). `--batch B` times forwards of B sequences, each of
those rows (the curve the policy reads with B requests in flight; up to B x rows = the largest size).

`--against BASE` measures the base model the checkpoint was converted from the same way, alternating
checkpoint and base `--alternations` times (each size's fastest median kept, so a burst of load on the
machine hits both alike), and adds a table of the checkpoint's forward against the base's: for a
draft-adapter checkpoint these forwards run no drafting row, which is what causal decoding and self-spec
verification cost (which should be within 5% of the base model's).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def measure(
    checkpoint: str, dtypes: list[str], *, context: int, repeats: int, sizes, batch: int = 1
) -> dict[str, dict[int, float]]:
    from bdcore.decode.policy.cost import calibrate
    from bdcore.decode.runner import ModelRunner
    from bdcore.loading import load_checkpoint

    curves = {}
    for dtype in dtypes:
        loaded = load_checkpoint(checkpoint, dtype=dtype)
        runner = ModelRunner.for_checkpoint(loaded.model, loaded.capabilities)
        cost = calibrate(runner, sizes=sizes, batches=(batch,), context=context, repeats=repeats)
        curves[dtype] = cost.points[batch]
        del loaded, runner
    return curves


def table(curves: dict[str, dict[int, float]]) -> str:
    names = list(curves)
    first = curves[names[0]]
    head = " | ".join(f"{n} ms | {n} vs 1 row" + (f" | {n} vs {names[0]}" if n != names[0] else "") for n in names)
    lines = [f"| rows | {head} |", "|---" * (1 + sum(3 if n != names[0] else 2 for n in names)) + "|"]
    for r in sorted(first):
        cells = []
        for n in names:
            c = curves[n]
            cells += [f"{1000 * c[r]:.1f}", f"{c[r] / c[min(c)]:.2f}x"]
            if n != names[0]:
                cells.append(f"{c[r] / first[r]:.2f}x")
        lines.append(f"| {r} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def against_table(curves: dict[str, dict[int, float]], base: dict[str, dict[int, float]]) -> str:
    lines = ["| rows | " + " | ".join(f"{n} ms | base {n} ms | vs base" for n in curves) + " |"]
    lines.append("|---" * (1 + 3 * len(curves)) + "|")
    for r in sorted(next(iter(curves.values()))):
        cells = []
        for n, c in curves.items():
            cells += [f"{1000 * c[r]:.1f}", f"{1000 * base[n][r]:.1f}", f"{c[r] / base[n][r]:.3f}x"]
        lines.append(f"| {r} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def fastest(runs: list[dict[str, dict[int, float]]]) -> dict[str, dict[int, float]]:
    return {n: {r: min(run[n][r] for run in runs) for r in runs[0][n]} for n in runs[0]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmark.row_cost", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("checkpoint")
    p.add_argument("--dtypes", default="fp32,bf16", help="comma list of fp32, bf16, fp16 (default fp32,bf16)")
    p.add_argument("--sizes", default="1,2,4,8,16,32,64,128,256", help="row counts (default 1,2,...,256)")
    p.add_argument("--context", type=int, default=128, help="cached tokens the forwards attend to (default 128)")
    p.add_argument(
        "--batch",
        type=int,
        default=1,
        help="sequences in each forward, each of --sizes rows up to batch x rows = the largest (default 1)",
    )
    p.add_argument("--repeats", type=int, default=5, help="timed forwards per row count (default 5)")
    p.add_argument("--against", default=None, help="a base model directory to measure side by side (see above)")
    p.add_argument("--alternations", type=int, default=2, help="checkpoint/base alternations with --against")
    p.add_argument("--json", default=None, help="also write the curves here")
    args = p.parse_args(argv)
    dtypes = [d for d in args.dtypes.split(",") if d]
    if bad := [d for d in dtypes if d not in ("fp32", "bf16", "fp16")]:
        p.error(f"--dtypes: unknown {bad}; choose from fp32, bf16, fp16")
    sizes = tuple(int(x) for x in args.sizes.split(",") if x)
    if args.alternations < 1:
        p.error(f"--alternations {args.alternations}: give at least 1")
    if args.batch < 1:
        p.error(f"--batch {args.batch}: give at least 1")
    kw = dict(context=args.context, repeats=args.repeats, sizes=sizes, batch=args.batch)
    if args.against is None:
        curves, base = measure(args.checkpoint, dtypes, **kw), None
    else:
        runs = [
            (measure(args.checkpoint, dtypes, **kw), measure(args.against, dtypes, **kw))
            for _ in range(args.alternations)
        ]
        curves, base = fastest([a for a, _ in runs]), fastest([b for _, b in runs])
    command = "python -m benchmark.row_cost " + " ".join(argv if argv is not None else sys.argv[1:])
    print(f"{command}\n\n{table(curves)}")
    if base is not None:
        print(f"\n{args.checkpoint} against {args.against}:\n\n{against_table(curves, base)}")
    if args.json:
        record = {"command": command, "seconds": curves, **({"base_seconds": base} if base else {})}
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
