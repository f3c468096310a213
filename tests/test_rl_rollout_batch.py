"""What one RL rollout batch (`train.rl_trainer.DiffusionRL`) is built from: each group is one prompt's
rollouts, each scored against that prompt's reference, with group-normalised advantages and the batch's
metrics from those rewards; the KL term is anchored on the frozen starting policy, not on the policy that
rolled out; the rollouts are sampled with a seed that changes with the step and the rank (and repeats for
the same step and rank, so a resume redraws them).

A KL anchored on the rollout policy is exactly 0 at the first update of every batch and never pulls the
student back to where it started; a constant seed makes every step and rank sample the same answers to
a prompt; a reference taken from another prompt of the batch, or a group mixing prompts, trains on the
wrong answers. All of these pass the end-to-end runs (the digit-share reward reads no reference, the KL
is still positive at a batch's second update), so they are checked here on the batch itself."""

import copy

import pytest
import torch

from bdcore.loading import load_checkpoint
from bdcore.tokens import end_of_turn_id, filler_id
from tests.tiny import tiny_checkpoint
from train.cli import parse_args
from train.config import JobConfig
from train.model import TwoStreamLM
from train.opd import prompt_of
from train.rl_trainer import DiffusionRL
from train.rows import Sample


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return load_checkpoint(tiny_checkpoint(tmp_path_factory.mktemp("rl_batch"), bd_size=4))


def _config(tmp_path, **flags) -> JobConfig:
    argv = ["--model_id", "x", "--dataset", "d.jsonl", "--save_dir", str(tmp_path), "--bd_size", "4"]
    argv += ["--rl_diffusion_rollout", "--rl_max_new_tokens", "8", "--rl_threshold", "0.5"]
    for name, value in flags.items():
        argv += [f"--{name}"] if value is True else [f"--{name}", str(value)]
    return JobConfig.from_args(parse_args(argv))


def _answer(i: int) -> str:
    return str(10 + i)


def _samples(tok, n):
    """Chat prompts, prompt i answered `_answer(i)` and closed by the end-of-turn token."""
    eot, samples = end_of_turn_id(tok), []
    for i, content in enumerate(["Copy abc", "Add 17 3", "Sort zz", "Reverse hello", "Add abc", "Copy zz"][:n]):
        chat = [{"role": "user", "content": content}]
        text = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        p = tok(text, add_special_tokens=False)["input_ids"]
        answer = tok(_answer(i), add_special_tokens=False)["input_ids"]
        samples.append(Sample(p + answer + [eot], [(len(p), len(p) + len(answer) + 1)]))
    return samples


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


def test_groups_are_one_prompts_rollouts_scored_against_its_reference(loaded, tmp_path):
    n, prompts_per_step = 3, 3
    config = _config(tmp_path, rl_group_size=n, rl_prompts_per_step=prompts_per_step)
    tok, mask = loaded.tokenizer, loaded.mask_id
    samples = _samples(tok, 6)
    reference_of = {tuple(prompt_of(s)): _answer(i) for i, s in enumerate(samples)}
    assert len(reference_of) == len(samples), "distinct prompts (a reference can be told from another's)"
    rl = DiffusionRL(config, tok, mask, filler_id(tok, end_of_turn_id(tok)), samples, None)
    scored = []

    def reward(answer: str, reference: str) -> float:
        value = (len(answer) % 3) / 2  # 0, 0.5 or 1: varied within a group, some answers solved
        scored.append((answer, reference, value))
        return value

    rl.reward = reward
    metrics = rl.step(TwoStreamLM(copy.deepcopy(loaded.model), config.diffusion), 0, 0)
    b = rl.batch
    assert len(scored) == len(b.rollouts) == n * prompts_per_step
    for ro, (answer, reference, _) in zip(b.rollouts, scored):
        assert answer == tok.decode(ro.tokens, skip_special_tokens=True)
        assert reference == reference_of[tuple(ro.prompt_ids)]
    groups = [b.rollouts[g : g + n] for g in range(0, len(b.rollouts), n)]
    assert all(len({tuple(r.prompt_ids) for r in group}) == 1 for group in groups), "a group is one prompt's"
    assert len({tuple(group[0].prompt_ids) for group in groups}) > 1, "several prompts drawn (the test can tell)"
    rewards = torch.tensor([value for *_, value in scored], dtype=torch.float64).view(-1, n)
    want = (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True, unbiased=False) + 1e-6)
    torch.testing.assert_close(b.advantages, want.flatten().float(), atol=1e-5, rtol=1e-5)
    solved = float((rewards == 1.0).double().mean())
    assert 0 < solved < 1, "some answers solved, some not (the metric can tell)"
    assert metrics["rl_reward"] == pytest.approx(float(rewards.mean()))
    assert metrics["rl_solved"] == pytest.approx(solved)


def test_dynamic_sampling_drops_the_groups_whose_rewards_are_all_equal(loaded, tmp_path):
    n = 3
    config = _config(tmp_path, rl_group_size=n, rl_prompts_per_step=4, rl_dynamic_sampling=True)
    tok, mask = loaded.tokenizer, loaded.mask_id
    rl = DiffusionRL(config, tok, mask, filler_id(tok, end_of_turn_id(tok)), _samples(tok, 6), None)
    flat = {_answer(i) for i in range(0, 6, 2)}  # these prompts' answers all score alike

    def reward(answer: str, reference: str) -> float:
        return 0.5 if reference in flat else (len(answer) % 3) / 2

    rl.reward = reward
    metrics = rl.step(TwoStreamLM(copy.deepcopy(loaded.model), config.diffusion), 0, 0)
    b = rl.batch
    kept = [b.rollouts[g : g + n] for g in range(0, len(b.rollouts), n)]
    rewards = [[reward(tok.decode(r.tokens, skip_special_tokens=True), "") for r in group] for group in kept]
    assert 0 < len(kept) < 4 and metrics["rl_groups_kept"] == len(kept), "some groups dropped, some kept"
    assert all(len({tuple(r.prompt_ids) for r in group}) == 1 for group in kept)
    assert all(len(set(values)) > 1 for values in rewards), "only groups whose rewards differ are kept"
    assert b.advantages.numel() == len(b.rollouts) == len(b.old_logp)
    want = torch.tensor(rewards, dtype=torch.float64)
    want = (want - want.mean(1, keepdim=True)) / (want.std(1, keepdim=True, unbiased=False) + 1e-6)
    torch.testing.assert_close(b.advantages, want.flatten().float(), atol=1e-5, rtol=1e-5)
