"""Self-spec layouts side by side in one run: causal, linear (a canvas after the last clean row), a canvas after
every clean row, and `auto` (the engine chooses the draft length and canvases each step from the forward cost
it measured and the acceptance it observes), plus, with `--draft-lens`, every fixed draft length in both layouts.

    python -m benchmark.self_spec_canvases runs/demo/bd/final --heldout runs/demo/kit/eval.jsonl --limit 100 \
        --draft-lens 2,4,8 --concurrency 1

The native engine in process, greedy, after one untimed warm-up request per variant, the same prompts in every
variant (chat JSONL with reference answers, or HumanEval-style prompts), one request at a time or
`--concurrency` K requests in flight on the batched scheduler: tokens per forward, tok/s and its ratio to
causal, the share of outputs identical to causal decoding (lossless: must be 100%; causal decoding is
`benchmark.conversion_eval.stock_greedy`, the Hugging Face model's own greedy loop, so the engine's causal
variant is held to it as well), how many drafts were accepted per verify and how many tokens each forward
drafted. The last lines compare `auto` with causal, with the best fixed variant, and with a best fixed
variant chosen on the other rounds and timed on the held-out one (leave one round out): the fastest of
several variants timed on the same requests is partly the luckiest, so the in-sample comparison is biased
against `auto` by the noise, the held-out one is not. `--repeat` runs the prompts more than once where the
held-out set is small.

The first row is the speed baseline: the base model decoded by `transformers` `generate`
(`benchmark/base_generate.py`; a draft-adapter checkpoint is its own base, any other needs `--base`), timed
in the same rounds; every tok/s is given against it and against our causal mode.

The model runs in the dtype `serve.py` loads (`--dtype auto`: bf16 on a GPU and on a CPU with native bf16;
`--device cuda` on a GPU), and the prompts are cut into `--rounds` slices that every variant runs in turn, so
that a change in the machine's speed during the run falls on all of them alike.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import Counter
from pathlib import Path

BASELINE = "base generate"  # the base model decoded by transformers' generate (benchmark/base_generate.py)
VARIANTS = {
    "causal": dict(mode="causal"),
    "self-spec last": dict(mode="self-spec", self_spec_canvases="last"),
    "self-spec all": dict(mode="self-spec", self_spec_canvases="all"),
    "self-spec auto": dict(mode="self-spec", self_spec_canvases="auto", draft_len="auto"),
}


def variants(draft_len: int | None, draft_lens: list[int], trees: list[str] = ()) -> dict[str, dict]:
    """The named variants, with `draft_len` for the fixed ones, then both layouts at each of `draft_lens`, then
    per draft-tree setting (`--trees`): auto as `self-spec auto trees` (auto with trees weighed), a shape in
    both layouts at `draft_len`."""
    out = {k: ({"draft_len": draft_len} if "draft_len" not in v else {}) | v for k, v in VARIANTS.items()}
    for n in draft_lens:
        for canvases in ("last", "all"):
            out[f"self-spec {canvases} N={n}"] = dict(mode="self-spec", self_spec_canvases=canvases, draft_len=n)
    for tree in trees:
        if tree == "auto":
            out["self-spec auto trees"] = VARIANTS["self-spec auto"] | {"tree": "auto"}
            continue
        for canvases in ("last", "all"):
            fixed = dict(mode="self-spec", self_spec_canvases=canvases, draft_len=draft_len, tree=tree)
            out[f"self-spec {canvases} tree={tree}"] = fixed
    return out


def variant_names(text: str) -> list[str]:
    """A comma list of variant names; a tree shape's own commas ('self-spec last tree=2,2') stay in its name, as
    every name starts with one of the variants' first words."""
    return [x.strip() for x in re.split(r",\s*(?=self-spec |causal|base generate)", text) if x.strip()]


def _generator(engine, concurrency: int):
    """A function running a list of prompts on `engine` (one at a time, or `concurrency` in flight on the
    batched scheduler, warmed up once here), returning the generations and the wall time."""
    if concurrency == 1:

        def one_at_a_time(prompts, params):
            start = time.perf_counter()
            return [engine.generate(ids, params) for ids in prompts], time.perf_counter() - start

        return one_at_a_time
    from bdcore.decode.driver import DecodeLoop

    def batched(prompts, params):
        # The scheduler's own loop (`DecodeLoop`: admit while there is room, one batched step), on this thread:
        # a scheduler thread of its own would get a second OpenMP team and decode about a third slower on a
        # 2-core CPU, which the server avoids (`Scheduler.run_here`)
        # and the base model's generate, on this thread, would not pay.
        start = time.perf_counter()
        loop: DecodeLoop = DecodeLoop(engine.driver, concurrency)
        waiting, outs = list(enumerate(prompts)), [None] * len(prompts)
        while waiting or loop.active:
            while waiting and loop.room:
                i, ids = waiting.pop(0)
                decoder, out = engine.start(ids, params)
                loop.admit((i, out), decoder)
            for (i, out), _ in loop.step():  # no `catch`: a failure raises
                outs[i] = out.generation()
        return outs, time.perf_counter() - start

    return batched


def measure(
    checkpoint: Path,
    heldout_path: Path,
    *,
    limit: int,
    max_tokens: int,
    draft_len: int | None,
    draft_lens: list[int] = (),
    trees: list[str] = (),
    concurrency: int = 1,
    only: list[str] = (),
    dtype: str = "auto",
    rounds: int = 1,
    repeat: int = 1,
    device: str = "cpu",
    base: Path | None = None,
) -> list[dict]:
    """Every variant over the same prompts. With `rounds` R the prompts are cut into R slices and each slice
    runs every variant in turn (the order rotating by slice), so a drift of the machine's speed during the
    run (another process, thermal, memory) is shared by the variants instead of landing on one. `repeat` K runs
    the prompts K times over (greedy: the same tokens, K times the timings) where a held-out set is small.
    Each row keeps its per-round tokens and seconds (`per_round`), from which `table` picks a best fixed
    variant on some rounds and scores it on the others."""
    from transformers import AutoTokenizer

    from bdcore.decode.config import DecodeConfig
    from bdcore.decode.sampling import SamplingParams
    from bdcore.loading import load_checkpoint, serving_dtype
    from benchmark.base_generate import base_generator, base_model_dir
    from benchmark.conversion_eval import load_heldout, stock_greedy
    from benchmark.interleave import run_interleaved
    from inference.native.engine import Engine

    loaded = load_checkpoint(checkpoint, device=device, dtype=serving_dtype(dtype, device))
    heldout = load_heldout(heldout_path, AutoTokenizer.from_pretrained(checkpoint), limit)
    causal = [  # before any Engine exists: an engine binds its decode forward to hybrid layers
        stock_greedy(loaded.model, ids, max_tokens=max_tokens, stop_ids=loaded.stop_ids, banned=loaded.mask_id)
        for ids in heldout.prompt_ids
    ]
    params = SamplingParams(max_tokens=max_tokens)
    chosen = variants(draft_len, list(draft_lens), list(trees))
    unknown = sorted(set(only) - set(chosen))
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; choose from {list(chosen)}")
    if only:  # causal first: the table's ratios are to it
        chosen = {k: v for k, v in chosen.items() if k == "causal" or k in only}
    prompts, causal = heldout.prompt_ids * repeat, causal * repeat
    run = {}
    base_dir = base_model_dir(checkpoint, base)
    if base_dir is not None:
        dtype_of = next(loaded.model.parameters()).dtype
        run[BASELINE] = base_generator(
            base_dir, dtype=dtype_of, device=device, stop_ids=loaded.stop_ids, concurrency=concurrency
        )
        run[BASELINE](prompts[:concurrency], params)  # warm-up, not timed
    for name, settings in chosen.items():
        engine = Engine(loaded, DecodeConfig(**settings))  # an auto variant measures its row cost here (cached)
        run[name] = _generator(engine, concurrency)
        run[name](prompts[:concurrency], params)  # warm-up, not timed
    got = run_interleaved(
        {name: (lambda batch, f=f: f(batch, params)) for name, f in run.items()},
        prompts,
        rounds=rounds,
        concurrency=concurrency,
        tokens=lambda g: g.stats.generated,
    )
    from bdcore.decode.sequence import DecodeStats

    names, outs, wall, per_round = list(run), got.outputs, got.seconds, got.per_round  # the baseline first
    rows = []
    for name in names:
        gens = outs[name]
        generated, forwards = sum(g.stats.generated for g in gens), sum(g.stats.forwards for g in gens)
        accepted, drafted = Counter(), Counter()
        for g in gens:
            accepted.update(g.stats.accepted)
            drafted.update(g.stats.drafted)
        rows.append(
            {
                "variant": name,
                "tokens_per_forward": generated / forwards,
                # the field's acceptance length (self-spec only), by its one definition
                "acceptance_length": DecodeStats(accepted=accepted).acceptance_length or None,
                "tok_s": generated / wall[name],
                "same_as_causal": sum(g.tokens == c for g, c in zip(gens, causal)) / len(gens),
                "forwards": forwards,
                "accepted": dict(sorted(accepted.items())),
                "drafted": dict(sorted(drafted.items())),
                "per_round": per_round[name],
            }
        )
    return rows


def table(rows: list[dict]) -> str:
    """Every row's tok/s against the base model's `generate` (when measured) and against our causal mode."""
    base = next((r["tok_s"] for r in rows if r["variant"] == BASELINE), None)
    causal = next(r["tok_s"] for r in rows if r["variant"] == "causal")
    lines = [
        "| variant | tokens/forward | tok/s | tok/s vs base generate | tok/s vs causal | same as causal | forwards "
        "| drafts accepted per verify | forwards by tokens drafted |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        vs_base = f"{r['tok_s'] / base:.2f}x" if base else "-"
        lines.append(
            f"| {r['variant']} | {r['tokens_per_forward']:.2f} | {r['tok_s']:.1f} | {vs_base} "
            f"| {r['tok_s'] / causal:.2f}x | {r['same_as_causal']:.0%} | {r['forwards']} "
            f"| {r['accepted'] or '-'} | {r['drafted'] or '-'} |"
        )
    if base is None:
        lines.append("\n(no base-model baseline: a full conversion's base is another model; pass --base)")
    auto = next((r for r in rows if r["variant"] == "self-spec auto"), None)
    not_fixed = ("causal", BASELINE, "self-spec auto", "self-spec auto trees")  # auto: chosen each step
    fixed = [r for r in rows if r["variant"] not in not_fixed]
    if auto is not None and fixed:
        best = max(fixed, key=lambda r: r["tok_s"])
        vs_base = f"{auto['tok_s'] / base:.2f}x the base model's generate, " if base else ""
        lines.append(
            f"\nauto: {vs_base}{auto['tok_s'] / causal:.2f}x causal tok/s, {auto['tok_s'] / best['tok_s']:.2f}x the "
            f"best fixed variant ({best['variant']}, {best['tok_s'] / causal:.2f}x causal)"
        )
        held = auto_vs_best_held_out(auto, fixed)
        if held is not None:
            ratio, picks = held
            chosen = ", ".join(f"{name} x{k}" for name, k in picks.most_common())
            lines.append(
                f"auto: {ratio:.2f}x a best fixed variant chosen on the other rounds (leave one round out; {chosen})"
            )
    return "\n".join(lines)


def auto_vs_best_held_out(auto: dict, fixed: list[dict]) -> tuple[float, Counter] | None:
    """auto's tok/s over a fixed variant's where, for each round, the fixed variant is the fastest on the
    other rounds and is timed on this one (None with fewer than two rounds). The best of several variants
    timed on the same rounds is the fastest partly by luck, so "auto vs the best fixed" on the rounds that
    picked it is biased against auto by that luck; a sweep's winner is chosen before it is used, and this
    is that."""
    n = len(auto["per_round"])
    if n < 2 or any(len(r["per_round"]) != n for r in fixed):
        return None
    auto_tok = auto_sec = best_tok = best_sec = 0.0
    picks: Counter = Counter()
    for held in range(n):
        elsewhere = [_speed_without(row, held) for row in fixed]
        best = fixed[elsewhere.index(max(elsewhere))]
        picks[best["variant"]] += 1
        auto_tok, auto_sec = auto_tok + auto["per_round"][held][0], auto_sec + auto["per_round"][held][1]
        best_tok, best_sec = best_tok + best["per_round"][held][0], best_sec + best["per_round"][held][1]
    return (auto_tok / auto_sec) / (best_tok / best_sec), picks


def _speed_without(row: dict, held: int) -> float:
    kept = [ts for i, ts in enumerate(row["per_round"]) if i != held]
    return sum(t for t, _ in kept) / sum(s for _, s in kept)


def main(argv=None) -> int:
    from bdcore.loading import serving_dtype

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="a block-diffusion checkpoint with a causal AR head (clean_causal: true)")
    p.add_argument("--heldout", required=True, help="chat JSONL or HumanEval-style prompts")
    p.add_argument("--limit", type=int, default=50, help="prompts (default 50)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--draft-len", type=int, default=None, help="self-spec N (default: the trained bd_size)")
    p.add_argument(
        "--draft-lens",
        type=lambda t: [int(x) for x in t.split(",") if x],
        default=[],
        help="also every fixed N in this comma list, in both layouts (e.g. 2,3,4,8)",
    )
    p.add_argument(
        "--trees",
        action="append",
        default=[],
        help="also self-spec with draft trees (greedy): auto adds 'self-spec auto trees' (auto with trees weighed); "
        "a shape (W1,W2,... or spine:W1,..., as serve.py --tree) adds it at --draft-len in both layouts; repeatable",
    )
    p.add_argument("--concurrency", type=int, default=1, help="requests in flight (batched scheduler; default 1)")
    p.add_argument(
        "--variants",
        type=variant_names,
        default=[],
        help="only these variants (comma list of names as the table prints them, e.g. 'self-spec auto,self-spec "
        "last N=3,self-spec last tree=2,2'); causal always runs (default: all)",
    )
    p.add_argument(
        "--dtype",
        choices=["auto", "fp32", "bf16"],
        default="auto",
        help="weights and activations (default auto: what serve.py loads, bf16 on a CPU with native bf16)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="cut the prompts into this many slices, each run by every variant in turn, so that a drift in "
        "the machine's speed is shared (default 5; fewer when the prompts do not fill that many slices of "
        "--concurrency)",
    )
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda[:i]")
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run the prompts this many times over (greedy: the same outputs; more timings where the held-out "
        "set is small; default 1)",
    )
    p.add_argument(
        "--base",
        type=Path,
        default=None,
        help="the base model the checkpoint was converted from, timed with transformers' generate as the "
        "baseline (default: the checkpoint itself when it is a draft adapter; a full conversion needs it)",
    )
    p.add_argument("--json", default=None, help="also write the rows here")
    p.add_argument(
        "--record",
        type=Path,
        default=None,
        help="also write the run as a results record (benchmark/record.py) for `python -m benchmark.report`",
    )
    args = p.parse_args(argv)
    if args.rounds is not None and args.rounds < 1:
        p.error("--rounds must be at least 1")
    if args.repeat < 1:
        p.error("--repeat must be at least 1")
    rounds = args.rounds or 5
    rows = measure(
        Path(args.checkpoint),
        Path(args.heldout),
        limit=args.limit,
        max_tokens=args.max_tokens,
        draft_len=args.draft_len,
        draft_lens=args.draft_lens,
        trees=args.trees,
        concurrency=args.concurrency,
        only=args.variants,
        dtype=args.dtype,
        rounds=rounds,
        repeat=args.repeat,
        device=args.device,
        base=args.base,
    )
    command = "python -m benchmark.self_spec_canvases " + " ".join(argv if argv is not None else sys.argv[1:])
    dtype = serving_dtype(args.dtype, args.device)
    print(f"{command}\n\n{dtype}, {rounds} interleaved rounds at most\n\n{table(rows)}")
    if args.json:
        Path(args.json).write_text(json.dumps({"command": command, "rows": rows}, indent=1))
    if args.record:
        from benchmark import record

        rows = [dict(r, concurrency=args.concurrency) for r in rows]
        title = f"{args.checkpoint}: self-spec layouts at concurrency {args.concurrency}, in process"
        about = dict(
            model=args.checkpoint,
            dtype=dtype,
            series=f"{args.checkpoint}, {dtype}, in process, {record.this_machine()}",
        )
        source = "written by benchmark.self_spec_canvases --record"
        made = record.make("speed", rows, title=title, command=command, source=source, **about)
        record.write(args.record, made)
    return 0


if __name__ == "__main__":
    sys.exit(main())
