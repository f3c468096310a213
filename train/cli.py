"""The `train.py` command line: every flag, its help, and start-up validation. Imports no torch."""

from __future__ import annotations

import argparse
import os

from bdcore.sidecar import CANVAS_FILLS
from train.cli_fields import check_floats, field_flag
from train.cli_recipes import check_eval, check_model_id, check_opd, check_rl, eval_flags, recipe_flags
from train.config import (
    DRAFT_LOSSES,
    LOSS_WEIGHTINGS,
    OBJECTIVES,
    RECIPES,
    BlockDiffusionConfig,
    CheckpointSection,
    DataSection,
    EfficiencySection,
    FlagError,
    LoggingSection,
    LoraSection,
    ModelSection,
    OptimSection,
    TrainingSection,
)
from train.recipes import RECIPE_TABLE, recipe_help, refuse_foreign_flags, resolve_recipe

DESCRIPTION = """\
Convert a pretrained autoregressive causal LM into a block-diffusion LM by supervised fine-tuning.

  torchrun --nproc_per_node=8 train.py --model_id Qwen/Qwen3-4B --dataset data.jsonl \\
      --bd_size 32 --ar_loss_weight 0.2 --max_length 8192 --pack --save_dir checkpoints/run1
  python train.py ...            # one process (CPU or one GPU), same code path

Checkpoints are Hugging Face directories (+ block_diffusion.json) under --save_dir:
step_<N>/ every --save_every steps and final/ at the end; each holds train_state/ for --resume.
"""


FULL_FT_LR = OptimSection.lr
# A draft adapter leaves the AR head alone, so its rate is free of the AR constraint: on SmolLM2 at 10 CPU
# minutes 3e-3 drafted best (1e-2 diverged; docs/history/results-notebook.md, "Recipe sweep").
DRAFT_ADAPTER_LR = 3e-3
# A draft adapter serves self-spec, which accepts a draft only after every draft before it: weighting the
# j-th draft by exp(-j/4) drafted best of {0, 2, 4} on SmolLM2 at 10 CPU minutes
# (docs/history/results-notebook.md, "prefix weights").
DRAFT_ADAPTER_PREFIX_GAMMA = 4.0
# A draft adapter's clean stream is the frozen base, the very distribution self-spec verifies against: its drafts
# learn that distribution (KL) rather than one token each. On SmolLM2 at an equal 8-minute budget, KL drafted
# 1.405 implied linear tokens per forward against cross-entropy's 1.364 (all canvases 1.730 / 1.654; first draft
# accepted 52.8% / 48.1%), docs/history/results-notebook.md, "drafts distilled from the verifier".
DRAFT_ADAPTER_DRAFT_LOSS = "kl"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="train.py", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    m = p.add_argument_group("model")
    field_flag(m, ModelSection, "model_id", "HF hub id or local directory of a causal LM")
    field_flag(m, ModelSection, "trust_remote_code", "allow custom modeling code from the hub")
    field_flag(
        m,
        ModelSection,
        "dtype",
        "compute dtype; master weights and optimizer stay fp32 (auto, the default: bf16 on CUDA, fp32 on CPU; bf16 "
        "on a CPU needs native bf16: AVX512-BF16 or AMX)",
        choices=["auto", "bf16", "fp32"],
    )
    field_flag(
        m,
        ModelSection,
        "router_aux_loss_coef",
        "mixture-of-experts models: weight of the router's load-balancing loss, added to the training loss "
        "(default: the model config's router_aux_loss_coef, e.g. 0.001 for Qwen3-MoE; 0 turns it off)",
    )

    r = p.add_argument_group(
        "recipe",
        "What the run trains, one choice. A flag of another recipe (--opd_* or --rl_*) set to anything but its "
        "default is refused by name (train/recipes.py).",
    )
    field_flag(r, TrainingSection, "recipe", recipe_help(), resolved=True, choices=RECIPES)
    for recipe in RECIPE_TABLE.values():
        if recipe.legacy_flag:
            r.add_argument(recipe.legacy_flag, action="store_true", help=f"the same as --recipe {recipe.name}")

    b = p.add_argument_group("block diffusion")
    BD = BlockDiffusionConfig
    field_flag(
        b,
        BD,
        "objective",
        "the SFT objective. two_stream (default): clean stream + noised views, shifted targets, an AR head for "
        "causal and self-spec decoding; single_stream (--recipe sft only): masked diffusion in one stream, "
        "unshifted targets (a masked slot predicts its own token), loss at masked slots only, no AR head "
        "(diffusion and block-by-block causal decoding, no self-spec)",
        choices=OBJECTIVES,
    )
    field_flag(b, BD, "bd_size", "tokens per diffusion block (default %(default)s)")
    field_flag(
        b,
        BD,
        "ar_loss_weight",
        f"w in (diff + w*ar)/(1+w); > 0 keeps the clean stream causal and trains the AR head (default "
        f"{BD.ar_loss_weight:g}; 0 with --draft_adapter, whose clean stream is the base model)",
        resolved=True,
    )
    field_flag(b, BD, "within_block_causal", "noised blocks attend causally inside a block")
    field_flag(b, BD, "loss_weighting", "diffusion CE weighting (default %(default)s)", choices=LOSS_WEIGHTINGS)
    field_flag(
        b,
        BD,
        "canvas_fill",
        "what a noised block's slots hold. mask (default): <|mask|> at a random share of them (diffusion and "
        "self-spec); noise (--draft_adapter, one view): uniform random ids at every slot, the draft layout of "
        "SGLang's UNO speculative decoding (self-spec only; with --within_block_causal, UNO's causal draft pass)",
        choices=CANVAS_FILLS,
    )
    field_flag(
        b,
        BD,
        "prefix_gamma",
        "weight the j-th draft of a block (j = 0 right after the seed) by exp(-j/gamma), so the first drafts, "
        f"which self-spec accepts first, weigh most (default {DRAFT_ADAPTER_PREFIX_GAMMA:g} with --draft_adapter, "
        "the best of a measured sweep; else 0: every position the same)",
        resolved=True,
    )
    field_flag(
        b,
        BD,
        "draft_loss",
        "what a drafting slot learns from: ce, the data's token; kl, KL(verifier || drafter) against the "
        "clean-stream row that predicts the same token (the distribution self-spec verifies against: with "
        "--draft_adapter the frozen base model, else the model's own AR head, detached), fillers past a document's "
        "end by ce; mix, --draft_kl_mix of kl plus the rest ce. kl and mix need a causal clean stream "
        f"(--draft_adapter or --ar_loss_weight > 0). Default {DRAFT_ADAPTER_DRAFT_LOSS} with --draft_adapter (it "
        "drafted better than ce at an equal budget), else ce",
        resolved=True,
        choices=DRAFT_LOSSES,
    )
    field_flag(b, BD, "draft_kl_mix", "the KL share of --draft_loss mix (default %(default)s)")
    field_flag(
        b,
        BD,
        "draft_temperature",
        "both distributions of --draft_loss kl/mix at this temperature (default %(default)s)",
    )
    field_flag(
        b,
        BD,
        "chain_weights",
        "weight each drafting slot by the drafter's own probability (detached) that self-spec accepts every slot "
        "before it in its block (1 - total variation to the verifier; the label's probability for fillers), on "
        "top of --prefix_gamma: the loss goes where drafts fail",
    )
    field_flag(
        b,
        BD,
        "views",
        f"noised views per row (default {BD.views}: complementary masks; two_stream only)",
        resolved=True,
    )

    lo = p.add_argument_group(
        "LoRA",
        "Train LoRA adapters (peft) on the decoder layers' linear projections and the <|mask|> embedding row "
        "instead of every weight. --draft_adapter applies them only at the rows that draft, so the clean "
        "stream, causal decoding and self-spec verification are the base model bit for bit.",
    )
    field_flag(lo, LoraSection, "lora_rank", "LoRA rank (default %(default)s: full fine-tuning)")
    field_flag(lo, LoraSection, "lora_alpha", "LoRA alpha (default 2 x rank)")
    field_flag(
        lo,
        LoraSection,
        "lora_targets",
        "projections to adapt: all-linear (the default: every linear layer of the decoder) or names, e.g. "
        "q_proj,v_proj",
    )
    field_flag(
        lo,
        LoraSection,
        "draft_adapter",
        "the adapter acts only at drafting rows; the checkpoint is the base model untouched plus the adapter "
        "(default off: a plain LoRA conversion, saved merged)",
    )
    field_flag(
        lo,
        LoraSection,
        "draft_step",
        "with --draft_adapter: cached (default) runs the frozen clean stream once without grad and trains the "
        "noised views against its keys/values (the same loss and gradients, no backward through the clean "
        "stream; dense models without a router loss); joint runs both streams in one forward",
        choices=["cached", "joint"],
    )

    d = p.add_argument_group("data")
    field_flag(d, DataSection, "dataset", "a .jsonl file, a directory of .jsonl files, or a HF dataset id")
    field_flag(
        d,
        DataSection,
        "max_length",
        "max tokens per training row as the model sees it (clean + noised views; default %(default)s); "
        "longer samples are skipped and counted",
    )
    field_flag(d, DataSection, "max_response_length", "skip samples with a longer assistant turn (default: no limit)")
    field_flag(
        d,
        DataSection,
        "length_buckets",
        "comma-separated row lengths to pad micro-batches to, so shapes repeat (default: "
        "the longest row rounded up to 64)",
        type=str,
    )
    field_flag(d, DataSection, "pack", "pack several samples per row (documents stay isolated)")
    field_flag(d, DataSection, "multiturn", "supervise every assistant turn, not only the last")

    o = p.add_argument_group("optimisation")
    field_flag(o, TrainingSection, "micro_batch_size", "rows per rank per micro-step (default %(default)s)")
    field_flag(o, TrainingSection, "grad_accum", "micro-steps per optimizer step (default %(default)s)")
    field_flag(o, TrainingSection, "max_steps", "optimizer steps (default %(default)s)")
    field_flag(
        o,
        OptimSection,
        "lr",
        f"peak learning rate (default {FULL_FT_LR:g}; {DRAFT_ADAPTER_LR:g} with --draft_adapter, the best "
        "of a measured sweep on SmolLM2: docs/history/results-notebook.md)",
        resolved=True,
    )
    field_flag(o, OptimSection, "warmup", "linear warm-up steps (default %(default)s)")
    field_flag(o, OptimSection, "lr_min_ratio", "cosine floor as a fraction of --lr (default %(default)s)")
    field_flag(o, OptimSection, "weight_decay", "AdamW weight decay (default %(default)s)")
    field_flag(o, OptimSection, "grad_clip", "global gradient-norm clip (default %(default)s; 0 disables)")
    field_flag(
        o,
        OptimSection,
        "max_nonfinite_steps",
        "a step whose loss or gradient norm is NaN or inf is skipped (no update; counted as skipped_steps in "
        "metrics.jsonl); this many in a row stop the run with an error (default %(default)s)",
    )
    field_flag(o, TrainingSection, "seed", "data order and noise seed (default %(default)s)")

    s = p.add_argument_group("checkpoints and logs")
    C = CheckpointSection
    field_flag(s, C, "save_dir", "run directory: checkpoints, metrics.jsonl, config, data stats")
    field_flag(s, C, "save_every", "save every N steps (default %(default)s: only at the end)")
    field_flag(s, C, "resume", "checkpoint directory (or a run directory: its latest checkpoint) to continue from")
    field_flag(
        s,
        C,
        "allow_schedule_change",
        "with --resume: accept a --max_steps, --lr, --warmup or --lr_min_ratio that differs from the "
        "checkpoint's run (the lr schedule changes from the resumed step on; recorded in run_config.json)",
    )
    field_flag(s, LoggingSection, "log_every", "metrics.jsonl / progress-bar interval in steps (default %(default)s)")
    field_flag(s, LoggingSection, "wandb", "log to Weights & Biases (needs wandb)", metavar="PROJECT")
    field_flag(s, LoggingSection, "tensorboard", "log to save_dir/tb (needs tensorboard)")

    eval_flags(p)

    e = p.add_argument_group("efficiency")
    E = EfficiencySection
    field_flag(e, E, "activation_checkpointing", "recompute each decoder layer in backward")
    field_flag(e, E, "activation_offload", "keep saved activations in host memory (CUDA)")
    field_flag(
        e,
        E,
        "fused_ce",
        "Liger fused linear cross entropy (auto, the default: on when CUDA and liger-kernel are present)",
        choices=["auto", "on", "off"],
    )
    field_flag(e, E, "compile", "torch.compile each decoder layer")

    recipe_flags(p)
    return p


def validate(args: argparse.Namespace) -> argparse.Namespace:
    """Fail at start (FlagError) with the flag and the fix; fill derived values."""

    def bad(flag: str, msg: str):
        raise FlagError(flag, msg)

    check_floats(args, bad)
    chosen_by = resolve_recipe(args, bad)
    refuse_foreign_flags(args, chosen_by, build_parser().get_default, bad)
    ar_sft = args.recipe == "ar_sft"
    if args.bd_size < 2:
        bad("--bd_size", f"{args.bd_size} is too small; a block needs a seed and at least one token (use >= 2)")
    _check_single_stream(args, chosen_by, bad)
    _check_ar_sft(args, chosen_by, bad)
    _check_lora(args, chosen_by, bad)
    _check_canvas_fill(args, bad)
    _check_draft_loss(args, bad)
    if args.lr is None:
        args.lr = DRAFT_ADAPTER_LR if args.draft_adapter else FULL_FT_LR
    if args.prefix_gamma is None:
        args.prefix_gamma = DRAFT_ADAPTER_PREFIX_GAMMA if args.draft_adapter and not ar_sft else 0.0
    if args.prefix_gamma < 0:
        bad("--prefix_gamma", "must be >= 0 (0: every draft position weighs the same)")
    if args.views is None:
        args.views = BlockDiffusionConfig.views
    if args.ar_loss_weight < 0:
        bad("--ar_loss_weight", "must be >= 0")
    if args.router_aux_loss_coef is not None and args.router_aux_loss_coef < 0:
        bad("--router_aux_loss_coef", "must be >= 0 (0 turns it off)")
    if args.views < 1 and not ar_sft:
        bad("--views", f"use >= 1 ({BlockDiffusionConfig.views} is the default), or --recipe ar_sft for plain AR SFT")
    if ar_sft and args.within_block_causal:
        bad("--within_block_causal", f"has no meaning with {chosen_by} (there are no noised blocks); drop one")
    for flag in ("max_length", "micro_batch_size", "grad_accum", "max_steps", "log_every", "max_nonfinite_steps"):
        if getattr(args, flag) < 1:
            bad(f"--{flag}", f"must be >= 1, got {getattr(args, flag)}")
    if not ar_sft and args.max_length < 2 * args.bd_size:
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
    if args.weight_decay * args.lr >= 1:
        bad(
            "--weight_decay",
            f"{args.weight_decay:g} x --lr {args.lr:g} >= 1: AdamW multiplies each weight by 1 - lr x decay a step, "
            "which zeroes or flips it; lower it (0.1 is usual)",
        )
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
    if ar_sft:
        args.views, args.ar_loss_weight = 0, 1.0
    return args


def _check_single_stream(args, chosen_by: str, bad) -> None:
    """The single-stream objective (of --recipe sft) has one stream and no AR head: what needs either is refused
    by name."""
    if args.objective != "single_stream":
        return
    recipe_needs = {
        "ar_sft": "is plain AR SFT; drop one of them",
        "opd": "distils shifted two-stream students only so far; leave it out",
        "rl": "scores shifted two-stream trajectories; leave it out",
    }
    if args.recipe in recipe_needs:
        bad(chosen_by, f"does not apply to --objective single_stream: it {recipe_needs[args.recipe]}")
    needs = {
        "--ar_loss_weight": (args.ar_loss_weight not in (None, 0), "needs a token-causal clean stream; leave it out"),
        "--views": (args.views not in (None, 1), "counts two-stream noised views; leave it out"),
        "--within_block_causal": (args.within_block_causal, "blocks are bidirectional in it; leave it out"),
        "--draft_adapter": (args.draft_adapter, "needs a clean stream to keep as the base model; leave it out"),
    }
    for flag, (given, fix) in needs.items():
        if given:
            bad(flag, f"does not apply to --objective single_stream: it {fix}")
    args.views, args.ar_loss_weight = 1, 0.0


def _check_ar_sft(args, chosen_by: str, bad) -> None:
    """Plain AR SFT has no noised views and no diffusion loss: the flags that shape them would be ignored."""
    if args.recipe != "ar_sft":
        return
    given = {
        "--views": args.views is not None,
        "--ar_loss_weight": args.ar_loss_weight is not None,
        "--loss_weighting": args.loss_weighting != BlockDiffusionConfig.loss_weighting,
        "--prefix_gamma": args.prefix_gamma is not None,
    }
    for flag, is_given in given.items():
        if is_given:
            bad(
                flag,
                f"shapes the block-diffusion loss, which {chosen_by} does not train (plain AR SFT: clean stream "
                "only, AR loss only); leave it out",
            )


def _check_lora(args, chosen_by: str, bad) -> None:
    if args.lora_rank < 0:
        bad("--lora_rank", "must be >= 0 (0: full fine-tuning)")
    if args.lora_rank == 0:
        if args.draft_adapter:
            bad("--draft_adapter", "needs LoRA: add --lora_rank R (e.g. 16)")
        if args.lora_alpha is not None:
            bad("--lora_alpha", "has no meaning without --lora_rank")
    else:
        if args.recipe == "ar_sft":
            bad("--lora_rank", f"converts to block diffusion; it has no meaning with {chosen_by}")
        args.lora_alpha = 2.0 * args.lora_rank if args.lora_alpha is None else args.lora_alpha
        if args.lora_alpha <= 0:
            bad("--lora_alpha", "must be > 0")
    if args.draft_adapter:
        if args.ar_loss_weight not in (None, 0):
            bad(
                "--ar_loss_weight",
                "has no effect with --draft_adapter (the clean stream is the frozen base model); leave it out",
            )
        args.ar_loss_weight = 0.0
    elif args.ar_loss_weight is None:
        args.ar_loss_weight = BlockDiffusionConfig.ar_loss_weight


def _check_draft_loss(args, bad) -> None:
    """--draft_loss kl / mix distil from the clean stream's AR rows: refused where there are none. Unset, a draft
    adapter's SFT distils (its clean stream is the frozen verifier), everything else learns the data's tokens."""
    if args.draft_loss is None:
        distils = args.draft_adapter and args.recipe == "sft" and args.objective != "single_stream"
        args.draft_loss = DRAFT_ADAPTER_DRAFT_LOSS if distils else BlockDiffusionConfig.draft_loss
    if not 0.0 <= args.draft_kl_mix <= 1.0:
        bad("--draft_kl_mix", f"{args.draft_kl_mix} is a share: give one in [0, 1]")
    if not args.draft_temperature > 0:
        bad("--draft_temperature", f"{args.draft_temperature} must be > 0 (1: the distributions as they are)")
    if args.draft_loss == "ce":
        return
    if args.recipe != "sft" or args.objective == "single_stream":
        bad(
            "--draft_loss",
            f"{args.draft_loss} distils drafting rows from the clean stream: only --recipe sft with "
            "the two_stream objective has both; use --draft_loss ce",
        )
    if not args.draft_adapter and not args.ar_loss_weight > 0:
        bad(
            "--draft_loss",
            f"{args.draft_loss} takes its teacher from the clean stream's AR rows, an AR model only "
            "when the clean stream is causal: add --draft_adapter or an --ar_loss_weight > 0",
        )


def _check_canvas_fill(args, bad) -> None:
    """Noise fills every slot of a block, so its one view is all the noise there is (views default to 1)."""
    if args.canvas_fill != "noise":
        return
    if not args.draft_adapter:
        bad(
            "--canvas_fill",
            "noise trains a drafter for self-spec, and a full conversion would lose diffusion mode with it (no slot "
            "is marked undecided); add --draft_adapter, or leave it out",
        )
    if args.views not in (None, 1):
        bad("--views", "must be 1 with --canvas_fill noise (every slot is noised, so all views would be alike)")
    args.views = 1


def parse_args(argv=None) -> argparse.Namespace:
    """The validated flags; argparse exits on unknown flags and malformed values, FlagError names a bad one."""
    return validate(build_parser().parse_args(argv))
