"""train.py's command line: help without torch, every documented flag, clear start-up errors."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.train_args import train_args
from train.cli import parse_args
from train.config import BlockDiffusionConfig, FlagError, JobConfig

pytestmark = pytest.mark.e2e  # a whole program, server or long sweep: `pytest -m 'not e2e'` skips it

FLAGS = (
    "--model_id --dataset --bd_size --ar_loss_weight --ar_only --within_block_causal --loss_weighting --views "
    "--max_length --max_response_length --length_buckets --pack --multiturn --micro_batch_size --grad_accum "
    "--max_steps --lr --warmup --lr_min_ratio --weight_decay --grad_clip --max_nonfinite_steps --seed --save_dir "
    "--save_every "
    "--resume --allow_schedule_change --log_every --activation_checkpointing --activation_offload --fused_ce "
    "--compile --dtype --eval_data --eval_every --eval_samples "
    "--trust_remote_code --wandb --tensorboard"
).split()


def test_help_documents_every_flag_without_importing_torch():
    code = (
        "import sys; sys.argv = ['train.py', '--help']\n"
        "import runpy\n"
        "try:\n    runpy.run_path('train.py', run_name='__main__')\n"
        "except SystemExit:\n    pass\n"
        "print('TORCH_IMPORTED' if 'torch' in sys.modules else 'NO_TORCH')"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert "NO_TORCH" in out
    for flag in FLAGS:
        assert flag in out, flag


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
        (["--lora_rank", "4", "--draft_adapter", "--within_block_causal"], "--within_block_causal"),
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
    # The peak lr by recipe (measured, docs/results.md): full fine-tuning 1e-5, a draft adapter 3e-3
    assert parse_args(BASE).lr == 1e-5 and parse_args(BASE + ["--lora_rank", "8"]).lr == 1e-5
    assert parse_args(BASE + ["--lora_rank", "8", "--draft_adapter"]).lr == 3e-3
    assert parse_args(BASE + ["--lora_rank", "8", "--draft_adapter", "--lr", "1e-4"]).lr == 1e-4


def test_job_config_places_every_flag_in_one_section():
    args = parse_args(BASE + ["--bd_size", "8", "--pack", "--length_buckets", "512", "--lr", "2e-3", "--tensorboard"])
    config = JobConfig.from_args(args)
    assert config.flags() == vars(args)
    assert config.diffusion == BlockDiffusionConfig(bd_size=8, views=2, ar_loss_weight=0.2)
    assert (config.data.pack, config.data.length_buckets) == (True, (512, 4096))
    assert (config.optim.lr, config.training.max_steps, config.logging.tensorboard) == (2e-3, 1000, True)
    assert config.resume_flags()["bd_size"] == 8
    ar = JobConfig.from_args(parse_args(BASE + ["--ar_only"]))
    assert ar.diffusion.ar_only and ar.flags()["ar_only"] and ar.flags()["views"] == 0


def test_runtime_flag_errors_before_training(demo_kit, tmp_path):
    proc = subprocess.run(
        [sys.executable, "train.py", *train_args(demo_kit, tmp_path / "r", activation_offload=True)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0 and "--activation_offload" in proc.stderr


def test_empty_dataset_is_a_clear_error(demo_kit, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": []}\nnot json\n')
    proc = subprocess.run(
        [sys.executable, "train.py", *train_args(demo_kit, tmp_path / "r", dataset=bad, max_length=64)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "no usable samples" in proc.stderr and "malformed_json" in proc.stderr


def _train_error(demo_kit, tmp_path, *, model_id=None, dataset=None, env=None) -> tuple[str, Path]:
    """Run train.py expecting a start-up error; return (the one error line, the run directory)."""
    run = tmp_path / "r"
    overrides = {name: value for name, value in (("model_id", model_id), ("dataset", dataset)) if value is not None}
    args = train_args(demo_kit, run, max_length=64, **overrides)
    env = {**os.environ, **(env or {})}
    proc = subprocess.run(
        [sys.executable, "train.py", *args], cwd=REPO, capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert errors[0].startswith("train.py: error: "), errors
    return errors[0], run


def test_no_usable_sample_is_one_line_and_writes_data_stats(demo_kit, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": []}\nnot json\n')
    line, run = _train_error(demo_kit, tmp_path, dataset=str(bad))
    assert "--dataset" in line and "no usable samples" in line and "malformed_json" in line
    stats = json.loads((run / "data_stats.json").read_text())
    assert (stats["records"], stats["kept"], stats["rows"]) == (2, 0, 0)
    assert stats["skipped"] == {"malformed_json": 1, "no_assistant_turn": 1}


@pytest.mark.parametrize("where", ["missing_file", "directory_without_jsonl"])
def test_missing_dataset_is_one_line_and_writes_data_stats(demo_kit, tmp_path, where):
    if where == "missing_file":
        data, hint = tmp_path / "nope.jsonl", "no such file"
    else:
        data, hint = tmp_path / "empty", "no .jsonl"
        data.mkdir()
    line, run = _train_error(demo_kit, tmp_path, dataset=str(data))
    assert "--dataset" in line and hint in line
    assert json.loads((run / "data_stats.json").read_text())["records"] == 0


@pytest.mark.parametrize("where", ["nonexistent_dir", "empty_dir", "empty_string", "unknown_hub_id"])
def test_bad_model_id_is_one_line(demo_kit, tmp_path, where):
    model = {
        "nonexistent_dir": str(tmp_path / "no_model"),
        "empty_dir": str(tmp_path),
        "empty_string": "",
        "unknown_hub_id": "nobody-here/no-such-model",
    }[where]
    line, _ = _train_error(demo_kit, tmp_path, model_id=model, env={"HF_HUB_OFFLINE": "1"})
    assert "--model_id" in line and ("hub id" in line or "save_pretrained" in line), line
