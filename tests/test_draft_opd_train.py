"""`train.py --recipe opd --opd_rollout self-spec` end to end, after an SFT run of a draft adapter: the stage
continues the SFT checkpoint's adapter, trains it on the served decoder's verifies, keeps the base model bit
for bit, reports the acceptance it rolled out with; flags that cannot work are refused in one line."""

import pytest
import torch
from safetensors.torch import load_file

from bdcore.draft_adapter import ADAPTER_DIR, MASK_ROW, MASK_ROW_FILE
from tests.conftest import read_metrics, run_train, train_py_error
from tests.train_args import train_args

pytestmark = pytest.mark.e2e  # a whole program, server or long sweep: `pytest -m 'not e2e'` skips it

ADAPTER = dict(draft_adapter=True, lora_rank=4)
STAGE = dict(recipe="opd", opd_rollout="self-spec", opd_prompts_per_step=2, opd_max_new_tokens=12, **ADAPTER)


def _adapter(final):
    return {
        **load_file(str(final / ADAPTER_DIR / "adapter_model.safetensors")),
        MASK_ROW: load_file(str(final / ADAPTER_DIR / MASK_ROW_FILE))[MASK_ROW],
    }


@pytest.fixture(scope="module")
def sft(demo_kit, tmp_path_factory):
    run = tmp_path_factory.mktemp("sft") / "run"
    run_train(train_args(demo_kit, run, max_steps=2, lr="5e-3", **ADAPTER))
    return run / "final"


def test_the_stage_continues_the_sft_adapter_and_trains_it(demo_kit, sft, tmp_path):
    still = tmp_path / "still"  # an lr that moves nothing: the stage starts from the SFT adapter, not a fresh one
    run_train(train_args(demo_kit, still, model_id=sft, max_steps=1, lr="1e-12", **STAGE))
    before = _adapter(sft)
    for key, value in _adapter(still / "final").items():
        torch.testing.assert_close(value, before[key], rtol=0, atol=1e-9)
    assert any("lora_B" in k and v.abs().sum() > 0 for k, v in before.items())  # not a fresh (zero) adapter

    run = tmp_path / "stage"
    run_train(train_args(demo_kit, run, model_id=sft, max_steps=2, lr="5e-3", **STAGE))
    after = _adapter(run / "final")
    assert any(not torch.equal(after[k], before[k]) for k in before), "the stage trained the adapter"
    base, saved = load_file(str(sft / "model.safetensors")), load_file(str(run / "final" / "model.safetensors"))
    assert base.keys() == saved.keys() and all(torch.equal(base[k], saved[k]) for k in base), "base kept"
    metrics = read_metrics(run)[2]
    assert 1.0 <= metrics["acceptance_length"] <= 4.0  # the drafts per verify the served decoder accepted, + 1
    assert metrics["opd_kl_tokens"] > 0 and metrics["opd_loss"] > 0
    assert {"opd_kl", "opd_reverse_kl", "rollout_tokens_per_forward"} <= metrics.keys()


@pytest.mark.parametrize(
    ("flags", "names"),
    [
        (dict(opd_rollout="self-spec", recipe="opd", ar_loss_weight=0), "--opd_rollout"),  # block-causal: no AR head
        (dict(opd_reject_weight=-1, **STAGE), "--opd_reject_weight"),
        (dict(STAGE, lora_rank=8), "--lora_rank"),  # the SFT adapter is rank 4
    ],
)
def test_refused_in_one_line(demo_kit, sft, tmp_path, capfd, flags, names):
    model_id = sft if flags.get("draft_adapter") else demo_kit / "base_model"
    lines = train_py_error(train_args(demo_kit, tmp_path / "run", model_id=model_id, max_steps=1, **flags), capfd)
    assert names in lines[-1]


def test_a_full_fine_tune_distils_its_drafts_from_its_own_ar_head(demo_kit, tmp_path):
    """No adapter: the verifier is the student's own AR head (the clean stream, causal with --ar_loss_weight >
    0), and the frozen teacher's KL on the AR rows keeps that head on the base model (`--opd_ar_weight`)."""
    run = tmp_path / "full"
    flags = {k: v for k, v in STAGE.items() if k not in ADAPTER}
    run_train(train_args(demo_kit, run, max_steps=2, lr="1e-3", **flags))
    metrics = read_metrics(run)
    assert metrics[1]["opd_ar_kl"] == pytest.approx(0.0, abs=1e-5)  # step 1: the student is the teacher
    assert metrics[2]["opd_ar_kl"] > 0 and metrics[2]["opd_kl_tokens"] > 0


def test_walked_states_train_on_two_ranks(demo_kit, sft, tmp_path):
    """--opd_draft_states walk: the verifies walked along the dataset's answers, no decoding; two FSDP ranks
    whose samples need different numbers of scoring forwards stay in lockstep."""
    run = tmp_path / "walk"
    flags = dict(STAGE, opd_draft_states="walk", opd_prompts_per_step=3)
    run_train(train_args(demo_kit, run, model_id=sft, max_steps=2, lr="5e-3", **flags), nproc=2)
    metrics = read_metrics(run)[2]
    assert metrics["opd_kl_tokens"] > 0 and 1.0 <= metrics["acceptance_length"] <= 4.0
    assert any(not torch.equal(v, _adapter(sft)[k]) for k, v in _adapter(run / "final").items())
