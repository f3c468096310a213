"""RL on diffusion rollouts (`train.py --rl_diffusion_rollout`): GRPO/DAPO pieces against hand computations,
the shared log-probability (ratio exactly 1 on the first update, gradient only through the new policy), no
gradient from the rollout, rewards shared with the evaluation scorers, and train.py end to end: the reward
rises on a task the start model fails, several updates per batch, exact resume."""

import copy
import math

import pytest
import torch

from bdcore.decode.config import DecodeConfig
from bdcore.decode.sampling import SamplingParams
from bdcore.loading import load_checkpoint
from bdcore.tokens import end_of_turn_id, filler_id
from tests.conftest import read_metrics, run_train
from tests.test_invariant_4_self_spec import _prompts
from tests.tiny import tiny_checkpoint
from tests.train_args import train_args
from train.config import BlockDiffusionConfig
from train.grpo import group_advantages, policy_loss, select_rollouts, varied_groups
from train.model import TwoStreamLM
from train.rewards import load_reward
from train.rollout import student_rollouts
from train.trajectory import trajectory_logprobs


def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 3.0, 1.0, 2.0, 2.0])
    adv = group_advantages(rewards, 4)
    # group 1: mean 0.5, std 0.5; group 2: all equal; group 3: mean 2, std sqrt(0.5)
    s = math.sqrt(0.5)
    want = [1, -1, -1, 1, 0, 0, 0, 0, 1 / s, -1 / s, 0, 0]
    torch.testing.assert_close(adv, torch.tensor(want, dtype=torch.float32), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(group_advantages(rewards, 4, scale=False)[:4], torch.tensor([0.5, -0.5, -0.5, 0.5]))
    assert varied_groups(rewards, 4).tolist() == [True] * 4 + [False] * 4 + [True] * 4
    with pytest.raises(ValueError, match="groups of 5"):
        group_advantages(rewards, 5)


def test_dynamic_sampling_keeps_varied_groups_with_their_own_advantages():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 2.0, 0.0])
    keep, adv, groups = select_rollouts(rewards, 2, dynamic=True)
    assert keep.tolist() == [False, False, True, True, False, False, True, True] and groups == 2
    torch.testing.assert_close(adv, torch.tensor([-1.0, 1.0, 1.0, -1.0]), atol=1e-5, rtol=1e-5)
    keep, adv, groups = select_rollouts(rewards, 2, dynamic=False)
    assert keep.all() and groups == 4 and adv.numel() == 8
    # nothing varied: one group with zero advantages, so every rank still runs the same forwards
    keep, adv, groups = select_rollouts(torch.ones(6), 2, dynamic=True)
    assert keep.tolist() == [True, True, False, False, False, False] and groups == 0 and not adv.any()


def test_policy_loss_clips_normalises_and_adds_the_kl_by_hand():
    old = [torch.zeros(2), torch.zeros(1)]
    new = [torch.log(torch.tensor([1.5, 0.9])), torch.log(torch.tensor([0.5]))]
    adv = torch.tensor([2.0, -1.0])
    out = policy_loss(new, old, adv, clip_low=0.2, clip_high=0.28, token_level=True)
    # trajectory 0 (A=2): ratio 1.5 clipped to 1.28 -> 2.56; ratio 0.9 -> 1.8. trajectory 1 (A=-1): ratio 0.5,
    # min(-0.5, -0.8) = -0.8 (clipped at 1 - 0.2). Token-level: -(2.56 + 1.8 - 0.8) / 3.
    assert float(out.loss) == pytest.approx(-(2.56 + 1.8 - 0.8) / 3, rel=1e-5)
    assert out.clip_fraction == pytest.approx(2 / 3) and out.tokens == 3
    per_traj = policy_loss(new, old, adv, clip_low=0.2, clip_high=0.28, token_level=False)
    assert float(per_traj.loss) == pytest.approx(-((2.56 + 1.8) / 2 - 0.8) / 2, rel=1e-5)  # GRPO: per trajectory
    ref = [torch.log(torch.tensor([1.0, 1.0])), torch.log(torch.tensor([1.0]))]
    with_kl = policy_loss(new, old, adv, clip_low=0.2, clip_high=0.28, token_level=True, ref_logp=ref, kl_weight=0.1)
    k3 = [math.exp(-math.log(x)) + math.log(x) - 1 for x in (1.5, 0.9, 0.5)]  # exp(ref-new) - (ref-new) - 1
    assert float(with_kl.kl) == pytest.approx(sum(k3) / 3, rel=1e-5)
    assert float(with_kl.loss) == pytest.approx(float(out.loss) + 0.1 * sum(k3) / 3, rel=1e-5)


@pytest.fixture(scope="module")
def student(tmp_path_factory):
    loaded = load_checkpoint(tiny_checkpoint(tmp_path_factory.mktemp("rl"), bd_size=4))
    sc = loaded.sidecar
    cfg = BlockDiffusionConfig(bd_size=sc.bd_size, ar_loss_weight=sc.ar_loss_weight)
    lm = TwoStreamLM(copy.deepcopy(loaded.model), cfg)
    return loaded, lm, filler_id(loaded.tokenizer, end_of_turn_id(loaded.tokenizer))


def _sample_rollouts(loaded, lm, n=4):
    prompts = [p for p in _prompts(loaded.tokenizer, 2, seed=4) for _ in range(n)]
    return student_rollouts(
        lm,
        prompts,
        mask_id=loaded.mask_id,
        stop_ids=loaded.stop_ids,
        decode=DecodeConfig(mode="diffusion", threshold=0.5),
        params=SamplingParams(temperature=1.0, max_tokens=10),
        seed=7,
    )


def test_the_rollout_gives_no_gradient_and_the_first_update_has_ratio_one(student):
    loaded, lm, filler = student
    lm.zero_grad(set_to_none=True)
    rollouts = _sample_rollouts(loaded, lm)
    assert all(p.grad is None for p in lm.parameters()), "the rollout is stop-gradient"
    assert len({tuple(r.tokens) for r in rollouts}) > 2, "sampled rollouts differ within a group"
    with torch.no_grad():
        old = trajectory_logprobs(lm, rollouts, mask_id=loaded.mask_id, filler_id=filler)
    new = trajectory_logprobs(lm, rollouts, mask_id=loaded.mask_id, filler_id=filler)
    assert all(torch.equal(a, b.detach()) for a, b in zip(old, new)), "same function, same weights"
    adv = torch.linspace(-1.0, 1.0, len(rollouts))
    out = policy_loss(new, old, adv, clip_low=0.2, clip_high=0.2, token_level=True)
    assert out.ratio_mean == 1.0 and out.clip_fraction == 0.0
    out.loss.backward()
    got = [p.grad.clone() for p in lm.parameters()]
    # At ratio 1 the surrogate's gradient is the plain policy gradient: -sum(A_i * grad logp_i) / tokens.
    lm.zero_grad(set_to_none=True)
    new = trajectory_logprobs(lm, rollouts, mask_id=loaded.mask_id, filler_id=filler)
    n = sum(x.numel() for x in new)
    (-sum(a * x.sum() for a, x in zip(adv, new)) / n).backward()
    for g, p in zip(got, lm.parameters()):
        torch.testing.assert_close(g, p.grad, atol=1e-6, rtol=1e-5)
    # The old log-probabilities never carry gradient, even when handed a tensor that does.
    lm.zero_grad(set_to_none=True)
    new = trajectory_logprobs(lm, rollouts, mask_id=loaded.mask_id, filler_id=filler)
    policy_loss(new, new, adv, clip_low=0.2, clip_high=0.2, token_level=True).loss.backward()
    for g, p in zip(got, lm.parameters()):
        torch.testing.assert_close(g, p.grad, atol=1e-6, rtol=1e-5)


def test_rewards_share_the_evaluation_scorers(tmp_path, monkeypatch):
    exact, gsm = load_reward("exact"), load_reward("gsm8k")
    assert exact(" 42 \n", "42") == 1.0 and exact("42.", "42") == 0.0
    assert gsm("so the answer is 1,234.", "... #### 1234") == 1.0 and gsm("1233", "#### 1234") == 0.0
    (tmp_path / "my_reward.py").write_text("def digits(answer, reference):\n    return float(answer.isdigit())\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_reward("my_reward:digits")("123", "") == 1.0 and load_reward("my_reward.digits")("a", "") == 0.0
    for bad in ("nope", "my_reward:missing", "no_such_module:f"):
        with pytest.raises(ValueError):
            load_reward(bad)


RL = dict(
    rl_diffusion_rollout=True,
    rl_reward="tests.rl_task:digit_share",
    rl_group_size=6,
    rl_prompts_per_step=2,
    rl_max_new_tokens=8,
    rl_threshold=0.5,
    ar_loss_weight="0.2",
    lr="3e-3",
)


@pytest.mark.e2e
@pytest.mark.parametrize("mode,steps", [("diffusion", 24), ("causal", 36)])
def test_reward_rises_on_a_task_the_start_model_fails(demo_kit, tmp_path, mode, steps):
    """The reward is the share of digits in the answer; the untrained demo model rarely writes digits. Causal
    rollouts (`--rl_rollout_mode causal`) decode one token per forward and train the AR head; their reward
    rises more slowly here (measured: about +0.15 in 24 steps, +0.35 in 36), so they get 36 steps."""
    run = tmp_path / "run"
    flags = dict(RL, max_steps=steps, rl_token_level=True, rl_clip_high="0.28", rl_rollout_mode=mode)
    run_train(train_args(demo_kit, run, **flags), timeout=600)
    m = read_metrics(run)
    if mode == "causal":
        assert all(r["rollout_tokens_per_forward"] == 1.0 for r in m.values())
    first = sum(m[s]["rl_reward"] for s in range(1, 5)) / 4
    last = sum(m[s]["rl_reward"] for s in range(steps - 3, steps + 1)) / 4
    assert first < 0.3, f"the start model already solves it ({first:.2f})"
    assert last > first + 0.2, (first, last)
    for r in m.values():
        for key in ("rl_loss", "rl_clip_fraction", "rollout_len", "rollout_tokens_per_forward", "rl_solved"):
            assert key in r and r[key] == r[key]


@pytest.mark.e2e
def test_several_updates_per_batch_and_exact_resume(demo_kit, tmp_path):
    """Two updates per rollout batch: the first update of each batch sees ratio 1, the second does not; a
    resume from step 2 (a batch boundary) repeats the uninterrupted run's steps 3-4 and weights."""
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    flags = dict(RL, rl_updates_per_batch=2, rl_dynamic_sampling=True, rl_kl_weight="0.05", save_every=2, max_steps=4)
    run_train(train_args(demo_kit, full, **flags))
    a = read_metrics(full)
    assert a[1]["rl_ratio"] == 1.0 and a[3]["rl_ratio"] == 1.0
    assert a[2]["rl_ratio"] != 1.0 and a[2]["rl_reward"] == a[1]["rl_reward"], "step 2 reuses step 1's rollouts"
    assert a[2]["rl_kl"] > 0
    run_train(train_args(demo_kit, resumed, **flags, resume=full / "step_2"))
    b = read_metrics(resumed)
    assert sorted(b) == [3, 4]
    for s in (3, 4):
        assert b[s]["loss"] == pytest.approx(a[s]["loss"], rel=1e-6, abs=1e-9)
        assert b[s]["rl_reward"] == a[s]["rl_reward"]
    final_a = load_checkpoint(full / "final").model.state_dict()
    final_b = load_checkpoint(resumed / "final").model.state_dict()
    for k in final_a:
        torch.testing.assert_close(final_b[k], final_a[k], atol=1e-6, rtol=1e-6)


def test_rl_flags_are_checked(tmp_path):
    from train.cli import parse_args
    from train.config import FlagError

    base = ["--model_id", "x", "--dataset", "d.jsonl", "--save_dir", str(tmp_path), "--rl_diffusion_rollout"]
    cases = [
        (["--rl_group_size", "1"], "--rl_group_size"),
        (["--rl_temperature", "0"], "--rl_temperature"),
        (["--rl_updates_per_batch", "3", "--max_steps", "10"], "--rl_updates_per_batch"),
        (["--rl_reward", "nope"], "--rl_reward"),
        (["--opd_on_policy"], "--rl_diffusion_rollout"),
        (["--rl_rollout_mode", "causal", "--ar_loss_weight", "0"], "--rl_rollout_mode"),
        (["--rl_rollout_mode", "self-spec", "--lora_rank", "4", "--draft_adapter"], "--rl_rollout_mode"),
    ]
    for extra, flag in cases:
        with pytest.raises(FlagError, match=f"^{flag}: "):
            parse_args(base + extra)
    assert parse_args(base + ["--rl_rollout_mode", "self-spec"]).rl_rollout_mode == "self-spec"
    assert parse_args(base + ["--rl_rollout_mode", "diffusion", "--ar_loss_weight", "0"]).rl_rollout_mode == "diffusion"


def test_the_reference_is_the_last_answer_without_its_end_of_turn(student):
    from train.rl_trainer import reference_text
    from train.rows import Sample

    tok = student[0].tokenizer
    eot = end_of_turn_id(tok)
    prompt, answer = tok("Add 1 and 2.")["input_ids"], tok("3 apples")["input_ids"]
    ids = prompt + answer + [eot]
    assert reference_text(Sample(ids, [(len(prompt), len(ids))]), tok) == "3 apples"
