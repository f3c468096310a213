"""Checkpoints are atomic: a crash mid-save leaves the previous checkpoint and `latest` intact; a damaged
checkpoint is refused in one line that names the file and the fix."""

import json
import os
import re
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from bdcore.sidecar import Sidecar, SidecarError, read_sidecar
from data.toy_tokenizer import build_char_tokenizer
from tests.damaged_checkpoints import DAMAGES, damaged_copy
from tests.tiny import tiny_model
from train.checkpoint import check_resume, load_train_state, resolve_resume, save_checkpoint
from train.cli import parse_args
from train.config import BlockDiffusionConfig, FlagError, JobConfig
from train.model import TwoStreamLM
from train.optim import build_optimizer
from train.parallel import fsdp_shard, init_distributed


@pytest.fixture
def one_rank():
    env = dict(os.environ)
    info = init_distributed()
    yield info
    dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(env)


class Crash(Exception):
    pass


def test_killed_save_leaves_previous_checkpoint_intact(one_rank, tmp_path):
    tok = build_char_tokenizer()
    lm = TwoStreamLM(tiny_model("qwen3", vocab=len(tok)), BlockDiffusionConfig(bd_size=4))
    fsdp_shard(lm, lm.model.get_decoder().layers, None)
    opt = build_optimizer(lm, lr=1e-3, weight_decay=0.0)
    kw = dict(model=lm, optimizer=opt, tokenizer=tok, info=one_rank, save_dtype=torch.float32)
    sc = Sidecar(bd_size=4, mask_id=0, global_step=1)
    save_checkpoint(tmp_path, "step_1", sidecar=sc, trainer_state={"step": 1, "data_position": 7}, **kw)
    snapshot = {k: v.full_tensor().clone() for k, v in lm.state_dict().items()}

    with torch.no_grad():
        for p in lm.parameters():
            p.add_(1.0)

    def crash():
        raise Crash

    with pytest.raises(Crash):
        save_checkpoint(
            tmp_path, "step_2", sidecar=sc, trainer_state={"step": 2, "data_position": 9}, before_commit=crash, **kw
        )
    assert not (tmp_path / "step_2").exists() and (tmp_path / ".tmp-step_2").exists()
    ckpt = resolve_resume(tmp_path)
    assert ckpt.name == "step_1"
    state = load_train_state(ckpt, lm, opt, one_rank)
    assert state["step"] == 1 and state["data_position"] == 7
    for k, v in lm.state_dict().items():
        torch.testing.assert_close(v.full_tensor(), snapshot[k])
    assert read_sidecar(ckpt).global_step == 1
    # The next complete save of the same name replaces the debris.
    save_checkpoint(tmp_path, "step_2", sidecar=sc, trainer_state={"step": 2, "data_position": 9}, **kw)
    assert resolve_resume(tmp_path).name == "step_2" and not (tmp_path / ".tmp-step_2").exists()


def test_sidecar_rejects_unknown_version_and_mismatched_mask(tmp_path):
    tok = build_char_tokenizer()
    tok.add_tokens(["<|mask|>"], special_tokens=True)
    mid = tok.convert_tokens_to_ids("<|mask|>")
    (tmp_path / "block_diffusion.json").write_text(Sidecar(bd_size=8, mask_id=mid).to_json())
    read_sidecar(tmp_path).check_tokenizer(tok)
    (tmp_path / "block_diffusion.json").write_text(Sidecar(bd_size=8, mask_id=mid - 1).to_json())
    with pytest.raises(SidecarError, match="disagrees with the tokenizer"):
        read_sidecar(tmp_path).check_tokenizer(tok)
    (tmp_path / "block_diffusion.json").write_text('{"format_version": 9, "bd_size": 8, "mask_id": 1}')
    with pytest.raises(SidecarError, match="format_version 9"):
        read_sidecar(tmp_path)
    (tmp_path / "block_diffusion.json").unlink()
    with pytest.raises(SidecarError, match="not found"):
        read_sidecar(tmp_path)


class Kill(BaseException):
    """A kill: nothing after it runs, not even `except Exception` clean-up."""


FS_STEPS = ((os, "rename"), (os, "replace"), (os, "unlink"), (os, "remove"), (os, "rmdir"), (shutil, "rmtree"))


def _kill_at(monkeypatch, k: int) -> list[int]:
    """Let k filesystem mutations happen, then kill the process before the next one (and every later one:
    the process is dead, whatever a library's error handling would do next). Returns [steps done]."""
    done = [0]

    def wrap(fn):
        def step(*args, **kwargs):
            if done[0] >= k:
                raise Kill
            done[0] += 1
            return fn(*args, **kwargs)

        return step

    for module, name in FS_STEPS:
        monkeypatch.setattr(module, name, wrap(getattr(module, name)))
    return done


def _weights(lm) -> dict:
    return {k: v.full_tensor().clone() for k, v in lm.state_dict().items()}


def _bump(lm) -> dict:
    """Change every weight; return the new weights."""
    with torch.no_grad():
        for p in lm.parameters():
            p.add_(1.0)
    return _weights(lm)


def _kill_during_save(monkeypatch, k: int, run, name: str, state: dict, kw) -> bool:
    with monkeypatch.context() as m:
        done = _kill_at(m, k)
        try:
            save_checkpoint(run, name, trainer_state=state, **kw)
        except BaseException:  # torch.distributed.checkpoint wraps what it catches
            if done[0] < k:
                raise
            return False
    return True


@pytest.mark.parametrize("previous", ["final", "step_1", None])
@pytest.mark.e2e
def test_a_kill_at_any_step_of_a_save_leaves_the_run_resumable(one_rank, tmp_path, monkeypatch, previous):
    tok = build_char_tokenizer()
    lm = TwoStreamLM(tiny_model("qwen3", vocab=len(tok)), BlockDiffusionConfig(bd_size=4))
    fsdp_shard(lm, lm.model.get_decoder().layers, None)
    opt = build_optimizer(lm, lr=1e-3, weight_decay=0.0)
    kw = dict(model=lm, optimizer=opt, tokenizer=tok, info=one_rank, sidecar=None, save_dtype=torch.float32)
    for k in range(200):
        run = tmp_path / f"kill_{k}"
        run.mkdir()
        weights_at = {1: _bump(lm)}
        if previous is not None:
            save_checkpoint(run, previous, trainer_state={"step": 1, "data_position": 1}, **kw)
        weights_at[2] = _bump(lm)
        finished = _kill_during_save(monkeypatch, k, run, "final", {"step": 2, "data_position": 2}, kw)
        if not any((d / "train_state" / "trainer_state.json").is_file() for d in run.iterdir()):
            assert previous is None and not finished, k  # killed before the first checkpoint was complete
            continue
        if previous == "final":  # --resume run/final, named while a kill had it renamed aside
            assert (resolve_resume(run / "final") / "train_state" / "trainer_state.json").is_file(), k
        ckpt = resolve_resume(run)
        assert (ckpt / "config.json").is_file() and (ckpt / "model.safetensors").is_file(), (k, ckpt)
        state = load_train_state(ckpt, lm, opt, one_rank)
        assert state["step"] in (1, 2) and state["data_position"] == state["step"], (k, state)
        for name, v in lm.state_dict().items():
            torch.testing.assert_close(v.full_tensor(), weights_at[state["step"]][name])
        # The run goes on: the next save of the same name succeeds and is what resume finds.
        save_checkpoint(run, "final", trainer_state={"step": 3, "data_position": 3}, **kw)
        assert resolve_resume(run) == run / "final"
        assert load_train_state(run / "final", lm, opt, one_rank)["step"] == 3
        if finished:
            assert k > 3, "the save has several filesystem steps; each was killed in turn"
            return
    raise AssertionError("the save never finished")


def test_one_rank_saves_and_loads_without_object_collectives(one_rank, tmp_path, monkeypatch):
    """With one rank, dcp runs no collectives: on CPU they left a gloo work thread behind, after which
    libgomp's threads slept at every barrier and every later step of a 2-core run was 1.3-1.6x slower."""
    tok = build_char_tokenizer()
    lm = TwoStreamLM(tiny_model("qwen3", vocab=len(tok)), BlockDiffusionConfig(bd_size=4))
    fsdp_shard(lm, lm.model.get_decoder().layers, None)
    opt = build_optimizer(lm, lr=1e-3, weight_decay=0.0)
    snapshot = {k: v.full_tensor().clone() for k, v in lm.state_dict().items()}

    def refuse(*args, **kwargs):
        raise AssertionError("an object collective in a one-rank save or load")

    for name in ("gather_object", "all_gather_object", "broadcast_object_list", "scatter_object_list"):
        monkeypatch.setattr(dist, name, refuse)
    kw = dict(model=lm, optimizer=opt, tokenizer=tok, info=one_rank, save_dtype=torch.float32)
    sidecar = Sidecar(bd_size=4, mask_id=0, global_step=1)
    save_checkpoint(tmp_path, "step_1", sidecar=sidecar, trainer_state={"step": 1, "data_position": 1}, **kw)
    with torch.no_grad():
        for p in lm.parameters():
            p.add_(1.0)
    assert load_train_state(resolve_resume(tmp_path), lm, opt, one_rank)["step"] == 1
    for k, v in lm.state_dict().items():
        torch.testing.assert_close(v.full_tensor(), snapshot[k])


def _train_state_only(run, name: str, step: int, flags: dict | None = None):
    """A complete checkpoint as far as resume reads it: a real (tiny) dcp train state, then the completion mark."""
    state = run / name / "train_state"
    dcp.save({"w": torch.arange(64.0)}, checkpoint_id=str(state), no_dist=True)
    marker = {"step": step, "data_position": step, "config": flags or {}}
    (state / "trainer_state.json").write_text(json.dumps(marker))
    return run / name


@pytest.mark.parametrize("latest", ["another_run", "climbs_out", "not_utf8"])
def test_latest_must_name_a_checkpoint_of_its_own_run(tmp_path, latest):
    """`latest` naming another run's step_8 was followed silently: its metrics.jsonl then missed steps."""
    other, run = tmp_path / "other", tmp_path / "run"
    _train_state_only(other, "step_8", 8)
    _train_state_only(run, "step_2", 2)
    text = {"another_run": f"{other / 'step_8'}\n", "climbs_out": "../other/step_8\n"}.get(latest)
    if text is None:
        (run / "latest").write_bytes(b"\xff\xfestep_2\n")
    else:
        (run / "latest").write_text(text)
    with pytest.raises(FlagError, match=f"^--resume: {run / 'latest'} "):
        resolve_resume(run)


def _truncate(ckpt):
    shard = ckpt / "train_state" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])


def _config(run, *extra: str) -> JobConfig:
    return JobConfig.from_args(parse_args(["--model_id", "m", "--dataset", "a.jsonl", "--save_dir", str(run), *extra]))


def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_complete_one(tmp_path):
    """A truncated shard of the newest step gave EOFError with no fallback."""
    run = tmp_path / "run"
    _train_state_only(run, "step_1", 1)
    _train_state_only(run, "step_2", 2)
    (run / "latest").write_text("step_2\n")
    _truncate(run / "step_2")
    warnings = []
    assert resolve_resume(run, warn=warnings.append) == run / "step_1"
    assert len(warnings) == 1 and str(run / "step_2") in warnings[0] and "damaged" in warnings[0], warnings
    point = check_resume(_config(run, "--resume", str(run)))
    assert point.step == 1 and point.warnings == tuple(warnings)
    # Named by itself, a damaged checkpoint is refused (pointing at the intact one); with none intact, so is the run.
    with pytest.raises(FlagError, match=f"^--resume: {run / 'step_2'} is damaged .*{run / 'step_1'}"):
        resolve_resume(run / "step_2")
    _truncate(run / "step_1")
    with pytest.raises(FlagError, match=f"^--resume: {run} holds no intact checkpoint"):
        resolve_resume(run)


TRAINER_STATE_DAMAGES = {  # how each leaves trainer_state.json, and the words the warning gives for it
    "cut": (lambda f: f.write_bytes(f.read_bytes()[:100]), "is not valid JSON"),
    "not_json": (lambda f: f.write_bytes(b"\xff\xfe{"), "is not valid JSON"),
    "nested": (lambda f: f.write_text("[" * 100_000), "is not valid JSON"),
    "wrong_type": (lambda f: f.write_text(json.dumps({"step": "2", "data_position": 2})), "step '2', not a count"),
    "not_an_object": (lambda f: f.write_text("[2]"), "holds [2], not an object"),
    "missing": (lambda f: f.unlink(), "is missing"),
}


@pytest.mark.parametrize("damage", sorted(TRAINER_STATE_DAMAGES))
def test_a_damaged_trainer_state_falls_back_to_the_previous_checkpoint(tmp_path, damage):
    """The newest trainer_state.json cut to 100 bytes stopped a resume with a JSONDecodeError traceback."""
    run = tmp_path / "run"
    flags = _config(run).resume_flags()  # a real record: far longer than the 100 bytes kept of it
    for step in (1, 2):
        _train_state_only(run, f"step_{step}", step, flags)
    (run / "latest").write_text("step_2\n")
    spoil, words = TRAINER_STATE_DAMAGES[damage]
    spoil(run / "step_2" / "train_state" / "trainer_state.json")
    point = check_resume(_config(run, "--resume", str(run)))
    assert point.checkpoint == run / "step_1" and point.step == 1
    (warning,) = point.warnings
    assert warning.startswith(f"--resume: {run / 'step_2'} is damaged (train_state/trainer_state.json "), warning
    assert words in warning and "\n" not in warning, warning
    refused = f"^--resume: {run / 'step_2'} is damaged .*{re.escape(words)}.*{run / 'step_1'}"
    with pytest.raises(FlagError, match=refused):
        resolve_resume(run / "step_2")  # named by itself: refused, pointing at the intact one
    spoil(run / "step_1" / "train_state" / "trainer_state.json")
    (run / "latest").write_text("step_1\n")
    with pytest.raises(FlagError) as caught:
        check_resume(_config(run, "--resume", str(run)))
    message = str(caught.value)
    assert message.startswith(f"--resume: {run} holds no intact checkpoint"), message
    assert f"{run / 'step_1'}: train_state/trainer_state.json" in message and words in message, message
    assert "start the run again without --resume" in message and "\n" not in message, message


@pytest.mark.parametrize("flag, old, new", [("dataset", "a.jsonl", "b.jsonl"), ("max_response_length", None, 64)])
def test_a_resume_refuses_another_data_order(tmp_path, flag, old, new):
    """Another --dataset (or a flag that drops other samples) reorders every row after the resumed step."""
    run = tmp_path / "run"
    given = [f"--{flag}={old}"] if old is not None else []
    ckpt = _train_state_only(run, "step_2", 2, _config(run, *given).resume_flags())
    assert check_resume(_config(run, *given, "--resume", str(ckpt))).step == 2
    with pytest.raises(FlagError, match=f"^--resume: .*--{flag} {old} -> {new}"):
        check_resume(_config(run, f"--{flag}={new}", "--resume", str(ckpt)))


def test_a_train_state_that_fails_to_load_is_one_clear_error(one_rank, tmp_path):
    """Damage its files' sizes do not show (here a cut RNG file) stops the resume with the checkpoint named."""
    tok = build_char_tokenizer()
    lm = TwoStreamLM(tiny_model("qwen3", vocab=len(tok)), BlockDiffusionConfig(bd_size=4))
    fsdp_shard(lm, lm.model.get_decoder().layers, None)
    opt = build_optimizer(lm, lr=1e-3, weight_decay=0.0)
    kw = dict(model=lm, optimizer=opt, tokenizer=tok, info=one_rank, sidecar=None, save_dtype=torch.float32)
    ckpt = save_checkpoint(tmp_path, "step_1", trainer_state={"step": 1, "data_position": 1}, **kw)
    rng = ckpt / "train_state" / "rng_rank0.pt"
    rng.write_bytes(rng.read_bytes()[:100])
    with pytest.raises(FlagError, match=f"^--resume: {ckpt} cannot be loaded \\(.*\\); resume from an earlier"):
        load_train_state(resolve_resume(tmp_path), lm, opt, one_rank)


@pytest.fixture(scope="module")
def servable(tmp_path_factory):
    from tests.tiny import tiny_checkpoint

    return tiny_checkpoint(tmp_path_factory.mktemp("servable"))


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_a_damaged_checkpoint_is_one_error_naming_the_file_and_the_fix(servable, tmp_path, damage):
    """Truncated, empty or huge-header weights, a malformed config, a vocab_size the weights disagree with, no
    tokenizer files: each a `CheckpointError` (serve.py prints it as one line), never a library traceback."""
    from bdcore.loading import CheckpointError, load_checkpoint

    changed, phrase = damaged_copy(servable, tmp_path / damage, damage)
    with pytest.raises(CheckpointError, match=re.escape(phrase)) as caught:
        load_checkpoint(changed)
    message = str(caught.value)
    assert "\n" not in message and str(changed) in message, message
    assert "re-save or re-download" in message or "copy them" in message, message


def test_a_missing_shard_of_an_index_is_named(servable, tmp_path):
    from bdcore.checkpoint_files import safetensors_header
    from bdcore.loading import CheckpointError, load_checkpoint

    changed = tmp_path / "sharded"
    shutil.copytree(servable, changed)
    (changed / "model.safetensors").rename(changed / "model-00001-of-00002.safetensors")
    keys = list(safetensors_header(changed / "model-00001-of-00002.safetensors"))
    index = {"weight_map": {k: "model-00001-of-00002.safetensors" for k in keys if k != "__metadata__"}}
    index["weight_map"]["lm_head.weight"] = "model-00002-of-00002.safetensors"
    (changed / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="missing: model-00002-of-00002.safetensors"):
        load_checkpoint(changed)


def test_sidecar_sizes_are_bounded_by_the_model(servable, tmp_path):
    """A bd_size of 10**9 was accepted, and the first request grew the server to 21 GB until it was killed."""
    from bdcore.loading import load_checkpoint

    changed = tmp_path / "big"
    shutil.copytree(servable, changed)
    data = json.loads((changed / "block_diffusion.json").read_text())
    (changed / "block_diffusion.json").write_text(json.dumps({**data, "bd_size": 10**9}))
    read_sidecar(changed)  # an integer >= 2: the bound is the model's
    with pytest.raises(SidecarError, match="bd_size 1000000000 exceeds the model's context length 1024"):
        load_checkpoint(changed)
    # a mask id the tokenizer has but the weights have no row for (an HF config object reads alike)
    config = {"text_config": {"vocab_size": 99, "max_position_embeddings": 1024}}
    with pytest.raises(SidecarError, match="mask_id 99 is outside the model's embedding"):
        Sidecar(bd_size=4, mask_id=99).check_model(config)
    Sidecar(bd_size=4, mask_id=98).check_model(config)


def test_a_resume_takes_one_dataset_spelled_two_ways(tmp_path, monkeypatch):
    """The same file given as a relative and as an absolute path is the same data order."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d.jsonl").write_text("{}\n")
    run = tmp_path / "run"
    ckpt = _train_state_only(run, "step_2", 2, _config(run, "--dataset=d.jsonl").resume_flags())
    assert check_resume(_config(run, f"--dataset={tmp_path / 'd.jsonl'}", "--resume", str(ckpt))).step == 2
    assert check_resume(_config(run, "--dataset=./d.jsonl", "--resume", str(ckpt))).step == 2
