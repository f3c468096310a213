"""`train.py --recipe`: one choice of what a run trains (train/recipes.py). The older switches map onto it,
conflicting choices and the flags of another recipe are refused by name, every flag's default is its config
field's (written once), and a resume refuses another recipe, also against checkpoints that predate --recipe.
Unit tests: no program run, no model loaded. The trainer's step per recipe is checked where a trainer is
built (tests/test_opd_trainer.py, tests/test_nonfinite_guard.py, tests/test_train_e2e.py)."""

import json
from dataclasses import MISSING, fields

import pytest

from train.checkpoint import TRAIN_STATE, TRAINER_STATE, check_resume
from train.cli import build_parser, parse_args
from train.config import (
    RECIPES,
    BlockDiffusionConfig,
    CheckpointSection,
    DataSection,
    EfficiencySection,
    EvalSection,
    FlagError,
    JobConfig,
    LoggingSection,
    LoraSection,
    ModelSection,
    OPDSection,
    OptimSection,
    RLSection,
    TrainingSection,
)

BASE = ["--model_id", "m", "--dataset", "d.jsonl", "--save_dir", "out"]
SECTIONS = (
    ModelSection,
    BlockDiffusionConfig,
    DataSection,
    TrainingSection,
    OptimSection,
    CheckpointSection,
    LoggingSection,
    EfficiencySection,
    LoraSection,
    EvalSection,
    OPDSection,
    RLSection,
)
# Flags that default to None and are resolved by validate() (to the field's default where nothing else decides).
RESOLVED = {"recipe", "views", "ar_loss_weight", "lr", "opd_ar_weight", "prefix_gamma", "draft_loss"}


def _config(*extra: str) -> JobConfig:
    return JobConfig.from_args(parse_args([*BASE, *extra]))


@pytest.mark.parametrize(
    "argv, recipe",
    [
        ([], "sft"),
        *[(["--recipe", name], name) for name in RECIPES],
        (["--ar_only"], "ar_sft"),
        (["--opd_on_policy"], "opd"),
        (["--rl_diffusion_rollout"], "rl"),
        (["--rl_diffusion_rollout", "--rl_rollout_mode", "causal"], "rl"),  # any rollout mode is the rl recipe
        (["--recipe", "opd", "--opd_on_policy"], "opd"),  # the same choice twice
    ],
)
def test_the_recipe_is_one_choice_recorded_once(argv, recipe):
    config = _config(*argv)
    assert config.training.recipe == recipe
    assert config.flags()["recipe"] == recipe and config.resume_flags()["recipe"] == recipe
    for switch in ("ar_only", "opd_on_policy", "rl_diffusion_rollout"):
        assert switch not in config.flags(), "the recipe is the one record of the choice"
    assert config.diffusion.ar_only == (recipe == "ar_sft")


@pytest.mark.parametrize(
    "switch, recipe", [("--ar_only", "ar_sft"), ("--opd_on_policy", "opd"), ("--rl_diffusion_rollout", "rl")]
)
def test_an_older_switch_is_its_recipe(switch, recipe):
    assert _config(switch) == _config("--recipe", recipe)


@pytest.mark.parametrize(
    "argv, named, other",
    [
        (["--recipe", "sft", "--ar_only"], "--ar_only", "--recipe sft"),
        (["--recipe", "rl", "--opd_on_policy"], "--opd_on_policy", "--recipe rl"),
        (["--opd_on_policy", "--rl_diffusion_rollout"], "--rl_diffusion_rollout", "--opd_on_policy"),
        (["--ar_only", "--opd_on_policy"], "--opd_on_policy", "--ar_only"),
    ],
)
def test_conflicting_choices_are_refused_with_the_reason(argv, named, other):
    with pytest.raises(FlagError, match=f"^{named}: is --recipe .*, but {other}.* was given too; a run trains one"):
        parse_args(BASE + argv)


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--ar_only", "--views", "2"], "--views"),
        (["--recipe", "ar_sft", "--ar_loss_weight", "0.5"], "--ar_loss_weight"),
        (["--recipe", "ar_sft", "--loss_weighting", "inverse_rate"], "--loss_weighting"),
        (["--recipe", "ar_sft", "--prefix_gamma", "4"], "--prefix_gamma"),
    ],
)
def test_plain_ar_sft_refuses_what_shapes_the_diffusion_loss(argv, named):
    """These were silently overridden (views 0, w 1) before --recipe."""
    with pytest.raises(FlagError, match=f"^{named}: shapes the block-diffusion loss, which {argv[0]}"):
        parse_args(BASE + argv)


@pytest.mark.parametrize(
    "argv, flag, owner, run",
    [
        (["--opd_threshold", "0.5"], "--opd_threshold", "opd", r"--recipe sft \(the default\)"),
        (["--opd_ar_weight", "0"], "--opd_ar_weight", "opd", "--recipe sft"),  # resolved, yet given
        (["--recipe", "sft", "--rl_token_level"], "--rl_token_level", "rl", "--recipe sft"),
        (["--recipe", "rl", "--opd_slots", "masked"], "--opd_slots", "opd", "--recipe rl"),
        (["--opd_on_policy", "--rl_reward", "gsm8k"], "--rl_reward", "rl", r"--recipe opd \(chosen by --opd_on_policy"),
        (["--ar_only", "--rl_kl_weight", "0.1"], "--rl_kl_weight", "rl", r"--recipe ar_sft \(chosen by --ar_only"),
    ],
)
def test_a_flag_of_another_recipe_is_refused_by_name(argv, flag, owner, run):
    with pytest.raises(FlagError, match=f"^{flag}: is a flag of --recipe {owner} .*this run trains {run}"):
        parse_args(BASE + argv)


def test_another_recipe_s_flag_at_its_default_changes_nothing_and_passes():
    """Given means 'not at the parser default' (train/recipes.py): the default, spelled out, is no conflict."""
    assert _config("--recipe", "sft", "--opd_threshold", "0.9", "--rl_group_size", "8") == _config()


def test_every_flag_defaults_to_its_config_field():
    """Each default is written once, in train/config.py: a default changed on one side alone fails here."""
    parser = build_parser()
    dests = {a.dest for a in parser._actions} - {"help", "ar_only", "opd_on_policy", "rl_diffusion_rollout"}
    fields_by_name = {f.name: f for section in SECTIONS for f in fields(section)}
    assert dests <= set(fields_by_name), f"flags that are no config field: {dests - set(fields_by_name)}"
    for name in dests:
        default, want = parser.get_default(name), fields_by_name[name].default
        if name in RESOLVED:
            assert default is None, name
        elif want is MISSING:
            assert default is None and name in ("model_id", "dataset", "save_dir"), name
        else:
            assert default == want and type(default) is type(want), (name, default, want)
    # and what validate() resolves the None ones to, for a plain run, is the field's default too
    config = _config()
    plain = dict(model_id="m", dataset="d.jsonl", save_dir="out")
    for part, section in zip(
        (config.model, config.diffusion, config.data, config.training, config.optim, config.checkpoint),
        SECTIONS[:6],
    ):
        assert part == section(**{k: v for k, v in plain.items() if k in {f.name for f in fields(section)}})
    parts = (config.logging, config.efficiency, config.lora, config.evaluation, config.opd, config.rl)
    assert parts == tuple(section() for section in SECTIONS[6:])


def _checkpoint(run, recorded: dict):
    """A complete checkpoint directory as far as check_resume reads it: an intact (tiny) train state, then the
    trainer state and its flags."""
    import torch
    import torch.distributed.checkpoint as dcp

    state = run / "step_2" / TRAIN_STATE
    dcp.save({"w": torch.zeros(4)}, checkpoint_id=str(state), no_dist=True)
    (state / TRAINER_STATE).write_text(json.dumps({"step": 2, "data_position": 2, "config": recorded}))
    return run / "step_2"


def test_a_resume_refuses_another_recipe(tmp_path):
    opd = _config("--recipe", "opd")
    ckpt = _checkpoint(tmp_path / "run", opd.resume_flags())
    assert check_resume(_config("--opd_on_policy", "--resume", str(ckpt))).step == 2
    with pytest.raises(FlagError, match="^--resume: .*--recipe opd -> sft"):
        check_resume(_config("--resume", str(ckpt)))


def test_a_checkpoint_from_before_recipe_is_read_by_its_switches(tmp_path):
    """Checkpoints written before --recipe record `opd_on_policy` etc. and no `recipe`."""
    recorded = {k: v for k, v in _config("--recipe", "rl").resume_flags().items() if k != "recipe"}
    ckpt = _checkpoint(tmp_path / "run", {**recorded, "rl_diffusion_rollout": True, "opd_on_policy": False})
    assert check_resume(_config("--recipe", "rl", "--resume", str(ckpt))).step == 2
    with pytest.raises(FlagError, match="^--resume: .*--recipe rl -> opd"):
        check_resume(_config("--recipe", "opd", "--resume", str(ckpt)))


def test_a_state_that_records_no_flags_resumes_under_any_recipe(tmp_path):
    """A trainer state without `config` (nothing recorded to compare) is checked against nothing: it must
    not be read as a checkpoint of the default recipe and refuse --recipe rl."""
    state = _checkpoint(tmp_path / "run", {}) / TRAIN_STATE
    (state / TRAINER_STATE).write_text(json.dumps({"step": 2, "data_position": 2}))  # no `config` at all
    for recipe in ("rl", "opd", "sft"):
        assert check_resume(_config("--recipe", recipe, "--resume", str(state.parent))).step == 2
