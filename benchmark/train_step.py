"""Block-diffusion training step vs plain AR SFT step on the same samples and model.

    python -m benchmark.train_step [--layers 4 --hidden 256 --prompt 96 --response 160 ...]

Both steps run forward + backward + AdamW on the same packed rows of the same tiny Qwen3 model;
the AR step sees the clean stream only (L tokens per sample), the block-diffusion step the
two-stream row (L + V * n tokens). Prints the median step time of each, their ratio next to the
token ratio, and each mode's peak memory (CUDA: max allocated; CPU: peak RSS growth of a fresh
process running only that mode). `--bf16` adds the block-diffusion step with bf16 compute (autocast;
fp32 weights and optimizer, as `train.py --dtype bf16`) and prints its speed-up over fp32.
"""

from __future__ import annotations

import argparse
import copy
import json
import multiprocessing as mp
import random
import resource
import statistics
import time

import torch


def _build(args):
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

    from train.rows import Sample

    torch.manual_seed(0)
    moe = dict(num_experts=args.experts, num_experts_per_tok=2, moe_intermediate_size=args.hidden)
    cfg = (Qwen3MoeConfig if args.arch == "qwen3_moe" else Qwen3Config)(
        **(moe if args.arch == "qwen3_moe" else {}),
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 3,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 32,
        num_key_value_heads=max(1, args.hidden // 64),
        head_dim=32,
        max_position_embeddings=4096,
    )
    attn = "sdpa" if args.device == "cpu" else "flex_attention"
    model = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=attn).to(args.device)
    rng = random.Random(0)
    rows = []
    for _ in range(args.rows):
        row = []
        for _ in range(args.docs_per_row):
            p, n = args.prompt, args.response
            ids = [rng.randrange(3, args.vocab - 2) for _ in range(p + n)]
            row.append(Sample(ids, [(p, p + n)]))
        rows.append(row)
    return model, rows


def _run_mode(args, mode: str) -> dict:
    from train.config import BlockDiffusionConfig
    from train.model import TwoStreamLM
    from train.noise import noise_generator
    from train.rows import SpecialIds, build_batch

    model, rows = _build(args)
    bf16 = mode == "bd_bf16"
    if mode == "ar":
        cfg = BlockDiffusionConfig(bd_size=args.bd_size, views=0, ar_loss_weight=1.0)
    else:
        cfg = BlockDiffusionConfig(bd_size=args.bd_size, views=2, ar_loss_weight=args.ar_loss_weight)
    ids = SpecialIds(mask_id=args.vocab - 1, filler_id=0)
    # a mixture of experts trains with its router's load-balancing loss, as train.py does by default
    lm = TwoStreamLM(model, cfg, router_aux_coef=getattr(model.config, "router_aux_loss_coef", 0.0) or 0.0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    cuda = args.device.startswith("cuda")
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    tokens = ar_rows = diff_rows = 0
    for step in range(args.warmup + args.steps):
        batch = build_batch(rows, cfg, ids, noise_generator(0, 0, step)).to(args.device)
        tokens = batch.num_real_tokens
        # supervised rows: what the step's losses read (the AR head's and the noised views')
        ar_rows, diff_rows = batch.ar_index.numel(), batch.diff_index.numel()
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast(device_type="cuda" if cuda else "cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = lm(batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
    if cuda:
        peak = torch.cuda.max_memory_allocated() / 2**20
    else:
        peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024  # KiB -> MiB
    params = sum(p.numel() for p in model.parameters())
    return {
        "mode": mode,
        "median_s": statistics.median(times),
        "tokens": tokens,
        "ar_rows": ar_rows,
        "diff_rows": diff_rows,
        "peak_mib": peak,
        "params": params,
    }


def _worker(args, mode, queue):
    torch.set_num_threads(args.threads) if args.threads else None
    queue.put(_run_mode(args, mode))


def measure(args) -> list[dict]:
    """Each mode in its own fresh process, so peak-memory figures do not bleed into each other."""
    ctx = mp.get_context("spawn")
    results = []
    for mode in ("ar", "bd", "bd_bf16") if args.bf16 else ("ar", "bd"):
        queue = ctx.Queue()
        proc = ctx.Process(target=_worker, args=(args, mode, queue))
        proc.start()
        results.append(queue.get())
        proc.join()
    return results


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument(
        "--arch",
        choices=["qwen3", "qwen3_moe"],
        default="qwen3",
        help="qwen3_moe: every MLP a mixture of --experts experts (2 per token, each of width --hidden)",
    )
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--prompt", type=int, default=96, help="prompt tokens per sample")
    p.add_argument("--response", type=int, default=160, help="response tokens per sample")
    p.add_argument("--docs_per_row", type=int, default=2)
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--bd_size", type=int, default=32)
    p.add_argument("--ar_loss_weight", type=float, default=0.2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=0, help="torch threads per process (0: torch default)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", action="store_true", help="print one JSON line instead of the table")
    p.add_argument("--bf16", action="store_true", help="also time the block-diffusion step with bf16 compute")
    args = p.parse_args(argv)

    ar, bd, *half = measure(args)
    summary = {
        "ar_step_s": ar["median_s"],
        "bd_step_s": bd["median_s"],
        "time_ratio": bd["median_s"] / ar["median_s"],
        "token_ratio": bd["tokens"] / ar["tokens"],
        "ar_tokens": ar["tokens"],
        "bd_tokens": bd["tokens"],
        # per arm, the supervised rows its step built: [AR rows, noised-view rows]
        "rows": {r["mode"]: [r["ar_rows"], r["diff_rows"]] for r in (ar, bd, *half)},
        "ar_peak_mib": ar["peak_mib"],
        "bd_peak_mib": bd["peak_mib"],
        "device": args.device,
        "arch": args.arch,
        "params": bd["params"],
    }
    if half:
        summary |= {"bd_bf16_step_s": half[0]["median_s"], "bf16_speedup": bd["median_s"] / half[0]["median_s"]}
    if args.json:
        print(json.dumps(summary))
        return
    print(
        f"device={args.device} arch={args.arch} layers={args.layers} hidden={args.hidden} vocab={args.vocab} "
        f"rows={args.rows}x{args.docs_per_row} docs of P={args.prompt} + n={args.response}, bd_size={args.bd_size}"
    )
    print(f"{'step':<18}{'tokens/batch':>14}{'median s':>12}{'peak MiB':>12}")
    print(f"{'AR SFT':<18}{ar['tokens']:>14}{ar['median_s']:>12.4f}{ar['peak_mib']:>12.1f}")
    print(f"{'block diffusion':<18}{bd['tokens']:>14}{bd['median_s']:>12.4f}{bd['peak_mib']:>12.1f}")
    if half:
        print(f"{'  in bf16':<18}{half[0]['tokens']:>14}{half[0]['median_s']:>12.4f}{half[0]['peak_mib']:>12.1f}")
    print(f"time ratio {summary['time_ratio']:.2f}x at token ratio {summary['token_ratio']:.2f}x")
    if half:
        print(f"bf16 compute: {summary['bf16_speedup']:.2f}x the fp32 block-diffusion step's speed")


if __name__ == "__main__":
    main()
