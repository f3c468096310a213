"""Each run directory has a run id that its checkpoints record: a resume refuses another run's checkpoint copied
into it, and keeps working for its own, for checkpoints moved into a directory of their own and for checkpoints
and run directories from before run ids."""

import json
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.conftest import in_process_trainer, run_train
from tests.train_args import train_args
from train.checkpoint import check_resume, resolve_resume, start_run
from train.cli import parse_args
from train.config import FlagError, JobConfig


def _config(save_dir, *extra: str) -> JobConfig:
    argv = ["--model_id", "m", "--dataset", "a.jsonl", "--save_dir", str(save_dir), *extra]
    return JobConfig.from_args(parse_args(argv))


def _new_run(run) -> str:
    run.mkdir(parents=True)
    return start_run(run, None)


def _checkpoint(run, name: str, step: int, run_id: str | None):
    """A complete checkpoint as far as resume reads it: a tiny dcp train state, then the trainer state."""
    state = run / name / "train_state"
    dcp.save({"w": torch.arange(8.0)}, checkpoint_id=str(state), no_dist=True)
    record = {"step": step, "data_position": step, "config": _config(run).resume_flags()}
    if run_id is not None:
        record["run_id"] = run_id
    (state / "trainer_state.json").write_text(json.dumps(record))
    return run / name


@pytest.mark.parametrize("found_by", ["latest", "newest", "its_name"])
def test_another_runs_checkpoint_copied_into_a_run_directory_is_refused(tmp_path, found_by):
    """Another run's checkpoint (same flags) copied in as step_5 resumed silently at its step 7: metrics.jsonl
    then skipped steps 6-7."""
    run, other = tmp_path / "run", tmp_path / "other"
    own_id = _new_run(run)
    _checkpoint(run, "step_4", 4, own_id)
    shutil.copytree(_checkpoint(other, "step_7", 7, _new_run(other)), run / "step_5")
    if found_by == "latest":  # it replaced the run's own step_5
        (run / "latest").write_text("step_5\n")
    resume = run / "step_5" if found_by == "its_name" else run
    with pytest.raises(FlagError) as caught:
        check_resume(_config(run, "--resume", str(resume)))
    message = str(caught.value)
    assert message.startswith(f"--resume: {run / 'step_5'} belongs to another run "), message
    assert "move it out of" in message and "--save_dir" in message and "\n" not in message, message
    assert (run / "step_5" / "train_state" / "trainer_state.json").is_file()  # refused, not deleted
    # Moved out, the run resumes from its own newest checkpoint and goes on under its own id.
    shutil.move(run / "step_5", tmp_path / "step_5")
    (run / "latest").unlink(missing_ok=True)
    point = check_resume(_config(run, "--resume", str(run)))
    assert (point.checkpoint, point.step, point.run_id) == (run / "step_4", 4, own_id)
    assert start_run(run, point) == own_id and (run / "run_id").read_text().strip() == own_id


def test_a_fresh_start_is_a_new_run_and_a_resume_elsewhere_too(tmp_path):
    """A resume keeps its run directory's id; a fresh start in a used directory (metrics.jsonl restarts) makes the
    earlier run's checkpoints foreign; a resume into a new --save_dir continues under a new id."""
    run = tmp_path / "run"
    first = _new_run(run)
    _checkpoint(run, "step_2", 2, first)
    assert check_resume(_config(run, "--resume", str(run))).run_id == first
    elsewhere = check_resume(_config(tmp_path / "branch", "--resume", str(run / "step_2")))
    assert elsewhere.checkpoint == run / "step_2" and elsewhere.run_id is None
    (tmp_path / "branch").mkdir()
    assert start_run(tmp_path / "branch", elsewhere) not in (first, None)
    second = start_run(run, None)
    assert second != first and len(second) == 32
    with pytest.raises(FlagError, match=f"^--resume: {run / 'step_2'} belongs to another run"):
        resolve_resume(run)


def test_checkpoints_without_ids_and_checkpoints_moved_alone_resume(tmp_path):
    """Checkpoints and run directories from before run ids are not checked; a checkpoint moved by itself into a
    directory of its own resumes, and that directory takes its id (a later resume must not call it foreign)."""
    old = tmp_path / "old"
    _checkpoint(old, "step_3", 3, None)
    point = check_resume(_config(old, "--resume", str(old)))
    assert (point.step, point.run_id) == (3, None)
    start_run(old, point)  # the old run goes on under a new id; its id-less checkpoints still resume
    assert resolve_resume(old) == old / "step_3"

    run, moved = tmp_path / "run", tmp_path / "moved"
    run_id = _new_run(run)
    moved.mkdir()
    shutil.copytree(_checkpoint(run, "final", 6, run_id), moved / "final")
    point = check_resume(_config(moved, "--resume", str(moved)))
    assert (point.checkpoint, point.run_id) == (moved / "final", run_id)
    assert start_run(moved, point) == run_id
    assert resolve_resume(moved) == moved / "final"


def test_a_malformed_run_id_is_one_line_naming_its_file(tmp_path):
    run = tmp_path / "run"
    _checkpoint(run, "step_1", 1, _new_run(run))
    (run / "run_id").write_bytes(b"\xff not an id\n")
    with pytest.raises(FlagError, match=f"^--resume: {run / 'run_id'} holds .*, not a run id .*delete it") as caught:
        check_resume(_config(run, "--resume", str(run)))
    assert "\n" not in str(caught.value)
    # In a trainer state, a run id of the wrong form is damage: passed over like a cut file.
    _checkpoint(run, "step_2", 2, "5")
    (run / "run_id").unlink()
    point = check_resume(_config(run, "--resume", str(run)))
    assert point.step == 1 and "run_id '5', not a run id" in point.warnings[0]


@pytest.mark.e2e
def test_train_py_records_the_run_id_and_refuses_another_runs_checkpoint(demo_kit, tmp_path):
    """End to end: every checkpoint train.py writes records its run directory's id, and `--resume RUN_DIR` whose
    newest checkpoint is another run's (same flags) stops with one line instead of continuing it."""
    run, other = tmp_path / "run", tmp_path / "other"
    for directory in (run, other):
        run_train(train_args(demo_kit, directory, max_steps=1))
    run_id = (run / "run_id").read_text().strip()
    assert json.loads((run / "final" / "train_state" / "trainer_state.json").read_text())["run_id"] == run_id
    shutil.rmtree(run / "final")
    shutil.copytree(other / "final", run / "final")  # the same flags, seed and step: only the run id differs
    # In this process (not train_py_error: a resume that went through would end pytest in main()'s os._exit(0)).
    with pytest.raises(FlagError, match=f"^--resume: {run / 'final'} belongs to another run") as caught:
        with in_process_trainer(train_args(demo_kit, run, max_steps=1, resume=run)):
            pass
    assert "\n" not in str(caught.value)
