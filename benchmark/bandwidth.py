"""The physical limit of one-request decoding: memory bandwidth over the bytes a decode step reads per token.

    python -m benchmark.bandwidth runs/smollm2/base --dtype bf16 --threads 1 --tok-s native=21.4 --json bw.json

A decode step at one request produces one token from a forward of one row: every weight of the model is
read from memory once, and there is too little arithmetic per byte for the cores to be the limit. So no
engine can decode faster than (memory read bandwidth) / (bytes read per token), and an engine's measured
tok/s at one request as a fraction of that ceiling says how much of the machine it uses.

The bandwidth is measured with torch, at `--threads` threads (default torch's): `sum` of an fp32 buffer of
`--size` MiB (default 1024, far above a last-level cache, which would otherwise serve repeats from the cache),
best and median of `--repeats`, after one warm-up pass; and a `copy_` of it to a second buffer (read + write,
shown beside it; the ceiling uses the read figure).

The bytes per token are counted from config.json and the safetensors headers, without loading the model, at
the dtype the model is served in (`--dtype`; auto: what the native server picks on this CPU): every weight
read once, except the input embedding, of which only the looked-up row is read; the output layer is read
whole once (for a tied model, that is the embedding matrix). A mixture of experts' expert weights count at
(experts per token) / (experts). Vision-tower and multi-token-prediction weights, which text decoding never
runs, are left out. Then the cache at `--context` tokens: keys and values of each full-attention layer
(sliding-window layers up to their window), and each gated-delta layer's recurrent state (fp32) and
convolution window. A draft adapter's weights are not counted: causal decoding runs no drafting row.

`--tok-s NAME=VALUE` (repeatable) gives an engine's measured decode tok/s at one request; each is printed as a
fraction of the ceiling.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# Safetensors dtypes of floating weights: the served dtype replaces them; other tensors keep their size.
FLOAT_TENSOR_DTYPES = {"F64", "F32", "F16", "BF16"}
TENSOR_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
EMBEDDING_NAMES = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight")
OUTPUT_NAMES = ("lm_head.weight",)
# Weights of a checkpoint that text decoding never runs (a vision tower, multi-token prediction heads).
NOT_DECODED = ("visual.", "vision_tower.", "vision_model.", "mtp.")


class BandwidthError(ValueError):
    """Bad input to the benchmark, said in one line."""


def parse_tok_s(items: list[str]) -> dict[str, float]:
    """`NAME=VALUE` pairs -> {name: tok/s}; a malformed one raises BandwidthError naming it."""
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        try:
            number = float(value)
        except ValueError:
            number = None
        if not sep or not name or number is None or not number > 0 or number == float("inf"):
            raise BandwidthError(f"--tok-s {item!r}: give NAME=VALUE with VALUE a positive tok/s, e.g. native=21.4")
        if name in out:
            raise BandwidthError(f"--tok-s {item!r}: {name} given twice")
        out[name] = number
    return out


def last_level_cache_bytes() -> int | None:
    """The largest CPU cache Linux reports for cpu0 (None where it reports none)."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip()
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        try:
            sizes.append(int(text.rstrip("KMG")) * scale)
        except ValueError:
            continue
    return max(sizes) if sizes else None


def measure_bandwidth(size_mib: int, repeats: int, threads: int | None = None) -> dict:
    """Read (`sum`) and copy GB/s of an fp32 buffer of `size_mib` MiB: best, median and every run."""
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
    nbytes = size_mib * 2**20
    src = torch.ones(nbytes // 4, dtype=torch.float32)  # written, so every page is mapped before timing
    dst = torch.zeros_like(src)
    src.sum(), dst.copy_(src)  # warm-up

    def timed(fn) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    reads, copies = [], []
    for _ in range(repeats):
        reads.append(nbytes / timed(src.sum) / 1e9)
        copies.append(2 * nbytes / timed(lambda: dst.copy_(src)) / 1e9)

    def summary(runs):
        return {"best": max(runs), "median": statistics.median(runs), "runs": runs}

    return {
        "threads": torch.get_num_threads(),
        "size_mib": size_mib,
        "repeats": repeats,
        "read_gb_s": summary(reads),
        "copy_gb_s": summary(copies),
    }


def _tensors(path: Path) -> dict[str, dict]:
    from bdcore.checkpoint_files import safetensors_header, weight_files

    tensors = {}
    for file in weight_files(path):
        tensors.update({n: e for n, e in safetensors_header(file).items() if n != "__metadata__"})
    if not tensors:
        raise BandwidthError(f"{path} holds no *.safetensors weights")
    return tensors


def _elements(entry: dict) -> int:
    n = 1
    for d in entry["shape"]:
        n *= d
    return n


def bytes_per_token(checkpoint: str | Path, dtype: str, context: int) -> dict:
    """The bytes one decode step at one request reads per token, by part (see the module's docstring)."""
    from bdcore.checkpoint_files import CheckpointError, check_model_dir, config_value

    path = Path(checkpoint)
    try:
        config = check_model_dir(path)
    except CheckpointError as e:
        raise BandwidthError(str(e)) from e
    per = DTYPE_BYTES[dtype]
    tensors = _tensors(path)
    experts = config_value(config, "num_experts") or config_value(config, "num_local_experts")
    chosen = config_value(config, "num_experts_per_tok")

    def size(entry) -> float:
        kind = entry["dtype"]
        return _elements(entry) * (per if kind in FLOAT_TENSOR_DTYPES else TENSOR_BYTES.get(kind, 1))

    weights = embedding_rows = output = 0.0
    embedding = next((e for n, e in tensors.items() if n.endswith(EMBEDDING_NAMES)), None)
    head = next((e for n, e in tensors.items() if n.endswith(OUTPUT_NAMES)), None)
    tied = head is None
    for name, entry in tensors.items():
        if any(part in name for part in NOT_DECODED) or name.endswith(EMBEDDING_NAMES + OUTPUT_NAMES):
            continue
        share = chosen / experts if experts and chosen and ".experts." in name else 1.0
        weights += share * size(entry)
    if embedding is not None:  # one row of [vocab, hidden] looked up
        embedding_rows = size(embedding) / embedding["shape"][0]
    if head is not None or embedding is not None:
        output = size(head if head is not None else embedding)

    layers = config_value(config, "num_hidden_layers")
    layer_types = config_value(config, "layer_types") or ["full_attention"] * layers
    heads = config_value(config, "num_attention_heads")
    kv_heads = config_value(config, "num_key_value_heads") or heads
    head_dim = config_value(config, "head_dim") or config_value(config, "hidden_size") // heads
    window = config_value(config, "sliding_window")
    kv = state = 0.0
    for kind in layer_types:
        if kind == "linear_attention":
            v_heads = config_value(config, "linear_num_value_heads")
            k_dim, v_dim = config_value(config, "linear_key_head_dim"), config_value(config, "linear_value_head_dim")
            conv_dim = 2 * config_value(config, "linear_num_key_heads") * k_dim + v_heads * v_dim
            state += v_heads * k_dim * v_dim * 4 + (config_value(config, "linear_conv_kernel_dim") - 1) * conv_dim * per
        else:
            tokens = min(context, window) if kind == "sliding_attention" and window else context
            kv += 2 * kv_heads * head_dim * tokens * per
    parts = {
        "weights": weights,
        "embedding_rows": embedding_rows,
        "output_head": output,
        "kv_cache": kv,
        "recurrent_state": state,
    }
    parts = {name: round(n) for name, n in parts.items()}  # bytes; only an expert share is fractional
    return {
        "checkpoint": str(path),
        "dtype": dtype,
        "context": context,
        "tied": tied,
        **parts,
        "total": sum(parts.values()),
    }


def ceiling_tok_s(bandwidth_gb_s: float, nbytes: float) -> float:
    """The most tokens per second a machine reading `bandwidth_gb_s` GB/s can decode at `nbytes` per token."""
    return bandwidth_gb_s * 1e9 / nbytes


def fractions(tok_s: dict[str, float], ceiling: float) -> dict[str, float]:
    return {name: value / ceiling for name, value in tok_s.items()}


def _mb(n: float) -> str:
    return f"{n / 1e6:,.3f}"


def report(bw: dict, counted: dict, tok_s: dict[str, float], command: str) -> tuple[str, dict]:
    read, copy = bw["read_gb_s"], bw["copy_gb_s"]
    best = ceiling_tok_s(read["best"], counted["total"])
    median = ceiling_tok_s(read["median"], counted["total"])
    threads = f"{bw['threads']} thread{'s' if bw['threads'] != 1 else ''}"
    head = "output head (tied: the embedding matrix, whole)" if counted["tied"] else "output head (lm_head, whole)"
    lines = [
        command,
        "",
        f"memory read: sum of a {bw['size_mib']} MiB fp32 buffer, {threads}, {bw['repeats']} repeats: "
        f"best {read['best']:.2f} GB/s, median {read['median']:.2f} GB/s",
        f"copy (read + write): best {copy['best']:.2f} GB/s, median {copy['median']:.2f} GB/s",
        "",
        f"bytes a decode step reads per token: {counted['checkpoint']} at {counted['dtype']}, "
        f"context {counted['context']}",
        "",
        "| part | MB |",
        "|---|---|",
        f"| weights (every layer, read once) | {_mb(counted['weights'])} |",
        f"| embedding row looked up | {_mb(counted['embedding_rows'])} |",
        f"| {head} | {_mb(counted['output_head'])} |",
        f"| KV cache at {counted['context']} tokens | {_mb(counted['kv_cache'])} |",
    ]
    if counted["recurrent_state"]:
        lines.append(f"| gated-delta state | {_mb(counted['recurrent_state'])} |")
    lines += [
        f"| total | {_mb(counted['total'])} |",
        "",
        f"ceiling: {best:.1f} tok/s at the best read bandwidth ({median:.1f} at the median)",
    ]
    shares = fractions(tok_s, best)
    if tok_s:
        lines += ["", "| engine | tok/s | of the ceiling |", "|---|---|---|"]
        lines += [f"| {n} | {v:g} | {100 * shares[n]:.1f}% |" for n, v in tok_s.items()]
    record = {
        "command": command,
        "bandwidth": bw,
        "bytes_per_token": counted,
        "ceiling_tok_s": {"best": best, "median": median},
        "tok_s": {n: {"tok_s": v, "fraction_of_ceiling": shares[n]} for n, v in tok_s.items()},
    }
    return "\n".join(lines), record


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmark.bandwidth", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("checkpoint")
    p.add_argument(
        "--dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"], help="served dtype (default auto)"
    )
    p.add_argument("--context", type=int, default=256, help="tokens in the cache each step reads (default 256)")
    p.add_argument("--threads", type=int, default=None, help="threads of the bandwidth measurement (default torch's)")
    p.add_argument("--size", type=int, default=1024, help="MiB of the measured buffer (default 1024)")
    p.add_argument("--repeats", type=int, default=10, help="timed passes over the buffer (default 10)")
    p.add_argument("--tok-s", action="append", default=[], metavar="NAME=VALUE", help="an engine's decode tok/s")
    p.add_argument("--json", default=None, help="also write the numbers here")
    args = p.parse_args(argv)
    try:
        for flag, value in (("--context", args.context), ("--size", args.size), ("--repeats", args.repeats)):
            if value < 1:
                raise BandwidthError(f"{flag} {value}: give at least 1")
        if args.threads is not None and args.threads < 1:
            raise BandwidthError(f"--threads {args.threads}: give at least 1")
        tok_s = parse_tok_s(args.tok_s)
        dtype = args.dtype
        if dtype == "auto":
            from bdcore.loading import serving_dtype

            dtype = serving_dtype("auto", "cpu")
        counted = bytes_per_token(args.checkpoint, dtype, args.context)
    except BandwidthError as e:  # one line, not a traceback
        print(f"benchmark.bandwidth: {e}", file=sys.stderr)
        return 2
    cache = last_level_cache_bytes()
    if cache and args.size * 2**20 < 4 * cache:
        note = f"note: --size {args.size} MiB is under 4x the {cache / 2**20:g} MiB cache: the figure is the cache's"
        print(note, file=sys.stderr)
    bw = measure_bandwidth(args.size, args.repeats, args.threads)
    command = "python -m benchmark.bandwidth " + " ".join(argv if argv is not None else sys.argv[1:])
    text, record = report(bw, counted, tok_s, command)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
