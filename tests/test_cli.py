"""train.py's start-up: help without torch documents every flag; a bad model, dataset or runtime-only flag is one
clear line (once from the real process, the rest through main() in this process: same code, no new interpreter).
Argument parsing itself is unit-tested in tests/test_train_flags.py."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, train_py_error
from tests.damaged_checkpoints import DAMAGES, damaged_copy
from tests.train_args import train_args

# The runs of train.py as a program are e2e; the start-up errors run its main() in this process (not e2e).
e2e = pytest.mark.e2e

FLAGS = (
    "--model_id --dataset --recipe --bd_size --ar_loss_weight --ar_only --within_block_causal --loss_weighting "
    "--prefix_gamma --views "
    "--max_length --max_response_length --length_buckets --pack --multiturn --micro_batch_size --grad_accum "
    "--max_steps --lr --warmup --lr_min_ratio --weight_decay --grad_clip --max_nonfinite_steps --seed --save_dir "
    "--save_every "
    "--resume --allow_schedule_change --log_every --activation_checkpointing --activation_offload --fused_ce "
    "--compile --dtype --eval_data --eval_every --eval_samples "
    "--trust_remote_code --wandb --tensorboard"
).split()


@e2e
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


@e2e
def test_an_unknown_hub_id_is_one_line_from_the_program(demo_kit, tmp_path):
    """The real process: exit status, one error line, no traceback (the other start-up errors run main() in
    this process; this one needs HF_HUB_OFFLINE set before huggingface_hub is imported)."""
    args = train_args(demo_kit, tmp_path / "r", model_id="nobody-here/no-such-model", max_length=64)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "train.py", *args], cwd=REPO, capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("train.py: error: --model_id"), proc.stderr[-3000:]
    assert "hub id" in errors[0] or "save_pretrained" in errors[0], errors


def test_runtime_flag_errors_before_training(demo_kit, tmp_path, capfd):
    lines = train_py_error(train_args(demo_kit, tmp_path / "r", activation_offload=True), capfd)
    assert "--activation_offload" in lines[-1]


def _train_error(demo_kit, tmp_path, capfd, *, model_id=None, dataset=None) -> tuple[str, Path]:
    """train.py's main() expecting a start-up error; return (the one error line, the run directory)."""
    run = tmp_path / "r"
    overrides = {name: value for name, value in (("model_id", model_id), ("dataset", dataset)) if value is not None}
    lines = train_py_error(train_args(demo_kit, run, max_length=64, **overrides), capfd)
    assert not any("Traceback" in line for line in lines), lines
    errors = [line for line in lines if "error" in line.lower()]
    assert len(errors) == 1, lines
    assert errors[0].startswith("train.py: error: "), errors
    return errors[0], run


def test_no_usable_sample_is_one_line_and_writes_data_stats(demo_kit, tmp_path, capfd):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": []}\nnot json\n')
    line, run = _train_error(demo_kit, tmp_path, capfd, dataset=str(bad))
    assert "--dataset" in line and "no usable samples" in line and "malformed_json" in line
    stats = json.loads((run / "data_stats.json").read_text())
    assert (stats["records"], stats["kept"], stats["rows"]) == (2, 0, 0)
    assert stats["skipped"] == {"malformed_json": 1, "no_assistant_turn": 1}


@pytest.mark.parametrize("where", ["missing_file", "directory_without_jsonl", "dev_null", "empty_file"])
def test_missing_dataset_is_one_line_and_writes_data_stats(demo_kit, tmp_path, capfd, where):
    if where == "missing_file":
        data, hint = tmp_path / "nope.jsonl", "no such file"
    elif where == "dev_null":  # it exists: "no such file" would send the user looking for a typo
        data, hint = Path(os.devnull), "not a regular file"
    elif where == "empty_file":
        data, hint = tmp_path / "empty.jsonl", "is empty"
        data.write_text("")
    else:
        data, hint = tmp_path / "empty", "no .jsonl"
        data.mkdir()
    line, run = _train_error(demo_kit, tmp_path, capfd, dataset=str(data))
    assert "--dataset" in line and hint in line
    assert json.loads((run / "data_stats.json").read_text())["records"] == 0


@pytest.mark.parametrize("where", ["nonexistent_dir", "empty_dir", "empty_string"])
def test_bad_model_id_is_one_line(demo_kit, tmp_path, capfd, where):
    model = {
        "nonexistent_dir": str(tmp_path / "no_model"),
        "empty_dir": str(tmp_path),
        "empty_string": "",
    }[where]
    line, _ = _train_error(demo_kit, tmp_path, capfd, model_id=model)
    assert "--model_id" in line and ("hub id" in line or "save_pretrained" in line), line


def test_a_bad_float_flag_is_one_line_with_argparse_exit_status(demo_kit, tmp_path, capfd):
    lines = train_py_error(train_args(demo_kit, tmp_path / "r", lr="nan"), capfd, status=2)
    assert lines == [lines[-1]] and lines[-1].startswith("train.py: error: --lr: nan is not a finite number; ")
    assert not (tmp_path / "r").exists()


def _sysfs_dir() -> Path | None:
    """A directory under /sys that root cannot create (sysfs), where this machine mounts sysfs."""
    if not os.path.isdir("/sys/kernel"):
        return None
    probe = Path("/sys/bdstack-test-run")
    try:
        probe.mkdir()
    except OSError:
        return probe
    probe.rmdir()
    return None


@pytest.mark.parametrize("where", ["regular_file", "unwritable"])
def test_a_save_dir_that_cannot_hold_the_run_is_refused_at_start(demo_kit, tmp_path, capfd, where):
    """Refused before any model load, with the flag named; a file given by mistake is left as it was."""
    if where == "regular_file":
        save_dir = tmp_path / "notes.txt"
        save_dir.write_text("keep me")
    else:
        save_dir = _sysfs_dir()
        if save_dir is None:
            pytest.skip("no sysfs here")
    lines = train_py_error(train_args(demo_kit, save_dir), capfd, status=2)
    assert len(lines) == 1 and lines[0].startswith(f"train.py: error: --save_dir: {save_dir} "), lines
    assert ("is not a directory" if where == "regular_file" else "cannot be written") in lines[0]
    if where == "regular_file":
        assert save_dir.read_text() == "keep me"


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_a_damaged_model_directory_is_one_line(demo_kit, tmp_path, capfd, damage):
    """The directories serve.py refuses (tests/test_checkpoint.py) used to end train.py in tracebacks, and a
    missing tokenizer.json in advice to install sentencepiece or tiktoken."""
    model, phrase = damaged_copy(demo_kit / "base_model", tmp_path / "model", damage)
    line, _ = _train_error(demo_kit, tmp_path, capfd, model_id=str(model))
    assert line.startswith("train.py: error: --model_id: ") and phrase in line, line
    assert "installed" not in line, line  # not "You need to have sentencepiece or tiktoken installed"


def test_a_damaged_opd_teacher_is_one_line_naming_its_flag(demo_kit, tmp_path, capfd):
    teacher, phrase = damaged_copy(demo_kit / "base_model", tmp_path / "teacher", "cut_in_tensors")
    lines = train_py_error(train_args(demo_kit, tmp_path / "r", recipe="opd", opd_teacher=teacher), capfd)
    assert not any("Traceback" in line for line in lines), lines
    assert lines[-1].startswith("train.py: error: --opd_teacher: ") and phrase in lines[-1], lines[-1]
