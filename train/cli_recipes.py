"""`train.py` flags and start-up checks of the recipes' own flags (`--recipe opd`: on-policy distillation,
`--recipe rl`), of the held-out drafting metric, and of the model and run directories (`train/cli.py` holds the
rest). Imports no torch."""

from __future__ import annotations

import argparse
import os
import tempfile

from bdcore.capabilities import MODES, Capabilities
from bdcore.checkpoint_files import CheckpointError, check_model_dir
from bdcore.sidecar import Sidecar
from train.cli_fields import field_flag
from train.config import EvalSection, FlagError, OPDSection, RLSection


def recipe_flags(p: argparse.ArgumentParser) -> None:
    o = p.add_argument_group(
        "on-policy distillation (--recipe opd)",
        "The student decodes dataset prompts in diffusion mode as the server would; the frozen AR teacher "
        "scores the answers; the loss is KL(teacher || student) at the slots each revisited state committed "
        "(or, with --opd_slots masked, at every slot it still masked).",
    )
    opd = OPDSection
    field_flag(
        o,
        opd,
        "opd_rollout",
        "how the student answers: diffusion (the default; KL at its commits, train/opd.py) or self-spec "
        "(Draft-OPD for drafts verified by the AR head: the served self-spec decoder drafts and verifies, and the "
        "drafter learns the verifier's distribution by forward KL at the accepted slots and reverse KL at the "
        "first rejected one; with --draft_adapter, after an SFT run: --model_id its checkpoint continues its "
        "adapter)",
        choices=opd.ROLLOUTS,
    )
    field_flag(
        o,
        opd,
        "opd_draft_states",
        "with --opd_rollout self-spec, where the verifies come from: decode (the default; the served decoder on "
        "the prompts) or walk (greedy self-spec replayed along the dataset's answers from one scoring forward a "
        "sample, many times cheaper; exact when the answers are the verifier's own greedy answers, as "
        "self-distilled data are, and the same decoder along another path otherwise)",
        choices=opd.DRAFT_STATES,
    )
    field_flag(
        o,
        opd,
        "opd_reject_weight",
        "self-spec rollouts: weight of the reverse KL at the first rejected slot (default %(default)s)",
    )
    field_flag(o, opd, "opd_teacher", "the frozen AR teacher (default: --model_id before conversion)")
    field_flag(o, opd, "opd_threshold", "rollout commit threshold (default %(default)s)")
    field_flag(o, opd, "opd_temperature", "rollout temperature (default %(default)s: greedy)")
    field_flag(o, opd, "opd_max_new_tokens", "rollout answer length cap (default %(default)s)")
    field_flag(o, opd, "opd_prompts_per_step", "rollouts per rank per step (default %(default)s)")
    field_flag(o, opd, "opd_states_per_block", "canvas states revisited per block (default %(default)s; 0: all)")
    field_flag(
        o,
        opd,
        "opd_slots",
        "slots of a revisited state that carry the KL: the ones it committed (the default) or every one it "
        "still masked (denser: each later-committed slot's distribution in that state, against the teacher's)",
        choices=("committed", "masked"),
    )
    field_flag(
        o,
        opd,
        "opd_ar_weight",
        f"weight of the AR-row KL, which keeps the AR head (the self-spec verifier) on the teacher (default "
        f"{opd.opd_ar_weight:g} when the clean stream is causal: --ar_loss_weight > 0 or --draft_adapter; else 0, "
        "and > 0 is refused: a block-causal clean row sees the token it would be asked to predict)",
        resolved=True,
    )
    field_flag(o, opd, "opd_sft_weight", "weight of two-stream SFT on dataset rows (default %(default)s)")
    _rl_flags(p)


def eval_flags(p: argparse.ArgumentParser) -> None:
    v = p.add_argument_group(
        "held-out drafting metric",
        "One forward per held-out answer with a drafting canvas at every position "
        "(bdcore/decode/policy/draft_quality.py, as python -m benchmark.draft_quality): draft_first_accept, "
        "draft_mean_accepted, draft_tpf_linear and draft_tpf_all (the tokens per forward self-spec would take "
        "along the answers) and eval_ar_loss go to metrics.jsonl and the progress bar.",
    )
    field_flag(v, EvalSection, "eval_data", "chat JSONL whose records end with the assistant's answer")
    field_flag(v, EvalSection, "eval_every", "steps between evaluations (default %(default)s: at the end only)")
    field_flag(v, EvalSection, "eval_samples", "answers scored per evaluation (default %(default)s)")


def _rl_flags(p: argparse.ArgumentParser) -> None:
    r = p.add_argument_group(
        "RL (--recipe rl: GRPO/DAPO on the student's rollouts)",
        "The student decodes each dataset prompt --rl_group_size times as the server would (diffusion mode by "
        "default, --rl_rollout_mode), "
        "sampled; the answers are scored against the dataset's reference answers; the clipped policy-gradient "
        "loss uses group-normalised advantages and the trajectory log-probability of train/trajectory.py.",
    )
    R = RLSection
    field_flag(
        r,
        R,
        "rl_reward",
        "exact (answer == reference), gsm8k (last number == the reference's after ####), or "
        "package.module:function(answer, reference) -> float (default %(default)s)",
    )
    field_flag(r, R, "rl_group_size", "rollouts per prompt, the GRPO group (default %(default)s)")
    field_flag(r, R, "rl_prompts_per_step", "prompts per rank per rollout batch (default %(default)s)")
    field_flag(r, R, "rl_updates_per_batch", "optimizer steps per rollout batch (default %(default)s)")
    field_flag(
        r,
        R,
        "rl_rollout_mode",
        "decode mode of the rollouts (default %(default)s: the canvas states' log-probs train the drafting "
        "rows; self-spec and causal answers are the AR head's, so their AR log-probs train the clean rows)",
        choices=MODES,
    )
    field_flag(r, R, "rl_temperature", "rollout sampling temperature (default %(default)s)")
    field_flag(r, R, "rl_threshold", "rollout commit threshold (default %(default)s)")
    field_flag(r, R, "rl_max_new_tokens", "rollout answer length cap (default %(default)s)")
    field_flag(r, R, "rl_clip_low", "ratio clipped below at 1 - this (default %(default)s)")
    field_flag(r, R, "rl_clip_high", "ratio clipped above at 1 + this (default %(default)s; DAPO: 0.28)")
    field_flag(r, R, "rl_token_level", "DAPO: average the loss over tokens (default: per trajectory)")
    field_flag(r, R, "rl_dynamic_sampling", "DAPO: drop groups whose rewards are all equal")
    field_flag(r, R, "rl_kl_weight", "k3 KL to the frozen starting checkpoint (default %(default)s: none)")
    field_flag(r, R, "rl_sft_weight", "weight of two-stream SFT on dataset rows (default %(default)s)")


def check_opd(args, bad) -> None:
    # With --ar_loss_weight 0 (no draft adapter) the clean stream is block-causal: its row P-1+j attends
    # to the rest of its block, so a KL there would train on a leak of the answer.
    causal_clean = args.ar_loss_weight > 0 or args.draft_adapter
    given = args.opd_ar_weight
    args.opd_ar_weight = (OPDSection.opd_ar_weight if causal_clean else 0.0) if given is None else given
    if args.recipe != "opd":
        return
    if given is not None and given > 0 and not causal_clean:
        bad(
            "--opd_ar_weight",
            f"{given} trains the clean stream's AR rows, but with --ar_loss_weight 0 they are block-causal and see "
            "the tokens they would predict; drop --opd_ar_weight (0 is the default here), or keep the clean stream "
            "causal with --ar_loss_weight > 0",
        )
    for flag in ("opd_max_new_tokens", "opd_prompts_per_step"):
        if getattr(args, flag) < 1:
            bad(f"--{flag}", f"must be >= 1, got {getattr(args, flag)}")
    flags = ("opd_threshold", "opd_temperature", "opd_states_per_block", "opd_ar_weight", "opd_sft_weight")
    for flag in (*flags, "opd_reject_weight"):
        if not getattr(args, flag) >= 0:
            bad(f"--{flag}", f"must be >= 0, got {getattr(args, flag)}")
    if args.opd_rollout == "self-spec":
        if not causal_clean:
            bad(
                "--opd_rollout",
                "self-spec verifies drafts with the AR head, which this run does not have (with --ar_loss_weight 0 "
                "the clean stream is block-causal): add --draft_adapter, or --ar_loss_weight > 0",
            )
        if args.canvas_fill != "mask":
            bad("--opd_rollout", f"self-spec rollouts revisit canvases of masks; drop --canvas_fill {args.canvas_fill}")
    elif args.opd_draft_states != OPDSection.opd_draft_states:
        bad("--opd_draft_states", "applies to --opd_rollout self-spec only")
    if args.opd_teacher is not None:
        try:
            check_model_id(args.opd_teacher)
        except FlagError as e:
            bad("--opd_teacher", str(e).split(": ", 1)[1])


def check_rl(args, bad) -> None:
    if args.recipe != "rl":
        return
    for flag in ("rl_group_size", "rl_prompts_per_step", "rl_updates_per_batch", "rl_max_new_tokens"):
        if getattr(args, flag) < 1:
            bad(f"--{flag}", f"must be >= 1, got {getattr(args, flag)}")
    student = _student_from_flags(args)
    if args.rl_rollout_mode != "diffusion" and (args.draft_adapter or not student.ar_head):
        bad(
            "--rl_rollout_mode",
            f"{args.rl_rollout_mode} rollouts are answers of the AR head, which this run does not train (with "
            "--ar_loss_weight 0 the clean stream is block-causal, with --draft_adapter it is the frozen base): "
            "use diffusion rollouts, or train the AR head (--ar_loss_weight > 0, no --draft_adapter)",
        )
    if args.rl_group_size < 2:
        bad("--rl_group_size", "needs >= 2 rollouts per prompt: advantages are relative to the group")
    if not args.rl_temperature > 0:
        bad("--rl_temperature", "must be > 0: greedy rollouts of one prompt are all the same answer")
    for flag in ("rl_threshold", "rl_clip_low", "rl_clip_high", "rl_kl_weight", "rl_sft_weight"):
        if not getattr(args, flag) >= 0:
            bad(f"--{flag}", f"must be >= 0, got {getattr(args, flag)}")
    n = args.rl_updates_per_batch
    if args.save_every % n or args.max_steps % n:
        bad(
            "--rl_updates_per_batch",
            f"{n} must divide --max_steps ({args.max_steps}) and --save_every ({args.save_every}): a checkpoint "
            "inside a rollout batch could not resume it",
        )
    try:
        from train.rewards import load_reward

        load_reward(args.rl_reward)
    except ValueError as e:
        bad("--rl_reward", str(e))


def _student_from_flags(args) -> Capabilities:
    """What the run's student will decode as, from its flags (before any config or tokenizer exists), through
    the one constructor: the flags mapped into the sidecar its checkpoints will carry. The clean stream is
    causal only with the AR loss on (a draft adapter's is the frozen base); the mask id is the tokenizer's,
    not known yet, and decides nothing here."""
    causal = args.ar_loss_weight > 0 or bool(args.draft_adapter)
    return Capabilities.from_sidecar(Sidecar(bd_size=args.bd_size, mask_id=0, clean_causal=causal))


def check_eval(args, bad) -> None:
    if args.eval_every < 0 or args.eval_samples < 1:
        bad("--eval_every" if args.eval_every < 0 else "--eval_samples", "must be >= 0 (--eval_samples >= 1)")
    if args.eval_data is None:
        if args.eval_every:
            bad("--eval_every", "needs --eval_data (held-out chats to score)")
        return
    if not os.path.isfile(args.eval_data):
        bad("--eval_data", f"{args.eval_data} is not a file; pass a chat JSONL")
    if args.recipe == "ar_sft" or args.objective == "single_stream":
        bad(
            "--eval_data",
            "scores self-spec drafting, which --recipe ar_sft (--ar_only) and --objective single_stream do not train",
        )
    if not (args.ar_loss_weight > 0 or args.draft_adapter):
        bad(
            "--eval_data",
            "scores self-spec drafting, which needs a causal clean stream; with --ar_loss_weight 0 (no draft "
            "adapter) it is block-causal: train with --ar_loss_weight > 0 or --draft_adapter",
        )


def check_model_id(model_id: str) -> None:
    """Local paths are checked here, their files too (`check_model_dir`: before torch is imported, and on
    every rank, so a bad file stops every rank alike); a hub id is checked when it is downloaded."""
    fix = "pass a hub id (e.g. Qwen/Qwen3-4B) or a local directory written by save_pretrained"
    if not model_id.strip():
        raise FlagError("--model_id", f"is empty; {fix}")
    path = os.path.expanduser(model_id)
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise FlagError("--model_id", f"{model_id} holds no config.json; {fix}")
        try:
            check_model_dir(path)
        except CheckpointError as e:
            raise FlagError("--model_id", str(e)) from e
    elif os.path.exists(path):
        raise FlagError("--model_id", f"{model_id} is a file, not a model directory; {fix}")
    elif model_id.startswith((".", "/", "~")) or model_id.count("/") > 1:
        raise FlagError("--model_id", f"{model_id}: no such directory; {fix}")


def check_save_dir(save_dir: str) -> None:
    """Before anything is loaded (every rank): `--save_dir` is, or can be made, a directory this process can write.
    Permission bits do not say it for root (sysfs refuses root's mkdir), so create it and write a probe file."""
    if os.path.exists(save_dir) and not os.path.isdir(save_dir):
        raise FlagError(
            "--save_dir", f"{save_dir} exists and is not a directory; pass a directory (train.py creates a new one)"
        )
    try:
        os.makedirs(save_dir, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=save_dir)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise FlagError(
            "--save_dir", f"{save_dir} cannot be written ({e.strerror}); pass a directory you can write"
        ) from e
