#!/usr/bin/env python
"""Accuracy and speed of any OpenAI-compatible server (bdstack in any mode, SGLang, vLLM).

    python inference/eval.py gsm8k --base-url http://127.0.0.1:30000/v1 --num-problems 200
    python inference/eval.py mmlu_pro --data-file mmlu_pro.jsonl --shard 0/4 --out runs/eval/s0
    python inference/eval.py merge runs/eval/s0 runs/eval/s1 runs/eval/s2 runs/eval/s3 --out runs/eval/all

Writes requests.jsonl (one line per request) and summary.json to --out: accuracy, errors, wall time,
aggregate and per-request tok/s, latency mean/p50/p90/max, mean output tokens, share cut at
max_tokens, and tokens per forward from the server's `usage` (bdstack servers report it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

if __package__ in (None, ""):  # `python inference/X.py` from a checkout: the packages live in its root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inference.eval_tasks import TASKS, Problem, load_problems  # noqa: E402
from inference.server_defaults import SERVER  # noqa: E402


def ask(client, model, problem: Problem, args) -> dict:
    extra = {}
    if args.mode:
        extra["mode"] = args.mode
    if args.chat_template_kwargs:
        extra["chat_template_kwargs"] = json.loads(args.chat_template_kwargs)
    t0 = time.perf_counter()
    rec = {"id": problem.id, "reference": problem.reference}
    try:
        r = client.chat.completions.create(
            model=model,
            messages=problem.messages,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            extra_body=extra or None,
        )
        u = r.usage
        rec.update(
            output=r.choices[0].message.content or "",
            finish_reason=r.choices[0].finish_reason,
            prompt_tokens=u.prompt_tokens,
            completion_tokens=u.completion_tokens,
            forwards=(u.model_extra or {}).get("forwards"),
            error=None,
        )
    except Exception as e:  # counted, not fatal: one bad request must not lose the run
        rec.update(
            output="",
            finish_reason="error",
            prompt_tokens=0,
            completion_tokens=0,
            forwards=None,
            error=f"{type(e).__name__}: {e}",
        )
    rec["latency_s"] = time.perf_counter() - t0
    return rec


def summarize(task_name: str, records: list[dict], wall_s: float) -> dict:
    task = TASKS[task_name]
    ok = [r for r in records if r["error"] is None]
    lat = [r["latency_s"] for r in ok] or [0.0]
    tokens = sum(r["completion_tokens"] for r in ok)
    fwd = [r["forwards"] for r in ok if r.get("forwards")]
    dec = statistics.quantiles(lat, n=10) if len(lat) > 1 else lat * 9
    return {
        "task": task_name,
        "problems": len(records),
        "errors": len(records) - len(ok),
        **task.aggregate([r["score"] for r in records]),
        "wall_s": wall_s,
        "tok_s": tokens / wall_s if wall_s else 0.0,
        "tok_s_per_request": statistics.mean(r["completion_tokens"] / r["latency_s"] for r in ok) if ok else 0.0,
        "latency_mean_s": statistics.mean(lat),
        "latency_p50_s": statistics.median(lat),
        "latency_p90_s": dec[8],
        "latency_max_s": max(lat),
        "mean_output_tokens": tokens / len(ok) if ok else 0.0,
        "cut_at_max_tokens": sum(r["finish_reason"] == "length" for r in ok) / len(ok) if ok else 0.0,
        "tokens_per_forward": (sum(r["completion_tokens"] for r in ok if r.get("forwards")) / sum(fwd))
        if fwd
        else None,
    }


def run(args) -> dict:
    from openai import OpenAI
    from tqdm import tqdm

    task = TASKS[args.task]
    problems = load_problems(task, args.data_file)
    if args.num_problems:
        problems = problems[: args.num_problems]
    i, n = map(int, args.shard.split("/"))
    problems = problems[i::n]
    client = OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=1, timeout=args.timeout)
    model = args.model or client.models.list().data[0].id
    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.max_workers) as pool:
        records = list(
            tqdm(
                pool.map(lambda p: ask(client, model, p, args), problems),
                total=len(problems),
                desc=args.task,
                unit=" q",
                disable=args.quiet,
            )
        )
    wall = time.perf_counter() - t0
    for p, r in zip(problems, records):
        r["score"] = task.score(p, r["output"])
    return write(
        Path(args.out),
        args.task,
        records,
        wall,
        {"model": model, "base_url": args.base_url, "shard": args.shard, "mode": args.mode},
    )


def write(out: Path, task_name: str, records: list[dict], wall: float, info: dict) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "requests.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    summary = {**summarize(task_name, records, wall), **info}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def merge(dirs: list[str], out: str) -> dict:
    """Join shard directories; wall time is the longest shard's (shards run side by side)."""
    records, walls, tasks, infos = [], [], set(), []
    for d in dirs:
        s = json.loads(Path(d, "summary.json").read_text())
        tasks.add(s["task"])
        walls.append(s["wall_s"])
        infos.append(s)
        records += [json.loads(line) for line in open(Path(d, "requests.jsonl"))]
    if len(tasks) != 1:
        raise SystemExit(f"merge: shards are of different tasks {sorted(tasks)}")
    info = {
        "model": infos[0].get("model"),
        "base_url": infos[0].get("base_url"),
        "shard": f"merged {len(dirs)}",
        "mode": infos[0].get("mode"),
    }
    return write(Path(out), tasks.pop(), records, max(walls), info)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["merge"]:
        p = argparse.ArgumentParser(prog="eval.py merge", description="merge shard outputs")
        p.add_argument("dirs", nargs="+")
        p.add_argument("--out", required=True)
        a = p.parse_args(argv[1:])
        print(json.dumps(merge(a.dirs, a.out), indent=2))
        return 0
    p = argparse.ArgumentParser(
        prog="eval.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("task", choices=sorted(TASKS))
    p.add_argument("--base-url", default=os.environ.get("BDSTACK_BASE_URL", SERVER.base_url))
    p.add_argument("--api-key", default=os.environ.get("BDSTACK_API_KEY", "none"))
    p.add_argument("--model", default=None)
    p.add_argument("--data-file", default=None, help="local JSONL in the hub dataset's schema (offline runs)")
    p.add_argument("--num-problems", type=int, default=0, help="first N problems (0: all)")
    p.add_argument("--shard", default="0/1", help="I/N: every N-th problem starting at I")
    p.add_argument("--max-workers", type=int, default=4, help="concurrent requests")
    p.add_argument("--max-tokens", type=int, default=1024)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--mode", default=None, help="bdstack servers: decode mode per request")
    p.add_argument("--chat-template-kwargs", default=None, help="JSON, e.g. '{\"enable_thinking\": false}'")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--out", default="runs/eval")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    try:
        i, n = map(int, args.shard.split("/"))
        assert 0 <= i < n
    except (ValueError, AssertionError):
        raise SystemExit(f"eval.py: error: --shard {args.shard!r}: expected I/N with 0 <= I < N") from None
    s = run(args)
    print(json.dumps(s, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
