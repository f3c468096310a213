"""train.py's argument parsing and its config sections: bad values name the flag, derived defaults, every
flag placed in one section. Unit tests (no program run); tests/test_cli.py runs train.py itself."""

from pathlib import Path

import pytest

from train.cli import parse_args
from train.config import BlockDiffusionConfig, FlagError, JobConfig

BASE = ["--model_id", "m", "--dataset", "d.jsonl", "--save_dir", "out"]
EVAL_FILE = Path(__file__).parent / "fixtures" / "gsm8k.jsonl"


@pytest.mark.parametrize(
    "extra, flag",
    [
        (["--bd_size", "1"], "--bd_size"),
        (["--ar_loss_weight", "-1"], "--ar_loss_weight"),
        (["--views", "0"], "--views"),
        (["--ar_only", "--within_block_causal"], "--within_block_causal"),
        (["--max_length", "16", "--bd_size", "32"], "--max_length"),
        (["--lr", "0"], "--lr"),
        (["--prefix_gamma", "-1"], "--prefix_gamma"),
        (["--warmup", "50", "--max_steps", "10"], "--warmup"),
        (["--lr_min_ratio", "2"], "--lr_min_ratio"),
        (["--grad_clip", "-1"], "--grad_clip"),
        (["--length_buckets", "1k,2k"], "--length_buckets"),
        (["--resume", "/definitely/not/here"], "--resume"),
        (["--micro_batch_size", "0"], "--micro_batch_size"),
        (["--draft_adapter"], "--draft_adapter"),
        (["--lora_rank", "-1"], "--lora_rank"),
        (["--lora_alpha", "8"], "--lora_alpha"),
        (["--lora_rank", "4", "--ar_only"], "--lora_rank"),
        (["--lora_rank", "4", "--draft_adapter", "--ar_loss_weight", "0.5"], "--ar_loss_weight"),
        (["--canvas_fill", "noise"], "--canvas_fill"),  # noise drafts for self-spec: a draft adapter only
        (["--lora_rank", "4", "--draft_adapter", "--canvas_fill", "noise", "--views", "2"], "--views"),
        (["--max_nonfinite_steps", "0"], "--max_nonfinite_steps"),
        (["--eval_every", "5"], "--eval_every"),
        (["--eval_data", "/no/such.jsonl"], "--eval_data"),
        (["--eval_data", str(EVAL_FILE), "--ar_loss_weight", "0"], "--eval_data"),  # no causal AR head to verify
        # a block-causal clean stream (--ar_loss_weight 0) sees what its AR rows would predict
        (["--opd_on_policy", "--ar_loss_weight", "0", "--opd_ar_weight", "0.5"], "--opd_ar_weight"),
    ],
)
def test_bad_values_name_the_flag(extra, flag):
    with pytest.raises(FlagError, match=flag):
        parse_args(BASE + extra)


@pytest.mark.parametrize(
    "extra, flag",
    [
        (["--lr", "nan"], "--lr"),
        (["--lr", "inf"], "--lr"),
        # AdamW's first step moves each weight by lr / (1 - beta1) = 10 x lr: 1e38 overflowed fp32 in optimizer.step
        (["--lr", "1e38", "--warmup", "0"], "--lr"),
        (["--lr", "2"], "--lr"),
        (["--weight_decay", "nan"], "--weight_decay"),
        (["--lr", "1e-3", "--weight_decay", "2000"], "--weight_decay"),  # lr x decay >= 1 flips every weight
        (["--grad_clip", "inf"], "--grad_clip"),
        (["--ar_loss_weight", "nan"], "--ar_loss_weight"),
        (["--ar_loss_weight", "1e38"], "--ar_loss_weight"),
        (["--prefix_gamma", "inf"], "--prefix_gamma"),
        (["--lr_min_ratio", "nan"], "--lr_min_ratio"),
        (["--lora_rank", "4", "--lora_alpha", "nan"], "--lora_alpha"),
        (["--router_aux_loss_coef", "inf"], "--router_aux_loss_coef"),
        (["--recipe", "opd", "--opd_sft_weight", "nan"], "--opd_sft_weight"),
        (["--recipe", "rl", "--rl_kl_weight", "inf"], "--rl_kl_weight"),
        # a rollout divides fp32 logits by its temperature: 1e-40 is 0 in fp32 and made every probability NaN
        (["--recipe", "rl", "--rl_temperature", "1e-40"], "--rl_temperature"),
        (["--recipe", "opd", "--opd_temperature", "1e-40"], "--opd_temperature"),
    ],
)
def test_float_flags_must_be_finite_and_in_range(extra, flag):
    with pytest.raises(FlagError, match=f"^{flag}: "):
        parse_args(BASE + extra)


def test_derived_values():
    a = parse_args(BASE + ["--ar_only"])
    assert (a.views, a.ar_loss_weight) == (0, 1.0)
    b = parse_args(BASE + ["--length_buckets", "2048,512", "--max_length", "4096"])
    assert b.length_buckets == [512, 2048, 4096]
    assert parse_args(BASE).ar_loss_weight == 0.2
    lora = parse_args(BASE + ["--lora_rank", "8"])
    assert (lora.lora_alpha, lora.ar_loss_weight) == (16.0, 0.2)
    draft = JobConfig.from_args(parse_args(BASE + ["--lora_rank", "8", "--draft_adapter"]))
    assert draft.diffusion.ar_loss_weight == 0.0 and draft.diffusion.clean_causal  # the base's causal stream
    assert draft.lora.spec().draft_only and draft.resume_flags()["draft_adapter"]
    opd = ["--opd_on_policy"]
    assert parse_args(BASE + opd).opd_ar_weight == 1.0
    assert parse_args(BASE + opd + ["--ar_loss_weight", "0"]).opd_ar_weight == 0.0  # no KL on a leak
    assert parse_args(BASE + opd + ["--lora_rank", "8", "--draft_adapter"]).opd_ar_weight == 1.0  # causal base
    # The peak lr by recipe (measured, docs/history/results-notebook.md): full fine-tuning 1e-5, a draft adapter 3e-3
    assert parse_args(BASE).lr == 1e-5 and parse_args(BASE + ["--lora_rank", "8"]).lr == 1e-5
    assert parse_args(BASE + ["--lora_rank", "8", "--draft_adapter"]).lr == 3e-3
    assert parse_args(BASE + ["--lora_rank", "8", "--draft_adapter", "--lr", "1e-4"]).lr == 1e-4
    # Prefix weights by recipe (measured, docs/history/results-notebook.md "Session 40"): a draft adapter
    # exp(-j/4), else none
    assert draft.diffusion.prefix_gamma == 4.0 and JobConfig.from_args(parse_args(BASE)).diffusion.prefix_gamma == 0.0
    assert parse_args(BASE + ["--lora_rank", "8", "--draft_adapter", "--prefix_gamma", "0"]).prefix_gamma == 0.0


def test_job_config_places_every_flag_in_one_section():
    args = parse_args(BASE + ["--bd_size", "8", "--pack", "--length_buckets", "512", "--lr", "2e-3", "--tensorboard"])
    config = JobConfig.from_args(args)
    assert config.flags() == vars(args)
    assert config.diffusion == BlockDiffusionConfig(bd_size=8, views=2, ar_loss_weight=0.2)
    assert (config.data.pack, config.data.length_buckets) == (True, (512, 4096))
    assert (config.optim.lr, config.training.max_steps, config.logging.tensorboard) == (2e-3, 1000, True)
    assert config.resume_flags()["bd_size"] == 8
    ar = JobConfig.from_args(parse_args(BASE + ["--ar_only"]))
    assert ar.diffusion.ar_only and ar.flags()["recipe"] == "ar_sft" and ar.flags()["views"] == 0
