"""Decode modes side by side through the server: accuracy, tokens per forward, tok/s, latency.

    python -m benchmark.serving.bench_decode CKPT --prompts eval.jsonl [--num 100 --concurrency 1,4]
    python -m benchmark.serving.bench_decode --base-url http://127.0.0.1:30000/v1 --prompts eval.jsonl

Starts `inference/serve.py CKPT` (native engine) in a subprocess unless --base-url is given, then
sends the same chat requests in every mode (per-request `mode`), at each concurrency, in one run, in
interleaved rounds (`--rounds`, benchmark/interleave.py): each slice of the requests is run by every mode and
the baseline in turn, so a drift of the machine's speed falls on all alike; the table gives each ratio to
causal's range over the rounds. `--record PATH` also writes the run for `python -m benchmark.report`.
Prompts are chat JSONL lines (`messages`); when the last message is the assistant's, it is the
reference answer and accuracy (exact match after strip) is reported. "same" is the share of outputs
identical to causal mode's for the same prompt.

The speed baseline is the base model decoded by `transformers` `generate` in this process on the same
prompts (rendered by the same chat template), at each concurrency (`concurrency` prompts per call,
left-padded), while the server idles: the first row of each concurrency, and every tok/s is given against
it as well as against causal mode. A draft-adapter checkpoint is its own base; a full conversion needs
`--base` (without it, and with `--base-url`, the baseline is left out and the table says so).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BASELINE = "base generate"  # the base model decoded by transformers' generate (benchmark/base_generate.py)
IN_PROCESS = " in process"  # a mode's name + this: the same mode on the engine in this process


def load_prompts(path: str, num: int) -> list[tuple[list[dict], str | None]]:
    rows = []
    for line in open(path):
        msgs = json.loads(line)["messages"]
        ref = msgs[-1]["content"] if msgs[-1]["role"] == "assistant" else None
        rows.append((msgs[:-1] if ref is not None else msgs, ref))
        if len(rows) == num:
            break
    return rows


def start_server(ckpt: str, port: int, extra: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, str(REPO / "inference" / "serve.py"), ckpt, "--mode", "causal", "--port", str(port), *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    for _ in range(600):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            return proc
        except OSError:
            if proc.poll() is not None:
                raise SystemExit(f"server exited: {proc.stderr.read()[-2000:]}") from None
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("server did not come up in 120 s")


@dataclass
class Reply:
    """One answer as every runner reports it: the text, its tokens and forwards, and the request's latency
    (NaN where whole groups are timed, as `generate` on several prompts)."""

    text: str
    tokens: int
    forwards: int
    seconds: float
    verify_steps: int = 0  # self-spec's draft-verify cycles and the drafts they accepted (the server's usage)
    accepted_drafts: int = 0


def server_runner(client, model, mode: str, concurrency: int, max_tokens: int):
    """A function sending a list of (messages, reference) items to the server in `mode`, `concurrency` in
    flight, returning (Replies, wall seconds): one variant of the interleaved rounds."""

    def one(item) -> Reply:
        msgs, _ = item
        t0 = time.perf_counter()
        r = client.chat.completions.create(
            model=model, messages=msgs, max_tokens=max_tokens, temperature=0.0, extra_body={"mode": mode}
        )
        extra = r.usage.model_extra or {}
        seconds = time.perf_counter() - t0
        steps, accepted = extra.get("verify_steps", 0), extra.get("accepted_drafts", 0)
        return Reply(
            r.choices[0].message.content, r.usage.completion_tokens, extra.get("forwards", 0), seconds, steps, accepted
        )

    def run(items):
        t0 = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            replies = list(pool.map(one, items))
        return replies, time.perf_counter() - t0

    return run


def summarize(mode: str, label: str, concurrency: int, replies: list[Reply], wall: float, refs: list) -> dict:
    """A table row from one variant's replies over all rounds."""
    tokens, forwards = sum(r.tokens for r in replies), sum(r.forwards for r in replies)
    steps = sum(r.verify_steps for r in replies)
    acc = (
        sum(r.text.strip() == ref for r, ref in zip(replies, refs)) / len(refs)
        if all(ref is not None for ref in refs)
        else float("nan")
    )
    lat = [r.seconds for r in replies]
    timed = not any(math.isnan(x) for x in lat)
    q = statistics.quantiles(lat, n=10) if len(lat) > 1 else lat * 9
    return {
        "mode": mode,
        "variant": label,
        "concurrency": concurrency,
        "accuracy": acc,
        "texts": [r.text for r in replies],
        "tokens_per_forward": tokens / forwards if forwards else float("nan"),
        # the field's acceptance length: tokens per draft-verify cycle, the verifier's token included
        "acceptance_length": 1 + sum(r.accepted_drafts for r in replies) / steps if steps else float("nan"),
        "tok_s": tokens / wall,
        "tok_s_per_request": statistics.mean(r.tokens / r.seconds for r in replies) if timed else float("nan"),
        "p50": statistics.median(lat) if timed else float("nan"),
        "p90": q[8] if timed else float("nan"),
        "tokens": tokens,
    }


def variant_name(mode: str, server_args: str) -> str:
    """The mode as the table names it: the native server's self-spec drafts `auto` unless told otherwise."""
    fixed = any(flag in server_args.split() for flag in ("--draft-len", "--self-spec-canvases", "--backend"))
    return "self-spec auto" if mode == "self-spec" and not fixed else mode


def _baseline(args, prompts):
    """A function of the concurrency giving a runner of the base model's `generate` on (messages, reference)
    items (warmed up), or None when no base is known."""
    from benchmark.base_generate import base_generator, base_model_dir

    if args.checkpoint is None and args.base is None:
        return None
    directory = base_model_dir(Path(args.checkpoint), None) if args.base is None else Path(args.base)
    if directory is None:
        return None
    import torch
    from transformers import AutoTokenizer

    from bdcore.chat import chat_ids
    from bdcore.decode.sampling import SamplingParams
    from bdcore.loading import resolve_dtype, serving_dtype
    from bdcore.tokens import stop_ids

    tok = AutoTokenizer.from_pretrained(args.checkpoint or directory)
    device = torch.device(args.device)
    dtype = resolve_dtype(serving_dtype(args.dtype, device), device)
    params = SamplingParams(max_tokens=args.max_tokens)

    def runner(concurrency: int):
        gen = base_generator(directory, dtype=dtype, device=device, stop_ids=stop_ids(tok), concurrency=concurrency)

        def run(items):
            gens, wall = gen([chat_ids(tok, msgs) for msgs, _ in items], params)
            texts = [tok.decode(g.tokens, skip_special_tokens=True) for g in gens]
            counts = [g.stats.generated for g in gens]  # one token per forward
            return [Reply(t, n, n, float("nan")) for t, n in zip(texts, counts)], wall

        run(prompts[:concurrency])  # warm-up, not timed
        return run

    return runner


def _in_process(args):
    """A function of (mode, concurrency) giving a runner of the same requests on the native engine in this
    process (warmed up): one at a time with `Engine.generate`, or `concurrency` in flight on its batched
    scheduler, as the server runs them, with the server's decode settings (its defaults and `--server-args`,
    the request's mode: self-spec chooses its layout each step, trees included)."""
    from dataclasses import replace

    from transformers import AutoTokenizer

    from bdcore.chat import chat_ids
    from bdcore.decode.sampling import SamplingParams
    from bdcore.loading import load_checkpoint, serving_dtype
    from benchmark.self_spec_canvases import _generator
    from inference.native.engine import Engine
    from inference.serve import build_parser, native_decode

    server = native_decode(build_parser().parse_args([args.checkpoint, *args.server_args.split()]))
    loaded = load_checkpoint(args.checkpoint, device=args.device, dtype=serving_dtype(args.dtype, args.device))
    tok = AutoTokenizer.from_pretrained(args.checkpoint)
    params = SamplingParams(max_tokens=args.max_tokens)
    engines: dict[str, Engine] = {}

    def runner(mode: str, concurrency: int, warm_up: list):
        if mode not in engines:  # one engine a mode, for every concurrency
            engines[mode] = Engine(loaded, replace(server, mode=mode))
        gen = _generator(engines[mode], concurrency)

        def run(items):
            gens, wall = gen([chat_ids(tok, msgs) for msgs, _ in items], params)
            return [
                Reply(
                    "", g.stats.generated, g.stats.forwards, float("nan"), g.stats.verify_steps, g.stats.accepted_drafts
                )
                for g in gens
            ], wall

        run(warm_up)  # warm-up, not timed
        return run

    return runner


def main(argv=None) -> int:
    from openai import OpenAI

    from benchmark.interleave import run_interleaved

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", nargs="?", help="checkpoint to serve (omit with --base-url)")
    p.add_argument("--base-url", default=None)
    p.add_argument("--api-key", default="none")
    p.add_argument("--prompts", required=True, help="chat JSONL")
    p.add_argument("--num", type=int, default=50)
    p.add_argument("--modes", default="causal,diffusion,self-spec")
    p.add_argument("--concurrency", default="1,4")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="cut the requests into this many slices, each run by every mode (and the baseline) in turn, so a "
        "drift of the machine's speed is shared (benchmark/interleave.py; default 5)",
    )
    p.add_argument("--repeat", type=int, default=1, help="send the prompts this many times over (default 1)")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument(
        "--record",
        type=Path,
        default=None,
        help="also write a results record (benchmark/record.py) for benchmark.report",
    )
    p.add_argument("--server-args", default="", help="extra serve.py flags, e.g. '--threshold 0.8'")
    p.add_argument(
        "--base",
        default=None,
        help="the base model the checkpoint was converted from: its transformers generate is the baseline "
        "(default: the checkpoint itself when it is a draft adapter)",
    )
    p.add_argument(
        "--dtype",
        choices=["auto", "fp32", "bf16"],
        default="auto",
        help="the server's, the baseline's and the in-process engine's dtype (default auto: bf16 on a GPU and on a "
        "CPU with native bf16)",
    )
    p.add_argument("--device", default="cpu", help="the server's, the baseline's and the in-process engine's device")
    p.add_argument(
        "--in-process",
        action="store_true",
        help="also run every mode on the native engine in this process (the engine's default settings for the "
        "mode), in the same rounds, and print the server's tok/s over it, for the same requests",
    )
    args = p.parse_args(argv)
    if not args.base_url and not args.checkpoint:
        raise SystemExit("give a checkpoint to serve or --base-url of a running server")
    if args.in_process and not args.checkpoint:
        raise SystemExit("--in-process loads the checkpoint here: give it (with --base-url too)")
    if args.rounds < 1 or args.repeat < 1:
        p.error("--rounds and --repeat must be at least 1")

    proc = None
    base_url = args.base_url
    if base_url is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        extra = ["--dtype", args.dtype, "--device", args.device, *args.server_args.split()]
        proc = start_server(args.checkpoint, port, extra)
        base_url = f"http://127.0.0.1:{port}/v1"
    modes = args.modes.split(",")
    try:
        client = OpenAI(base_url=base_url, api_key=args.api_key, max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        prompts = load_prompts(args.prompts, args.num)
        items = prompts * args.repeat
        refs = [ref for _, ref in items]
        baseline = _baseline(args, prompts)
        in_process = _in_process(args) if args.in_process else None
        rows = []
        for conc in map(int, args.concurrency.split(",")):
            runners = {BASELINE: baseline(conc)} if baseline else {}
            for mode in modes:
                runners[mode] = server_runner(client, model, mode, conc, args.max_tokens)
                runners[mode](items[:conc])  # warm-up, not timed
                if in_process is not None:  # in the same rounds, on the same requests
                    runners[f"{mode}{IN_PROCESS}"] = in_process(mode, conc, items[:conc])
            got = run_interleaved(runners, items, rounds=args.rounds, concurrency=conc, tokens=lambda r: r.tokens)
            group = []
            for name in [BASELINE] * bool(baseline) + modes:
                label = name if name == BASELINE else variant_name(name, args.server_args)
                r = summarize(name, label, conc, got.outputs[name], got.seconds[name], refs)
                if in_process is not None and name != BASELINE:
                    r["in_process_tok_s"] = got.tok_s(f"{name}{IN_PROCESS}")
                if "causal" in modes:
                    r["vs_causal_by_round"] = got.round_ratios(name, "causal")
                group.append(r)
            causal = next((r for r in group if r["mode"] == "causal"), None)
            base = group[0] if baseline else None
            for r in group:
                r["same_as_causal"] = (
                    sum(a == b for a, b in zip(r["texts"], causal["texts"])) / len(items) if causal else float("nan")
                )
                r["speedup"] = r["tok_s"] / causal["tok_s"] if causal else float("nan")
                r["vs_base"] = r["tok_s"] / base["tok_s"] if base else float("nan")
            rows += group
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
    print(table(rows, args, len(items), bool(baseline)))
    if args.json:
        Path(args.json).write_text(json.dumps([{k: v for k, v in r.items() if k != "texts"} for r in rows], indent=2))
    if args.record:
        write_record(args, argv, rows)
    return 0


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


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
