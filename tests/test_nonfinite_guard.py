"""Training never applies a non-finite update and never saves non-finite weights (issue: a NaN reward exited
0 with every saved tensor NaN). A step whose loss or gradient norm is NaN is skipped and counted, a few in a
row stop the run with one line, a save of non-finite weights is refused with nothing written, and a reward
that returns NaN, text or raises stops `train.py` with a line that names `--rl_reward`."""

import json
import math

import pytest
import torch

from tests.conftest import in_process_trainer, read_metrics, train_py_error
from tests.train_args import train_args
from train.checkpoint import LATEST
from train.config import FlagError
from train.trainer import SupervisedOnly

pytestmark = pytest.mark.e2e  # builds the trainer and runs train.py


def _trainer(kit, run, **flags):
    return in_process_trainer(train_args(kit, run, lr="1e-3", **flags))


def _poison_sft_at(trainer, steps):
    """The SFT loss of the given steps becomes NaN (as a NaN reward or a diverged forward would make it)."""
    real = trainer._sft_backward

    def backward(sums, weight, *, sync_last):
        return real(sums, float("nan") if trainer.step in steps else weight, sync_last=sync_last)

    trainer._sft_backward = backward


def _weights(trainer):
    return {n: p.detach().to_local().clone() for n, p in trainer.model.named_parameters()}


def _adam_moments(trainer):
    return [s["exp_avg"].to_local().clone() for s in trainer.optimizer.state.values()]


def test_a_nonfinite_step_is_skipped_counted_and_the_run_goes_on(demo_kit, tmp_path):
    run = tmp_path / "run"
    with _trainer(demo_kit, run, max_steps=3) as trainer:
        assert isinstance(trainer.recipe, SupervisedOnly) and trainer.config.training.recipe == "sft"
        assert json.loads((run / "run_config.json").read_text())["recipe"] == "sft"
        _poison_sft_at(trainer, {1})
        first = trainer.train_step()
        assert not first.skipped and math.isfinite(first.loss)
        before, moments = _weights(trainer), _adam_moments(trainer)
        second = trainer.train_step()
        assert second.skipped and math.isnan(second.loss)
        after = _weights(trainer)
        assert all(torch.equal(after[n], before[n]) for n in before), "a skipped step changed the weights"
        assert all(torch.equal(a, b) for a, b in zip(_adam_moments(trainer), moments)), "or the optimizer state"
        assert trainer.metrics_record(second)["skipped_steps"] == 1
        third = trainer.train_step()
        assert not third.skipped and trainer.nonfinite_in_a_row == 0
        assert any(not torch.equal(p, before[n]) for n, p in _weights(trainer).items()), "training goes on"
        assert trainer.step == 3 and trainer.skipped_steps == 1


def test_nonfinite_steps_in_a_row_stop_the_run_and_nothing_is_saved(demo_kit, tmp_path):
    run = tmp_path / "run"
    with _trainer(demo_kit, run, max_steps=6, max_nonfinite_steps=2) as trainer:
        _poison_sft_at(trainer, {1, 2, 3, 4, 5})
        with pytest.raises(FlagError, match="2 steps in a row had a non-finite loss"):
            trainer.train()
        assert trainer.step == 3, "the run stops at the second non-finite step in a row"
        assert not (run / "final").exists()
        records = read_metrics(run)
        assert records[2]["skipped_steps"] == 1 and math.isnan(records[2]["loss"])
        assert records[3]["skipped_steps"] == 2, "the step that stops the run is logged too"


def test_a_checkpoint_with_nonfinite_weights_is_never_written(demo_kit, tmp_path):
    run = tmp_path / "run"
    with _trainer(demo_kit, run, max_steps=2) as trainer:
        trainer.train_step()
        trainer.save("step_1")
        with torch.no_grad():
            next(trainer.model.parameters()).to_local()[0].fill_(float("nan"))
        with pytest.raises(FlagError, match="hold NaN or inf"):
            trainer.save("step_2")
        assert not (run / "step_2").exists() and not (run / ".tmp-step_2").exists()
        assert (run / LATEST).read_text().strip() == "step_1"


@pytest.mark.parametrize(
    "reward, says",
    [
        ("nan_reward", "returned nan, not a finite number"),
        ("text_reward", "returned '1.0', not a finite number"),
        ("raising_reward", "raised KeyError"),
    ],
)
def test_a_bad_reward_stops_train_py_with_one_line_and_no_checkpoint(demo_kit, tmp_path, capfd, reward, says):
    run = tmp_path / reward
    rl = dict(rl_diffusion_rollout=True, rl_group_size=2, rl_prompts_per_step=1, rl_max_new_tokens=4)
    lines = train_py_error(train_args(demo_kit, run, max_steps=1, rl_reward=f"tests.rl_task:{reward}", **rl), capfd)
    last = lines[-1]
    assert last.startswith("train.py: error: --rl_reward: the reward tests.rl_task:") and says in last, last
    assert not any("Traceback" in line for line in lines), lines
    assert not (run / "final").exists()
    assert json.loads((run / "run_config.json").read_text())["recipe"] == "rl"  # --rl_diffusion_rollout's
