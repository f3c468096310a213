"""Decode modes side by side through the server: accuracy, tokens per forward, tok/s, latency.

    python -m benchmark.serving.bench_decode CKPT --prompts eval.jsonl [--num 100 --concurrency 1,4]
    python -m benchmark.serving.bench_decode --base-url http://127.0.0.1:30000/v1 --prompts eval.jsonl

Starts `inference/serve.py CKPT` (native engine) in a subprocess unless --base-url is given, then
sends the same chat requests in every mode (per-request `mode`), at each concurrency, in one run.
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
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


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


def run_mode(client, model, prompts, mode, concurrency, max_tokens) -> dict:
    def one(item):
        msgs, _ = item
        t0 = time.perf_counter()
        r = client.chat.completions.create(
            model=model, messages=msgs, max_tokens=max_tokens, temperature=0.0, extra_body={"mode": mode}
        )
        extra = r.usage.model_extra or {}
        return (
            r.choices[0].message.content,
            r.usage.completion_tokens,
            extra.get("forwards", 0),
            time.perf_counter() - t0,
        )

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, prompts))
    wall = time.perf_counter() - t0
    texts = [r[0] for r in results]
    tokens, forwards, lat = sum(r[1] for r in results), sum(r[2] for r in results), [r[3] for r in results]
    refs = [ref for _, ref in prompts]
    acc = (
        sum(t.strip() == ref for t, ref in zip(texts, refs)) / len(refs)
        if all(r is not None for r in refs)
        else float("nan")
    )
    q = statistics.quantiles(lat, n=10) if len(lat) > 1 else lat * 9
    return {
        "mode": mode,
        "concurrency": concurrency,
        "accuracy": acc,
        "texts": texts,
        "tokens_per_forward": tokens / forwards if forwards else float("nan"),
        "tok_s": tokens / wall,
        "tok_s_per_request": statistics.mean(r[1] / r[3] for r in results),
        "p50": statistics.median(lat),
        "p90": q[8],
        "tokens": tokens,
    }


def _baseline(args, prompts):
    """A function of the concurrency timing the base model's `generate` on `prompts` (a row like
    `run_mode`'s), or None when no base is known."""
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
    ids = [chat_ids(tok, msgs) for msgs, _ in prompts]
    device = torch.device(args.device)
    dtype = resolve_dtype(serving_dtype(args.dtype, device), device)
    params = SamplingParams(max_tokens=args.max_tokens)

    def measure(concurrency: int) -> dict:
        run = base_generator(directory, dtype=dtype, device=device, stop_ids=stop_ids(tok), concurrency=concurrency)
        run(ids[:concurrency], params)  # warm-up, not timed
        gens, wall = run(ids, params)
        texts = [tok.decode(g.tokens, skip_special_tokens=True) for g in gens]
        refs = [ref for _, ref in prompts]
        acc = sum(t.strip() == r for t, r in zip(texts, refs)) / len(refs) if all(refs) else float("nan")
        tokens = sum(g.stats.generated for g in gens)
        return {
            "mode": "base generate",
            "concurrency": concurrency,
            "accuracy": acc,
            "texts": texts,
            "tokens_per_forward": 1.0,
            "tok_s": tokens / wall,
            "tok_s_per_request": float("nan"),  # whole groups are timed, not requests
            "p50": float("nan"),
            "p90": float("nan"),
            "tokens": tokens,
        }

    return measure


def _in_process(args, prompts):
    """A function of (mode, concurrency) timing the same requests on the native engine in this process: one
    at a time with `Engine.generate`, or `concurrency` in flight on its batched scheduler, as the server
    runs them. Returns tok/s."""
    from transformers import AutoTokenizer

    from bdcore.chat import chat_ids
    from bdcore.decode.config import DecodeConfig
    from bdcore.decode.sampling import SamplingParams
    from bdcore.loading import load_checkpoint, serving_dtype
    from benchmark.self_spec_canvases import _generator
    from inference.native.engine import Engine

    loaded = load_checkpoint(args.checkpoint, device=args.device, dtype=serving_dtype(args.dtype, args.device))
    tok = AutoTokenizer.from_pretrained(args.checkpoint)
    ids = [chat_ids(tok, msgs) for msgs, _ in prompts]
    params = SamplingParams(max_tokens=args.max_tokens)
    engines: dict[str, Engine] = {}

    def measure(mode: str, concurrency: int) -> float:
        engine = engines.setdefault(mode, Engine(loaded, DecodeConfig(mode=mode)))
        run = _generator(engine, concurrency)
        run(ids[:concurrency], params)  # warm-up, not timed
        gens, wall = run(ids, params)
        return sum(g.stats.generated for g in gens) / wall

    return measure


def main(argv=None) -> int:
    from openai import OpenAI

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", nargs="?", help="checkpoint to serve (omit with --base-url)")
    p.add_argument("--base-url", default=None)
    p.add_argument("--api-key", default="none")
    p.add_argument("--prompts", required=True, help="chat JSONL")
    p.add_argument("--num", type=int, default=50)
    p.add_argument("--modes", default="causal,diffusion,self-spec")
    p.add_argument("--concurrency", default="1,4")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--json", default=None, help="also write the results here")
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
        "mode) and print the server's tok/s over it, for the same requests",
    )
    args = p.parse_args(argv)
    if not args.base_url and not args.checkpoint:
        raise SystemExit("give a checkpoint to serve or --base-url of a running server")
    if args.in_process and not args.checkpoint:
        raise SystemExit("--in-process loads the checkpoint here: give it (with --base-url too)")

    proc = None
    base_url = args.base_url
    if base_url is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        extra = ["--dtype", args.dtype, "--device", args.device, *args.server_args.split()]
        proc = start_server(args.checkpoint, port, extra)
        base_url = f"http://127.0.0.1:{port}/v1"
    try:
        client = OpenAI(base_url=base_url, api_key=args.api_key, max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        prompts = load_prompts(args.prompts, args.num)
        baseline = _baseline(args, prompts)
        in_process = _in_process(args, prompts) if args.in_process else None
        rows = []
        for conc in map(int, args.concurrency.split(",")):
            causal, base = None, baseline(conc) if baseline else None
            for r in [base] if base else []:
                rows.append(r)
            for mode in args.modes.split(","):
                r = run_mode(client, model, prompts, mode, conc, args.max_tokens)
                causal = r if mode == "causal" else causal
                if in_process is not None:  # right after the server, on the same requests
                    r["in_process_tok_s"] = in_process(mode, conc)
                rows.append(r)
            for r in rows[-len(args.modes.split(",")) - bool(base) :]:
                r["same_as_causal"] = (
                    sum(a == b for a, b in zip(r["texts"], causal["texts"])) / len(prompts) if causal else float("nan")
                )
                r["speedup"] = r["tok_s"] / causal["tok_s"] if causal else float("nan")
                r["vs_base"] = r["tok_s"] / base["tok_s"] if base else float("nan")
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
    print(f"{len(prompts)} prompts, max_tokens {args.max_tokens}, greedy")
    if not baseline:
        print("(no base-model baseline: give --base, the model this checkpoint was converted from)")
    print(
        "| mode | conc | accuracy | same as causal | tokens/forward | tok/s | tok/s vs base generate | "
        "tok/s vs causal | tok/s per request | p50 s | p90 s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['mode']} | {r['concurrency']} | {r['accuracy']:.1%} | {r['same_as_causal']:.0%} | "
            f"{r['tokens_per_forward']:.2f} | {r['tok_s']:.1f} | {r['vs_base']:.2f}x | {r['speedup']:.2f}x | "
            f"{r['tok_s_per_request']:.1f} | {r['p50']:.3f} | {r['p90']:.3f} |"
        )
    if in_process is not None:
        print("\n| mode | conc | server tok/s | in-process tok/s | server / in-process |\n|---|---|---|---|---|")
        for r in rows:
            if "in_process_tok_s" in r:
                ratio = r["tok_s"] / r["in_process_tok_s"]
                print(
                    f"| {r['mode']} | {r['concurrency']} | {r['tok_s']:.1f} | {r['in_process_tok_s']:.1f} "
                    f"| {ratio:.2f}x |"
                )
    if args.json:
        Path(args.json).write_text(json.dumps([{k: v for k, v in r.items() if k != "texts"} for r in rows], indent=2))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
