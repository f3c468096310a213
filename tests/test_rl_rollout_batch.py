"""What one RL rollout batch (`train.rl_trainer.DiffusionRL`) is built from: the KL term is anchored on the
frozen starting policy, not on the policy that rolled out, and the rollouts are sampled with a seed that
changes with the step and the rank (and repeats for the same step and rank, so a resume redraws them).

A KL anchored on the rollout policy is exactly 0 at the first update of every batch and never pulls the
student back to where it started; a constant seed makes every step and rank sample the same answers to
a prompt. Both pass the end-to-end runs (the reward still rises, the KL is still positive at a batch's
second update), so they are checked here on the batch itself."""

import copy

import pytest
import torch

from bdcore.tokens import end_of_turn_id, filler_id
from inference.native.loading import load_checkpoint
from tests.test_invariant_4_self_spec import _prompts
from tests.tiny import tiny_checkpoint
from train.cli import parse_args
from train.config import JobConfig
from train.model import TwoStreamLM
from train.rl_trainer import DiffusionRL
from train.rows import Sample


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return load_checkpoint(tiny_checkpoint(tmp_path_factory.mktemp("rl_batch"), bd_size=4))


def _config(tmp_path, **flags) -> JobConfig:
    argv = ["--model_id", "x", "--dataset", "d.jsonl", "--save_dir", str(tmp_path), "--bd_size", "4"]
    argv += ["--rl_diffusion_rollout", "--rl_max_new_tokens", "8", "--rl_threshold", "0.5"]
    for name, value in flags.items():
        argv += [f"--{name}", str(value)]
    return JobConfig.from_args(parse_args(argv))


def _samples(tok, n):
    """Chat prompts, each answered "12" and closed by the end-of-turn token."""
    answer, eot = tok("12", add_special_tokens=False)["input_ids"], end_of_turn_id(tok)
    return [Sample(p + answer + [eot], [(len(p), len(p) + len(answer) + 1)]) for p in _prompts(tok, n, seed=4)]


def _stock_ar_logprobs(model, mask_id, prompt, response) -> torch.Tensor:
    """log p(response[j] | prompt, response[:j]) from one plain causal forward of the HF model."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0].float()
    logits[:, mask_id] = float("-inf")
    P = len(prompt)
    rows = logits[P - 1 : P - 1 + len(response)].log_softmax(-1)
    return rows.gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


def test_the_kl_is_anchored_on_the_frozen_start(loaded, tmp_path):
    """Causal rollouts score every token on an AR row, so a stock forward of each model is an independent
    reference for the batch's anchor and for the k3 KL the first update reports."""
    config = _config(tmp_path, rl_kl_weight=0.1, rl_group_size=3, rl_rollout_mode="causal")
    tok, mask = loaded.tokenizer, loaded.mask_id
    start = copy.deepcopy(loaded.model).eval().requires_grad_(False)
    moved = copy.deepcopy(start).requires_grad_(True)
    with torch.no_grad():  # the student has trained away from where it started
        gen = torch.Generator().manual_seed(0)
        for p in moved.parameters():
            p.add_(0.03 * p.norm() / p.numel() ** 0.5 * torch.randn(p.shape, generator=gen))
    fill = filler_id(tok, end_of_turn_id(tok))
    rl = DiffusionRL(config, tok, mask, fill, _samples(tok, 2), TwoStreamLM(start, config.diffusion))
    metrics = rl.step(TwoStreamLM(moved, config.diffusion), 0, 0)
    b = rl.batch
    assert b.ref_logp is not None and len(b.ref_logp) == len(b.rollouts) > 0
    kls = []
    for ro, ref, old in zip(b.rollouts, b.ref_logp, b.old_logp):
        want_ref = _stock_ar_logprobs(start, mask, ro.prompt_ids, ro.response)
        want_new = _stock_ar_logprobs(moved, mask, ro.prompt_ids, ro.response)
        torch.testing.assert_close(ref, want_ref, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(old, want_new, atol=1e-4, rtol=1e-4)
        delta = want_ref - want_new
        kls.append((delta.exp() - delta - 1).mean())
    want_kl = float(torch.stack(kls).mean())  # GRPO's default: per trajectory, then over trajectories
    assert want_kl > 1e-3, "the moved student differs from the start (the test can tell the anchors apart)"
    assert metrics["rl_ratio"] == 1.0 and metrics["rl_kl"] == pytest.approx(want_kl, rel=1e-3)


def _answers(rl, lm, step, rank):
    rl.step(lm, step, rank)
    return [tuple(r.tokens) for r in rl.batch.rollouts]


def test_the_rollout_seed_changes_with_step_and_rank_and_repeats_on_resume(loaded, tmp_path):
    """One prompt in the dataset, so every batch answers the same prompt; the weights stay as they are (no
    optimizer step), so only the sampling seed can make two batches' answers differ."""
    config = _config(tmp_path, rl_group_size=4, rl_prompts_per_step=1, rl_temperature=1.0)
    tok, mask = loaded.tokenizer, loaded.mask_id
    rl = DiffusionRL(config, tok, mask, filler_id(tok, end_of_turn_id(tok)), _samples(tok, 1), None)
    lm = TwoStreamLM(copy.deepcopy(loaded.model), config.diffusion)
    first = _answers(rl, lm, 0, 0)
    assert len(set(first)) > 1, "the group's rollouts differ from one another"
    again, later, other_rank = _answers(rl, lm, 0, 0), _answers(rl, lm, 1, 0), _answers(rl, lm, 0, 1)
    assert again == first, "the same step and rank draw the same answers (exact resume)"
    assert later != first, "the next step samples afresh"
    assert other_rank != first, "another rank samples other answers"
