"""`train.py --opd_on_policy` end to end: the trainer's rollouts on the FSDP-sharded student equal the
serving engine on the same weights; runs report the OPD metrics; ranks with rollouts of different
lengths stay in lockstep; a resumed run continues the uninterrupted one exactly."""

import json

import pytest
import torch

from bdcore.decode.config import DecodeConfig
from bdcore.decode.sampling import SamplingParams
from bdcore.loading import load_checkpoint
from inference.native.engine import Engine
from tests.conftest import in_process_trainer, read_metrics, run_train, train_py_error
from tests.train_args import train_args
from train.opd_trainer import OnPolicyDistiller
from train.rollout import student_rollouts

pytestmark = pytest.mark.e2e  # a whole program, server or long sweep: `pytest -m 'not e2e'` skips it

OPD = dict(opd_on_policy=True, opd_prompts_per_step=2, opd_max_new_tokens=12, lr="1e-3")


@pytest.mark.parametrize("kit", ["demo_kit", "hybrid_kit"])
def test_trainer_rollouts_equal_the_engine_on_the_same_weights(kit, request, tmp_path):
    kit = request.getfixturevalue(kit)
    with in_process_trainer(train_args(kit, tmp_path / "run", max_steps=2, **OPD)) as trainer:
        trainer.train_step()  # the student moves away from its starting weights first
        saved = trainer.save("after_one_step")
        opd = trainer.recipe
        assert isinstance(opd, OnPolicyDistiller) and opd.sft_weight == 0.0  # --opd_on_policy is --recipe opd
        assert json.loads((tmp_path / "run" / "run_config.json").read_text())["recipe"] == "opd"
        prompts = opd.prompts[:4]
        got = student_rollouts(
            trainer.model,
            prompts,
            mask_id=opd.mask_id,
            stop_ids=opd.stop_ids,
            decode=opd.decode,
            params=opd.params,
            seed=0,
        )
        engine = Engine(load_checkpoint(saved), DecodeConfig(mode="diffusion", threshold=0.9))
        for prompt, ro in zip(prompts, got):
            want = engine.generate(prompt, SamplingParams(max_tokens=12))
            assert ro.tokens == want.tokens and ro.stats.forwards == want.stats.forwards
        # the training forward still works after a rollout (gated-delta layers, attention restored)
        trainer.train_step()


def test_two_ranks_sampled_rollouts_stay_in_lockstep_and_report_metrics(demo_kit, tmp_path):
    run = tmp_path / "r"
    args = train_args(demo_kit, run, max_steps=3, opd_temperature=1.0, opd_sft_weight=0.5, opd_slots="masked", **OPD)
    run_train(args, nproc=2)
    metrics = read_metrics(run)
    assert sorted(metrics) == [1, 2, 3]
    for r in metrics.values():
        for key in ("opd_kl", "opd_ar_kl", "rollout_len", "rollout_tokens_per_forward", "teacher_agreement"):
            assert key in r and r[key] == r[key]  # present and not NaN
        assert r["diff"] > 0 and r["opd_kl"] > 0  # SFT rows and OPD both contribute
    assert load_checkpoint(run / "final").sidecar.global_step == 3


def test_opd_resume_continues_the_same_run(demo_kit, tmp_path):
    """Sampled rollouts, prompt and state draws all come from (seed, rank, step): steps 3-4 after a resume
    from step 2 are the uninterrupted run's steps 3-4."""
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    flags = dict(OPD, opd_temperature=1.0, save_every=2, max_steps=4)
    run_train(train_args(demo_kit, full, **flags))
    run_train(train_args(demo_kit, resumed, **flags, resume=full / "step_2"))
    a, b = read_metrics(full), read_metrics(resumed)
    assert sorted(b) == [3, 4]
    for s in (3, 4):
        assert b[s]["loss"] == pytest.approx(a[s]["loss"], rel=1e-6, abs=1e-9)
        assert b[s]["rollout_len"] == a[s]["rollout_len"]
    final_a = load_checkpoint(full / "final").model.state_dict()
    final_b = load_checkpoint(resumed / "final").model.state_dict()
    for k in final_a:
        torch.testing.assert_close(final_b[k], final_a[k], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("differs", ["width", "tokenizer"])
def test_a_teacher_of_another_vocabulary_is_refused_at_load(demo_kit, tmp_path, capfd, differs):
    """A teacher that scores other ids than the student's tokenizer is refused before any step, by name."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    teacher = AutoModelForCausalLM.from_pretrained(demo_kit / "base_model")
    tok = AutoTokenizer.from_pretrained(demo_kit / "base_model")
    if differs == "width":  # more output rows than the student has, even after its <|mask|>
        teacher.resize_token_embeddings(teacher.config.vocab_size + 8, mean_resizing=False)
    else:  # same rows, but the id after the real tokens is another token than the student's
        tok.add_tokens(["<|extra|>"], special_tokens=True)
    teacher.save_pretrained(tmp_path / "teacher")
    tok.save_pretrained(tmp_path / "teacher")
    run = tmp_path / "run"
    args = train_args(demo_kit, run, max_steps=1, opd_teacher=tmp_path / "teacher", **OPD)
    lines = train_py_error(args, capfd)
    assert not any("Traceback" in line for line in lines), lines
    last = lines[-1]
    assert last.startswith("train.py: error: --opd_teacher: ") and str(tmp_path / "teacher") in last, last
    assert ("more than the student's" if differs == "width" else "'<|extra|>'") in last, last
    assert not list(run.glob("step_*")) and not (run / "final").exists()
