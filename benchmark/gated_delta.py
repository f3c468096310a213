"""Two-stream gated delta vs its slow reference and vs the causal cost floor, forward + backward.

    python -m benchmark.gated_delta [--lengths 512,2048 --block_sizes 16,32 --heads 4 --dim 64]

For a document of L tokens (prompt L/2, response L/2, 2 noised views) it times, in one run:
- chunked:   `train.two_stream_gated_delta.two_stream_gated_delta` over the two-stream row (L + 2 * L/2 tokens);
- floor:     the stock causal chunked gated delta (transformers' torch_chunk_gated_delta_rule) over L tokens;
- reference: the per-token recurrence the tests hold the chunked op against (same two-stream row).
Prints medians of forward+backward, ratios, and memory: the bytes autograd saves for backward
(any device; distinct storages counted once) and, on CUDA, the peak allocated.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _inputs(N, H, d, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(N, H, d, generator=g), dim=-1) * d**-0.5
    k = torch.nn.functional.normalize(torch.randn(N, H, d, generator=g), dim=-1)
    v = torch.randn(N, H, d, generator=g)
    gate = -torch.rand(N, H, generator=g)
    beta = torch.rand(N, H, generator=g)
    return [x.to(device).requires_grad_() for x in (q, k, v, gate, beta)]


def _time(fn, repeats: int, device) -> float:
    times = []
    for _ in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def saved_mib(fn) -> float:
    """MiB of distinct tensors autograd saves for backward while running `fn` (forward only)."""
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values()) / 2**20


def measure(L: int, bd: int, args, device) -> dict:
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    from bdcore.gated_delta_reference import reference_gated_delta
    from train.config import BlockDiffusionConfig
    from train.hybrid import build_layout
    from train.noise import noise_generator
    from train.rows import Sample, SpecialIds, build_batch
    from train.two_stream_gated_delta import two_stream_gated_delta

    cfg = BlockDiffusionConfig(bd_size=bd)
    sample = Sample(list(range(L)), [(L // 2, L)])
    batch = build_batch([[sample]], cfg, SpecialIds(mask_id=-1, filler_id=0), noise_generator(0, 0, 0))
    layout = build_layout(batch.meta, cfg, conv_width=4).to(device)
    N = batch.input_ids.numel()
    two = _inputs(N, args.heads, args.dim, device)
    floor_in = [x[None] for x in _inputs(L, args.heads, args.dim, device)]

    def run_chunked():
        two_stream_gated_delta(*two, layout).square().mean().backward()

    def run_floor():
        q, k, v, g, b = floor_in
        out, _ = torch_chunk_gated_delta_rule(q * args.dim**0.5, k, v, g, b, chunk_size=64)
        out.square().mean().backward()

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    res = {"tokens": N, "chunked": _time(run_chunked, args.repeats, device)}
    res["peak"] = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else float("nan")
    res["floor"] = _time(run_floor, args.repeats, device)
    res["saved_chunked"] = saved_mib(lambda: two_stream_gated_delta(*two, layout))
    res["saved_floor"] = saved_mib(
        lambda: torch_chunk_gated_delta_rule(floor_in[0] * args.dim**0.5, *floor_in[1:], chunk_size=64)
    )
    res["ref"] = float("nan")
    if L <= args.reference_max_len:
        cpu_in = _inputs(N, args.heads, args.dim, torch.device("cpu"))

        def run_ref():
            out = reference_gated_delta(batch.meta, *cpu_in, clean_causal=True, within_block_causal=False)
            out.square().mean().backward()

        res["ref"] = _time(run_ref, 1, torch.device("cpu"))
    return res


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="512,2048")
    p.add_argument("--block_sizes", default="16,32")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--reference_max_len", type=int, default=2048, help="skip the slow reference above this length")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    device = torch.device(args.device)

    print(f"device={device} heads={args.heads} dim={args.dim}; fwd+bwd median of {args.repeats}")
    print(
        f"{'L':>6}{'bd':>5}{'tokens':>8}{'floor s':>10}{'chunked s':>11}{'ref s':>9}{'chunk/floor':>13}"
        f"{'ref/chunk':>11}{'saved MiB floor / chunked':>27}{'CUDA peak MiB':>15}"
    )
    for L in map(int, args.lengths.split(",")):
        for bd in map(int, args.block_sizes.split(",")):
            r = measure(L, bd, args, device)
            print(
                f"{L:>6}{bd:>5}{r['tokens']:>8}{r['floor']:>10.4f}{r['chunked']:>11.4f}{r['ref']:>9.3f}"
                f"{r['chunked'] / r['floor']:>13.2f}{r['ref'] / r['chunked']:>11.1f}"
                f"{r['saved_floor']:>16.1f} / {r['saved_chunked']:<8.1f}{r['peak']:>15.1f}"
            )


if __name__ == "__main__":
    main()
