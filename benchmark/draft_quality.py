"""How well a checkpoint drafts, from one forward per held-out answer (`bdcore/decode/policy/draft_quality.py`).

    python -m benchmark.draft_quality runs/smollm2/bd/final --data heldout.jsonl --limit 50
    python -m benchmark.draft_quality CKPT --data heldout.jsonl --compare-served --json out.json

A canvas at every answer position (seeing the answer strictly before it and itself), greedy acceptance
against the AR head prefix by prefix: the share of first drafts accepted, the mean accepted prefix, and
the tokens per forward that linear and all-canvases self-spec would take along the answers, plus the AR
head's held-out loss. `--compare-served` also decodes every prompt with the native engine in self-spec
(greedy, both layouts) and prints the served tokens per forward beside the implied ones: on answers that
are the checkpoint's own greedy output the two are equal; on other answers the metric follows their path.
Two markdown tables follow (`bdcore/decode/policy/tree_acceptance.py`): per canvas slot, the share of anchors whose
AR token is in the slot's top k given the earlier slots' were in theirs; per tree shape, its nodes, the
mean drafts a greedy verify of it would accept against the linear chain's, and the tokens per forward a
decode verifying it at every step would take along the answers (cold steps counted, as for the chain);
with `--compare-served` the engine decodes every tree too, and on the checkpoint's own answers the two agree.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def measure(checkpoint: Path, data: Path, *, limit: int, draft_len: int | None, max_rows: int, serve: bool) -> dict:
    from tqdm import tqdm

    from bdcore.decode.canvas_fill import CanvasFill
    from bdcore.decode.config import DecodeConfig
    from bdcore.decode.policy.draft_quality import draft_quality
    from bdcore.decode.runner import ModelRunner
    from bdcore.decode.tree import TreeShape, tree_setting
    from bdcore.loading import load_checkpoint
    from bdcore.serving_gate import CannotServe, resolve
    from bdcore.tokens import end_of_turn_id
    from train.data import heldout_answers

    loaded = load_checkpoint(checkpoint)
    try:
        resolve(loaded.capabilities, DecodeConfig(mode="self-spec"), "native")
    except CannotServe as e:
        raise SystemExit(f"draft_quality: {checkpoint} cannot draft for self-spec: {e}") from e
    longest = loaded.capabilities.max_draft_len
    N = draft_len or longest
    if not 2 <= N <= longest:
        raise SystemExit(f"draft_quality: --draft-len {N} must lie in [2, the checkpoint's bd_size {longest}]")
    samples = heldout_answers(str(data), loaded.tokenizer, end_of_turn_id(loaded.tokenizer), limit=limit)
    runner = ModelRunner.for_checkpoint(loaded.model, loaded.capabilities)
    t0 = time.perf_counter()
    with tqdm(total=len(samples), desc="draft quality", unit=" answers", dynamic_ncols=True) as bar:
        quality = draft_quality(
            runner,
            samples,
            mask_id=loaded.mask_id,
            draft_len=N,
            max_rows=max_rows,
            progress=bar.update,
            fill=CanvasFill.for_checkpoint(loaded.capabilities),
        )
    result = {
        "checkpoint": str(checkpoint),
        "data": str(data),
        "samples": quality.samples,
        "anchors": quality.anchors,
        "draft_len": N,
        **quality.summary(),
        "seconds": time.perf_counter() - t0,
    }
    result["trees"] = quality.trees(N)
    if serve:
        result.update(served(loaded, samples, N))
        for row in result["trees"]["tree_shapes"]:  # each tree verified by the engine, both canvas layouts
            if max(row["widths"]) > 1:  # the linear chain: `served` decoded it
                setting = tree_setting(TreeShape(tuple(row["widths"]), row["spine"]))
                for layout, key in (("last", "served_tpf_linear"), ("all", "served_tpf_all")):
                    row[key] = served_tpf(loaded, samples, N, layout, setting)
    return result


def served(loaded, samples: list[tuple[list[int], int]], draft_len: int) -> dict:
    """Served greedy self-spec tokens per forward on the same prompts, linear and all canvases."""
    return {
        "served_tpf_linear": served_tpf(loaded, samples, draft_len, "last"),
        "served_tpf_all": served_tpf(loaded, samples, draft_len, "all"),
    }


def served_tpf(loaded, samples: list[tuple[list[int], int]], draft_len: int, canvases: str, tree: str = "off") -> float:
    """Tokens per forward of the native engine's greedy self-spec over the samples' prompts, each answer
    capped at the reference's length (so a run-on answer costs no more than the metric's)."""
    from bdcore.decode.config import DecodeConfig
    from bdcore.decode.sampling import SamplingParams
    from inference.native.engine import Engine

    decode = DecodeConfig(mode="self-spec", draft_len=draft_len, self_spec_canvases=canvases, tree=tree)
    engine = Engine(loaded, decode)
    tokens = forwards = 0
    for ids, start in samples:
        gen = engine.generate(ids[:start], SamplingParams(max_tokens=len(ids) - start))
        tokens += gen.stats.generated
        forwards += gen.stats.forwards
    return tokens / max(1, forwards)


def markdown_tables(trees: dict[str, list]) -> str:
    """The per-slot top-k path acceptance and the tree shapes' accepted drafts, as markdown tables."""
    slots = trees["topk_path_acceptance"]
    ks = [k for k in slots[0] if k.startswith("top")] if slots else []
    lines = [
        "| slot | anchors reaching it (top-1) | " + " | ".join(f"top-{k[3:]} path" for k in ks) + " |",
        "|---:|---:|" + "---:|" * len(ks),
    ]
    lines += [f"| {r['slot']} | {r['anchors']} | " + " | ".join(_cell(r[k]) for k in ks) + " |" for r in slots]
    lines += [
        "",
        "| tree shape | tree nodes (verify rows) | mean accepted drafts per verify | vs linear "
        "| implied tokens/forward, canvases after the last spine row / every one | served |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in trees["tree_shapes"]:
        ratio = "-" if r["vs_linear"] is None else f"{r['vs_linear']:.2f}x"
        implied, served = (
            "-" if f"{kind}tpf_linear" not in r else f"{r[f'{kind}tpf_linear']:.3f} / {r[f'{kind}tpf_all']:.3f}"
            for kind in ("", "served_")
        )
        lines.append(f"| {r['shape']} | {r['nodes']} | {r['mean_accepted']:.4f} | {ratio} | {implied} | {served} |")
    return "\n".join(lines)


def _cell(share: float | None) -> str:
    return "-" if share is None else f"{share:.4f}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmark.draft_quality", description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", type=Path, help="a block-diffusion checkpoint whose clean stream is causal")
    p.add_argument("--data", type=Path, required=True, help="chat JSONL whose records end with the assistant's answer")
    p.add_argument("--limit", type=int, default=50, help="answers to score (default 50; 0: all)")
    p.add_argument("--draft-len", type=int, default=None, help="N, as serve.py --draft-len (default: the bd_size)")
    p.add_argument(
        "--max-rows", type=int, default=4096, help="rows per forward; longer answers take several (default 4096)"
    )
    p.add_argument("--compare-served", action="store_true", help="also decode with the engine and print both")
    p.add_argument("--json", type=Path, default=None, help="write the result here")
    p.add_argument(
        "--record",
        type=Path,
        default=None,
        help="also write a scaling-curve point (benchmark/record.py) for `python -m benchmark.report`; needs --minutes",
    )
    p.add_argument("--minutes", type=float, default=None, help="the checkpoint's training minutes, for --record")
    args = p.parse_args(argv)
    if not args.data.is_file():
        p.error(f"--data {args.data}: no such file")
    if args.record and args.minutes is None:
        p.error("--record puts the checkpoint on the scaling curve: give its training minutes (--minutes)")
    result = measure(
        args.checkpoint,
        args.data,
        limit=args.limit,
        draft_len=args.draft_len,
        max_rows=args.max_rows,
        serve=args.compare_served,
    )
    figures = {k: v for k, v in result.items() if k != "trees"}
    width = max(len(k) for k in figures)
    for k, v in figures.items():
        print(f"{k:<{width}}  {v:.4f}" if isinstance(v, float) else f"{k:<{width}}  {v}")
    print("\n" + markdown_tables(result["trees"]))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    if args.record:
        write_record(args, argv, result)
    return 0


def write_record(args, argv, result: dict) -> None:
    """The checkpoint as one point of the scaling curve (benchmark/record.py, kind `scaling`): the implied tokens
    per forward and, with --compare-served, the served ones."""
    from benchmark import record

    row = {
        "minutes": args.minutes,
        "implied_linear": result["draft_tpf_linear"],
        "implied_all": result["draft_tpf_all"],
        "served_linear": result.get("served_tpf_linear"),
        "served_all": result.get("served_tpf_all"),
    }
    command = "python -m benchmark.draft_quality " + " ".join(argv if argv is not None else sys.argv[1:])
    made = record.make(
        "scaling",
        [row],
        title=f"{args.checkpoint}: drafting after {args.minutes:g} training minutes",
        command=command,
        source="written by benchmark.draft_quality --record",
        model=str(args.checkpoint),
        series="scaling",
        notes=f"{result['samples']} held-out answers of {args.data}, {result['anchors']} anchors, "
        f"N = {result['draft_len']}.",
    )
    record.write(args.record, made)


if __name__ == "__main__":
    sys.exit(main())
