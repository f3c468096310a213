"""On-policy rollouts and the shared trajectory log-probability.

- A greedy rollout (`train.rollout`) returns what the serving engine returns in diffusion mode, token for
  token and forward for forward (dense and hybrid, fused and unfused commits, causal and block-causal
  clean streams), batched or not.
- Its recorded commits cover the answer exactly once, in order.
- `train.trajectory.trajectory_logprobs`, one training forward over [prompt, answer ; every recorded
  canvas], gives the log-probabilities the student had while decoding, and is differentiable.
- Lockstep: a rank whose rollouts are done keeps running stand-in forwards while another still decodes,
  without changing its results.
"""

import copy
import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM

from bdcore.decode.config import DecodeConfig
from bdcore.decode.sampling import SamplingParams
from bdcore.loading import load_checkpoint
from bdcore.tokens import end_of_turn_id, filler_id
from inference.native.engine import Engine
from tests.test_invariant_4_self_spec import _prompts
from tests.test_logprobs import ar_logprobs
from tests.tiny import tiny_checkpoint
from train.config import BlockDiffusionConfig
from train.model import TwoStreamLM
from train.rollout import rollout
from train.trajectory import trajectory_logprobs

MAX_TOKENS = (20, 7, 20, 12)


@pytest.fixture(scope="module", params=[("qwen3", True), ("qwen3", False), ("qwen3_5", True)], ids=str)
def loaded(request, tmp_path_factory):
    arch, clean_causal = request.param
    path = tiny_checkpoint(tmp_path_factory.mktemp(arch), arch=arch, bd_size=4, clean_causal=clean_causal)
    loaded = load_checkpoint(path)
    loaded.source = path  # a stock copy for references (the engine patches its model's gated-delta layers)
    return loaded


def _rollouts(loaded, decode, *, max_tokens=20, sync=None, prompts=None, params=None, stop_ids=None, seed=0):
    kwargs = {} if sync is None else {"sync": sync}
    return rollout(
        loaded.model,
        prompts or _prompts(loaded.tokenizer, len(MAX_TOKENS), seed=3),
        caps=dataclasses.replace(loaded.capabilities, stop_ids=stop_ids or loaded.stop_ids),
        decode=decode,
        params=params or SamplingParams(max_tokens=max_tokens),
        seed=seed,
        **kwargs,
    )


@pytest.mark.parametrize("fuse_commit", [True, False])
def test_greedy_rollout_equals_the_serving_engine(loaded, fuse_commit):
    decode = DecodeConfig(mode="diffusion", threshold=0.3, fuse_commit=fuse_commit)
    engine = Engine(loaded, decode)
    prompts = _prompts(loaded.tokenizer, len(MAX_TOKENS), seed=3)
    for max_tokens in (20, 7):
        got = _rollouts(loaded, decode, max_tokens=max_tokens, prompts=prompts)
        for prompt, ro in zip(prompts, got):
            want = engine.generate(prompt, SamplingParams(max_tokens=max_tokens))
            assert ro.tokens == want.tokens
            assert (ro.stats.generated, ro.stats.forwards) == (want.stats.generated, want.stats.forwards)
            assert (ro.stop_token is not None) == (want.finish_reason == "stop")


def test_recorded_commits_cover_the_answer_once(loaded):
    for ro in _rollouts(loaded, DecodeConfig(mode="diffusion", threshold=0.3)):
        P = len(ro.prompt_ids)
        placed = {}
        for step in ro.steps:
            for s, t in zip(step.slots, step.tokens):
                assert step.start + s not in placed, "a slot is committed once"
                placed[step.start + s] = t
        answer = {P + i: t for i, t in enumerate(ro.response)}
        assert {p: placed[p] for p in answer} == answer
        assert all(step.canvas is None or len(step.canvas) == 4 for step in ro.steps)


def test_trajectory_logprobs_equal_the_rollout_and_are_differentiable(loaded):
    sc = loaded.sidecar
    rollouts = _rollouts(loaded, DecodeConfig(mode="diffusion", threshold=0.3))
    cfg = BlockDiffusionConfig(
        bd_size=sc.bd_size,
        ar_loss_weight=sc.ar_loss_weight,
        clean_causal=sc.clean_causal,
        within_block_causal=sc.within_block_causal,
    )
    lm = TwoStreamLM(copy.deepcopy(loaded.model), cfg)
    filler = filler_id(loaded.tokenizer, end_of_turn_id(loaded.tokenizer))
    got = trajectory_logprobs(lm, rollouts, mask_id=loaded.mask_id, filler_id=filler)
    for ro, logp in zip(rollouts, got):
        end = len(ro.prompt_ids) + len(ro.response)
        want = [lp for st in ro.steps for s, lp in zip(st.slots, st.logprobs) if st.start + s < end]
        assert len(want) == len(ro.response)
        torch.testing.assert_close(logp.detach(), torch.tensor(want), atol=2e-4, rtol=1e-4)
    sum(x.sum() for x in got).backward()
    grads = [p.grad for p in lm.parameters() if p.requires_grad]
    assert any(g is not None and g.abs().sum() > 0 for g in grads)


def test_lockstep_stand_in_forwards_leave_results_unchanged(loaded):
    decode = DecodeConfig(mode="diffusion", threshold=0.3)
    alone = _rollouts(loaded, decode)
    calls = []
    extra = 5  # another rank still decodes for 5 forwards after this one is done

    def sync(active: bool) -> bool:
        calls.append(active)
        return active or sum(1 for a in calls if not a) <= extra

    forwards = []
    hook = loaded.model.register_forward_hook(lambda *_: forwards.append(1))
    try:
        locked = _rollouts(loaded, decode, sync=sync)
    finally:
        hook.remove()
    assert [r.tokens for r in locked] == [r.tokens for r in alone]
    assert len(forwards) == calls.count(True) + extra


@pytest.mark.parametrize("mode", ["causal", "self-spec"])
def test_ar_mode_rollouts_are_the_engines_and_score_the_ar_head(loaded, mode):
    """RL's `--rl_rollout_mode causal|self-spec`: the rollout decodes what the serving engine decodes in that
    mode (greedy and sampled, same seeds), records each answer token and the stop token as committed from
    the AR row before it, and the shared trajectory function then gives the AR head's log-probability of
    each: equal to one stock causal forward over [prompt, answer] and to what the decoder scored."""
    sc = loaded.sidecar
    if not sc.clean_causal:
        pytest.skip("AR-mode rollouts need a token-causal clean stream (train.cli refuses them otherwise)")
    decode = DecodeConfig(mode=mode)
    prompts = _prompts(loaded.tokenizer, len(MAX_TOKENS), seed=3)
    # a token the first greedy answer emits stops answers too, so stop tokens are scored whatever the weights
    stops = loaded.stop_ids | {Engine(loaded, decode).generate(prompts[0], SamplingParams(max_tokens=8)).tokens[3]}
    engine = Engine(dataclasses.replace(loaded, stop_ids=stops), decode)
    cfg = BlockDiffusionConfig(bd_size=sc.bd_size, ar_loss_weight=sc.ar_loss_weight, clean_causal=True)
    lm = TwoStreamLM(copy.deepcopy(loaded.model), cfg)
    filler = filler_id(loaded.tokenizer, end_of_turn_id(loaded.tokenizer))
    stock = AutoModelForCausalLM.from_pretrained(loaded.source, dtype=torch.float32).eval()
    for temperature in (0.0, 1.0):
        params = SamplingParams(max_tokens=20, temperature=temperature)
        got = _rollouts(loaded, decode, prompts=prompts, params=params, stop_ids=stops, seed=7)
        scored = trajectory_logprobs(lm, got, mask_id=loaded.mask_id, filler_id=filler)
        for i, (prompt, ro, logp) in enumerate(zip(prompts, got, scored)):
            want = engine.generate(prompt, SamplingParams(max_tokens=20, temperature=temperature, seed=7 + i))
            assert ro.tokens == want.tokens
            assert (ro.stats.generated, ro.stats.forwards) == (want.stats.generated, want.stats.forwards)
            P = len(ro.prompt_ids)
            assert [(st.start, st.canvas, st.slots, st.tokens) for st in ro.steps] == [
                (P + k, None, [0], [t]) for k, t in enumerate(ro.response)
            ]
            reference = ar_logprobs(stock, loaded.mask_id, prompt, ro.response)
            torch.testing.assert_close(logp.detach(), reference, atol=2e-4, rtol=1e-4)
            recorded = torch.tensor([lp for st in ro.steps for lp in st.logprobs])
            torch.testing.assert_close(recorded, reference, atol=2e-4, rtol=1e-4)
        if temperature == 0.0:  # the first greedy answer stops at the token picked above: a scored stop token
            assert got[0].stop_token is not None
