"""The printed tables and the results record of `benchmark.serving.bench_decode`."""

from __future__ import annotations

import math
import sys
from pathlib import Path

from benchmark.record import VLLM  # bench_decode's variant of the base model on stock vLLM's CPU build


def _spread(ratios: list[float] | None) -> str:
    return f"{min(ratios):.2f}-{max(ratios):.2f}x" if ratios else "-"


def _num(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.2f}"


def table(rows: list[dict], args, requests: int, has_baseline: bool) -> str:
    """The printed tables: every mode against the base model's `generate` and our causal mode, the range of the
    ratio to causal over the rounds, and, with --in-process, the server against the engine here."""
    lines = [
        f"{requests} requests ({args.num} prompts x {args.repeat}), max_tokens {args.max_tokens}, greedy, "
        f"{args.rounds} interleaved rounds at most"
    ]
    if not has_baseline:
        lines.append("(no base-model baseline: give --base, the model this checkpoint was converted from)")
    if any(r.get("mode") == VLLM for r in rows):
        lines.append("tok/s against stock vLLM (the base model on its CPU build, same requests and rounds):")
        lines += [f"- {r['variant']} at {r['concurrency']}: {r['vs_vllm']:.2f}x" for r in rows]
    lines += [
        "| mode | conc | accuracy | same as causal | tokens/forward | acceptance length | tok/s | tok/s vs base "
        "generate | tok/s vs causal | vs causal, rounds min-max | tok/s per request | p50 s | p90 s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['variant']} | {r['concurrency']} | {r['accuracy']:.1%} | {r['same_as_causal']:.0%} | "
            f"{r['tokens_per_forward']:.2f} | {_num(r['acceptance_length'])} | {r['tok_s']:.1f} | "
            f"{r['vs_base']:.2f}x | {r['speedup']:.2f}x | "
            f"{_spread(r.get('vs_causal_by_round'))} | {r['tok_s_per_request']:.1f} | {r['p50']:.3f} | {r['p90']:.3f} |"
        )
    if any("in_process_tok_s" in r for r in rows):
        lines.append("\n| mode | conc | server tok/s | in-process tok/s | server / in-process |\n|---|---|---|---|---|")
        for r in rows:
            if "in_process_tok_s" in r:
                ratio = r["tok_s"] / r["in_process_tok_s"]
                speeds = f"{r['tok_s']:.1f} | {r['in_process_tok_s']:.1f}"
                lines.append(f"| {r['variant']} | {r['concurrency']} | {speeds} | {ratio:.2f}x |")
    return "\n".join(lines)


def write_record(args, argv, rows: list[dict]) -> None:
    """The run as a results record (benchmark/record.py): one row per mode and concurrency."""
    from bdcore.loading import serving_dtype
    from benchmark import record

    command = "python -m benchmark.serving.bench_decode " + " ".join(argv if argv is not None else sys.argv[1:])
    dtype = serving_dtype(args.dtype, args.device)
    where = args.checkpoint or args.base_url
    kept = [dict(r, variant=r["variant"], vs_causal=r["speedup"]) for r in rows]
    made = record.make(
        "speed",
        kept,
        title=f"{where} through the server, concurrency {args.concurrency}",
        command=command,
        source="written by benchmark.serving.bench_decode --record",
        model=where,
        dtype=dtype,
        # one plot panel per checkpoint, dtype, prompt set and machine: runs elsewhere are not one curve
        series=f"{where}, {dtype}, {Path(args.prompts).name}, through the server, {record.this_machine()}",
        notes=f"{args.num} prompts x {args.repeat} from {args.prompts}, up to {args.max_tokens} tokens, greedy, "
        f"{args.rounds} interleaved rounds at most.",
    )
    record.write(args.record, made)
