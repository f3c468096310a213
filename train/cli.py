"""The `train.py` command line: every flag, its help, and start-up validation. Imports no torch."""

from __future__ import annotations

import argparse
import os

from train.cli_recipes import check_eval, check_model_id, check_opd, check_rl, eval_flags, recipe_flags
from train.config import FlagError

DESCRIPTION = """\
Convert a pretrained autoregressive causal LM into a block-diffusion LM by supervised fine-tuning.

  torchrun --nproc_per_node=8 train.py --model_id Qwen/Qwen3-4B --dataset data.jsonl \\
      --bd_size 32 --ar_loss_weight 0.2 --max_length 8192 --pack --save_dir checkpoints/run1
  python train.py ...            # one process (CPU or one GPU), same code path

Checkpoints are Hugging Face directories (+ block_diffusion.json) under --save_dir:
step_<N>/ every --save_every steps and final/ at the end; each holds train_state/ for --resume.
"""


FULL_FT_LR = 1e-5
# A draft adapter leaves the AR head alone, so its rate is free of the AR constraint: on SmolLM2 at 10 CPU
# minutes 3e-3 drafted best (1e-2 diverged; docs/results.md, "Recipe sweep").
DRAFT_ADAPTER_LR = 3e-3


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="train.py", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    m = p.add_argument_group("model")
    m.add_argument("--model_id", required=True, help="HF hub id or local directory of a causal LM")
    m.add_argument("--trust_remote_code", action="store_true", help="allow custom modeling code from the hub")
    m.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bf16", "fp32"],
        help="compute dtype; master weights and optimizer stay fp32 (auto: bf16 on CUDA, fp32 on CPU; bf16 on a "
        "CPU needs native bf16: AVX512-BF16 or AMX)",
    )

    m.add_argument(
        "--router_aux_loss_coef",
        type=float,
        default=None,
        help="mixture-of-experts models: weight of the router's load-balancing loss, added to the training loss "
        "(default: the model config's router_aux_loss_coef, e.g. 0.001 for Qwen3-MoE; 0 turns it off)",
    )

    b = p.add_argument_group("block diffusion")
    b.add_argument(
        "--objective",
        default="two_stream",
        choices=["two_stream", "single_stream"],
        help="two_stream (default): clean stream + noised views, shifted targets, an AR head for causal and "
        "self-spec decoding; single_stream: masked diffusion in one stream, unshifted targets (a masked slot "
        "predicts its own token), loss at masked slots only, no AR head (diffusion and block-by-block causal "
        "decoding, no self-spec)",
    )
    b.add_argument("--bd_size", type=int, default=32, help="tokens per diffusion block (default 32)")
    b.add_argument(
        "--ar_loss_weight",
        type=float,
        default=None,
        help="w in (diff + w*ar)/(1+w); > 0 keeps the clean stream causal and trains the AR head (default 0.2; "
        "0 with --draft_adapter, whose clean stream is the base model)",
    )
    b.add_argument(
        "--ar_only", action="store_true", help="plain AR SFT baseline: clean stream only, no <|mask|> token, no sidecar"
    )
    b.add_argument("--within_block_causal", action="store_true", help="noised blocks attend causally inside a block")
    b.add_argument(
        "--loss_weighting",
        default="uniform",
        choices=["uniform", "inverse_rate"],
        help="diffusion CE weighting (default uniform)",
    )
    b.add_argument(
        "--views", type=int, default=None, help="noised views per row (default 2: complementary masks; two_stream only)"
    )

    lo = p.add_argument_group(
        "LoRA",
        "Train LoRA adapters (peft) on the decoder layers' linear projections and the <|mask|> embedding row "
        "instead of every weight. --draft_adapter applies them only at the rows that draft, so the clean "
        "stream, causal decoding and self-spec verification are the base model bit for bit.",
    )
    lo.add_argument("--lora_rank", type=int, default=0, help="LoRA rank (default 0: full fine-tuning)")
    lo.add_argument("--lora_alpha", type=float, default=None, help="LoRA alpha (default 2 x rank)")
    lo.add_argument(
        "--lora_targets",
        default="all-linear",
        help="projections to adapt: all-linear (default: every linear layer of the decoder) or names, e.g. "
        "q_proj,v_proj",
    )
    lo.add_argument(
        "--draft_adapter",
        action="store_true",
        help="the adapter acts only at drafting rows; the checkpoint is the base model untouched plus the adapter "
        "(default off: a plain LoRA conversion, saved merged)",
    )
    lo.add_argument(
        "--draft_step",
        choices=["cached", "joint"],
        default="cached",
        help="with --draft_adapter: cached (default) runs the frozen clean stream once without grad and trains the "
        "noised views against its keys/values (the same loss and gradients, no backward through the clean "
        "stream; dense models without a router loss); joint runs both streams in one forward",
    )

    d = p.add_argument_group("data")
    d.add_argument("--dataset", required=True, help="a .jsonl file, a directory of .jsonl files, or a HF dataset id")
    d.add_argument(
        "--max_length",
        type=int,
        default=4096,
        help="max tokens per training row as the model sees it (clean + noised views); "
        "longer samples are skipped and counted",
    )
    d.add_argument(
        "--max_response_length",
        type=int,
        default=None,
        help="skip samples with a longer assistant turn (default: no limit)",
    )
    d.add_argument(
        "--length_buckets",
        default=None,
        help="comma-separated row lengths to pad micro-batches to, so shapes repeat (default: "
        "the longest row rounded up to 64)",
    )
    d.add_argument("--pack", action="store_true", help="pack several samples per row (documents stay isolated)")
    d.add_argument("--multiturn", action="store_true", help="supervise every assistant turn, not only the last")

    o = p.add_argument_group("optimisation")
    o.add_argument("--micro_batch_size", type=int, default=1, help="rows per rank per micro-step")
    o.add_argument("--grad_accum", type=int, default=1, help="micro-steps per optimizer step")
    o.add_argument("--max_steps", type=int, default=1000, help="optimizer steps")
    o.add_argument(
        "--lr",
        type=float,
        default=None,
        help=f"peak learning rate (default {FULL_FT_LR:g}; {DRAFT_ADAPTER_LR:g} with --draft_adapter, the best "
        "of a measured sweep on SmolLM2: docs/results.md)",
    )
    o.add_argument("--warmup", type=int, default=0, help="linear warm-up steps")
    o.add_argument("--lr_min_ratio", type=float, default=0.1, help="cosine floor as a fraction of --lr")
    o.add_argument("--weight_decay", type=float, default=0.0)
    o.add_argument("--grad_clip", type=float, default=1.0, help="global gradient-norm clip (0 disables)")
    o.add_argument(
        "--max_nonfinite_steps",
        type=int,
        default=3,
        help="a step whose loss or gradient norm is NaN or inf is skipped (no update; counted as skipped_steps in "
        "metrics.jsonl); this many in a row stop the run with an error (default 3)",
    )
    o.add_argument("--seed", type=int, default=0, help="data order and noise seed")

    s = p.add_argument_group("checkpoints and logs")
    s.add_argument("--save_dir", required=True, help="run directory: checkpoints, metrics.jsonl, config, data stats")
    s.add_argument("--save_every", type=int, default=0, help="save every N steps (0: only at the end)")
    s.add_argument(
        "--resume",
        default=None,
        help="checkpoint directory (or a run directory: its latest checkpoint) to continue from",
    )
    s.add_argument(
        "--allow_schedule_change",
        action="store_true",
        help="with --resume: accept a --max_steps, --lr, --warmup or --lr_min_ratio that differs from the "
        "checkpoint's run (the lr schedule changes from the resumed step on; recorded in run_config.json)",
    )
    s.add_argument("--log_every", type=int, default=1, help="metrics.jsonl / progress-bar interval in steps")
    s.add_argument("--wandb", default=None, metavar="PROJECT", help="log to Weights & Biases (needs wandb)")
    s.add_argument("--tensorboard", action="store_true", help="log to save_dir/tb (needs tensorboard)")

    eval_flags(p)

    e = p.add_argument_group("efficiency")
    e.add_argument("--activation_checkpointing", action="store_true", help="recompute each decoder layer in backward")
    e.add_argument("--activation_offload", action="store_true", help="keep saved activations in host memory (CUDA)")
    e.add_argument(
        "--fused_ce",
        default="auto",
        choices=["auto", "on", "off"],
        help="Liger fused linear cross entropy (auto: on when CUDA and liger-kernel are present)",
    )
    e.add_argument("--compile", action="store_true", help="torch.compile each decoder layer")

    recipe_flags(p)
    return p


def validate(args: argparse.Namespace) -> argparse.Namespace:
    """Fail at start (FlagError) with the flag and the fix; fill derived values."""

    def bad(flag: str, msg: str):
        raise FlagError(flag, msg)

    if args.bd_size < 2:
        bad("--bd_size", f"{args.bd_size} is too small; a block needs a seed and at least one token (use >= 2)")
    _check_single_stream(args, bad)
    _check_lora(args, bad)
    if args.lr is None:
        args.lr = DRAFT_ADAPTER_LR if args.draft_adapter else FULL_FT_LR
    if args.views is None:
        args.views = 2
    if args.ar_loss_weight < 0:
        bad("--ar_loss_weight", "must be >= 0")
    if args.router_aux_loss_coef is not None and args.router_aux_loss_coef < 0:
        bad("--router_aux_loss_coef", "must be >= 0 (0 turns it off)")
    if args.views < 1 and not args.ar_only:
        bad("--views", "use >= 1 (2 is the default), or --ar_only for plain AR SFT")
    if args.ar_only and args.within_block_causal:
        bad("--within_block_causal", "has no meaning with --ar_only (there are no noised blocks); drop one")
    for flag in ("max_length", "micro_batch_size", "grad_accum", "max_steps", "log_every", "max_nonfinite_steps"):
        if getattr(args, flag) < 1:
            bad(f"--{flag}", f"must be >= 1, got {getattr(args, flag)}")
    if not args.ar_only and args.max_length < 2 * args.bd_size:
        bad("--max_length", f"{args.max_length} cannot hold a prompt and one block of {args.bd_size} per view")
    if args.max_response_length is not None and args.max_response_length < 1:
        bad("--max_response_length", "must be >= 1")
    if args.lr <= 0:
        bad("--lr", "must be > 0")
    if args.warmup < 0 or args.warmup > args.max_steps:
        bad("--warmup", f"must lie in [0, --max_steps={args.max_steps}]")
    if not 0 <= args.lr_min_ratio <= 1:
        bad("--lr_min_ratio", "must lie in [0, 1]")
    if args.weight_decay < 0:
        bad("--weight_decay", "must be >= 0")
    if args.grad_clip < 0:
        bad("--grad_clip", "must be >= 0 (0 disables clipping)")
    if args.save_every < 0:
        bad("--save_every", "must be >= 0 (0 saves only at the end)")
    if args.length_buckets:
        try:
            args.length_buckets = sorted(int(x) for x in str(args.length_buckets).split(","))
        except ValueError:
            bad("--length_buckets", "expected comma-separated integers, e.g. 1024,2048,4096")
        if args.length_buckets[0] < 1:
            bad("--length_buckets", "lengths must be positive")
        if args.length_buckets[-1] < args.max_length:
            args.length_buckets.append(args.max_length)
    # A checkpoint directory a kill left mid-rename is missing, but its run directory holds a copy.
    if args.resume is not None and not os.path.isdir(os.path.dirname(os.path.abspath(args.resume))):
        bad("--resume", f"{args.resume} is not a directory")
    check_model_id(args.model_id)
    check_opd(args, bad)
    check_rl(args, bad)
    check_eval(args, bad)
    if args.ar_only:
        args.views, args.ar_loss_weight = 0, 1.0
    return args


def _check_single_stream(args, bad) -> None:
    """The single-stream objective has one stream and no AR head: what needs either is refused by name."""
    if args.objective != "single_stream":
        return
    needs = {
        "--ar_only": (args.ar_only, "is plain AR SFT; drop one of them"),
        "--ar_loss_weight": (args.ar_loss_weight not in (None, 0), "needs a token-causal clean stream; leave it out"),
        "--views": (args.views not in (None, 1), "counts two-stream noised views; leave it out"),
        "--within_block_causal": (args.within_block_causal, "blocks are bidirectional in it; leave it out"),
        "--draft_adapter": (args.draft_adapter, "needs a clean stream to keep as the base model; leave it out"),
        "--opd_on_policy": (args.opd_on_policy, "distils shifted two-stream students only so far; leave it out"),
        "--rl_diffusion_rollout": (args.rl_diffusion_rollout, "scores shifted two-stream trajectories; leave it out"),
    }
    for flag, (given, fix) in needs.items():
        if given:
            bad(flag, f"does not apply to --objective single_stream: it {fix}")
    args.views, args.ar_loss_weight = 1, 0.0


def _check_lora(args, bad) -> None:
    if args.lora_rank < 0:
        bad("--lora_rank", "must be >= 0 (0: full fine-tuning)")
    if args.lora_rank == 0:
        if args.draft_adapter:
            bad("--draft_adapter", "needs LoRA: add --lora_rank R (e.g. 16)")
        if args.lora_alpha is not None:
            bad("--lora_alpha", "has no meaning without --lora_rank")
    else:
        if args.ar_only:
            bad("--lora_rank", "converts to block diffusion; it has no meaning with --ar_only")
        args.lora_alpha = 2.0 * args.lora_rank if args.lora_alpha is None else args.lora_alpha
        if args.lora_alpha <= 0:
            bad("--lora_alpha", "must be > 0")
    if args.draft_adapter:
        if args.ar_loss_weight not in (None, 0):
            bad(
                "--ar_loss_weight",
                "has no effect with --draft_adapter (the clean stream is the frozen base model); leave it out",
            )
        if args.within_block_causal:
            bad("--within_block_causal", "is not supported with --draft_adapter yet; leave it out")
        args.ar_loss_weight = 0.0
    elif args.ar_loss_weight is None:
        args.ar_loss_weight = 0.2


def parse_args(argv=None) -> argparse.Namespace:
    """The validated flags; argparse exits on unknown flags and malformed values, FlagError names a bad one."""
    return validate(build_parser().parse_args(argv))
