"""What a drafting step costs: full fine-tuning vs a draft-only adapter, joint vs cached clean stream.

    python -m benchmark.draft_step runs/smollm2/base --rows 2 --prompt 96 --response 160 --repeats 5

On one model and the same two-stream rows (random ids of the given shape, packed one sample a row),
forward + backward + AdamW, in one process, the arms interleaved repeat by repeat so that a busy machine
slows each alike:
- `full`: every weight trains, the AR term on (`--ar_loss_weight`), the joint two-stream forward;
- `adapter_joint`: a draft-only LoRA adapter (`--lora-rank`), both streams in one forward;
- `adapter_cached`: the same adapter, the frozen clean stream once without grad (`--draft_step cached`).
Prints each arm's median step time and its speed-up over `full`; the two adapter arms' losses must agree
(the same step, computed two ways). It also times the clean pass alone (the base over the rows' clean
tokens, no grad, keys/values kept): its share of the cached step is what a cache of the base's keys/values
kept across epochs could save at most, from the second epoch on.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import statistics
import time

import torch

ARMS = ("full", "adapter_joint", "adapter_cached")


def _rows(vocab: int, args) -> list:
    from train.rows import Sample

    rng = random.Random(0)
    return [
        [
            Sample(
                [rng.randrange(3, vocab - 3) for _ in range(args.prompt + args.response)],
                [(args.prompt, args.prompt + args.response)],
            )
        ]
        for _ in range(args.rows)
    ]


def _arm(base, arm: str, args, mask_id: int):
    from bdcore.draft_adapter import LoraSpec, add_lora
    from train.config import BlockDiffusionConfig
    from train.model import TwoStreamLM

    model = copy.deepcopy(base)
    if arm == "full":
        cfg = BlockDiffusionConfig(bd_size=args.bd_size, views=2, ar_loss_weight=args.ar_loss_weight)
        return TwoStreamLM(model, cfg)
    torch.manual_seed(0)  # both adapter arms start from the same adapter, so they take the same steps
    add_lora(model, LoraSpec(args.lora_rank, 2.0 * args.lora_rank, "all-linear", True), mask_id)
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name or "bd_mask_row" in name)
    cfg = BlockDiffusionConfig(bd_size=args.bd_size, views=2, ar_loss_weight=0.0, clean_causal=True)
    return TwoStreamLM(model, cfg, frozen_clean=arm == "adapter_cached")


def _clean_pass_seconds(base, batch) -> float:
    """The cached step's first pass on its own: the base model over each row's clean tokens, no grad, a
    cache of keys/values filled (what a cross-epoch cache would replace by a read)."""
    from transformers import DynamicCache

    clean = batch.meta.stream == 0
    ids = batch.input_ids[clean].view(batch.input_ids.shape[0], -1)  # one sample a row: equal clean lengths
    pos = batch.meta.pos[clean].view_as(ids)
    start = time.perf_counter()
    with torch.no_grad():
        base.get_decoder()(
            input_ids=ids, position_ids=pos, past_key_values=DynamicCache(config=base.config), use_cache=True
        )
    return time.perf_counter() - start


def measure(args) -> dict:
    from transformers import AutoModelForCausalLM

    from train.noise import noise_generator
    from train.rows import SpecialIds, build_batch

    if args.threads:
        torch.set_num_threads(args.threads)
    base = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="sdpa")
    vocab = base.config.vocab_size
    mask_id, filler = vocab - 1, vocab - 2  # rows of random ids: any two ids outside them serve
    lms = {arm: _arm(base, arm, args, mask_id) for arm in ARMS}
    opts = {arm: torch.optim.AdamW([p for p in lm.parameters() if p.requires_grad], lr=1e-5) for arm, lm in lms.items()}
    rows = _rows(vocab, args)
    times = {arm: [] for arm in (*ARMS, "clean_pass")}
    losses = {arm: [] for arm in ARMS}
    for r in range(args.warmup + args.repeats):
        batch = build_batch(rows, lms["full"].cfg, SpecialIds(mask_id, filler), noise_generator(0, 0, r))
        for arm in ARMS:
            lm, opt = lms[arm], opts[arm]
            start = time.perf_counter()
            parts = lm(batch)
            parts.loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if r >= args.warmup:
                times[arm].append(time.perf_counter() - start)
                losses[arm].append(float(parts.loss.detach()))
        seconds = _clean_pass_seconds(base, batch)
        if r >= args.warmup:
            times["clean_pass"].append(seconds)
    median = {arm: statistics.median(t) for arm, t in times.items()}
    return {
        "model": args.model,
        "rows": args.rows,
        "prompt": args.prompt,
        "response": args.response,
        "bd_size": args.bd_size,
        "step_s": median,
        "speedup_vs_full": {arm: median["full"] / median[arm] for arm in ARMS},
        "cached_vs_joint": median["adapter_joint"] / median["adapter_cached"],
        "clean_pass_share_of_cached": median["clean_pass"] / median["adapter_cached"],
        "adapter_losses_agree": all(
            abs(a - b) <= 1e-4 * max(1.0, abs(a)) for a, b in zip(losses["adapter_joint"], losses["adapter_cached"])
        ),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmark.draft_step", description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="a causal LM directory (e.g. runs/smollm2/base from make smoke-smollm2)")
    p.add_argument("--rows", type=int, default=2, help="rows per step (one sample each)")
    p.add_argument("--prompt", type=int, default=96)
    p.add_argument("--response", type=int, default=160)
    p.add_argument("--bd-size", type=int, default=16)
    p.add_argument("--ar-loss-weight", type=float, default=0.2, help="the full arm's AR weight")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    p.add_argument("--json", default=None, help="also write the result here")
    args = p.parse_args(argv)
    result = measure(args)
    for arm in ARMS:
        print(f"{arm:<15} {result['step_s'][arm]:.3f} s/step   {result['speedup_vs_full'][arm]:.2f}x full")
    print(f"cached vs joint: {result['cached_vs_joint']:.2f}x   adapter losses agree: {result['adapter_losses_agree']}")
    share = result["clean_pass_share_of_cached"]
    print(
        f"clean pass alone: {result['step_s']['clean_pass']:.3f} s = {share:.0%} of the cached step: a cache of the "
        f"base's keys/values kept across epochs could make later epochs' steps at most {1 / (1 - share):.2f}x faster"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
