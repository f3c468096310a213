"""The trainer's rollouts (`train.rollout.student_rollouts`) decode under the student's own attention rule:
a student whose clean stream is block-causal (`--ar_loss_weight 0`) or whose blocks are causal inside
(`--within_block_causal`) rolls out exactly as the slow reference decoder (`tests/reference_decoder.py`)
decodes its checkpoint. The trainer-vs-engine tests train causal-clean students only, so a rollout that
ignored the student's rule (and trained OPD/RL on states the server never visits) passed them."""

import pytest

from bdcore.decode.config import DecodeConfig
from bdcore.decode.sampling import SamplingParams
from bdcore.loading import load_checkpoint
from tests import reference_decoder as ref
from tests.test_invariant_4_self_spec import _prompts
from tests.tiny import tiny_checkpoint
from train.config import BlockDiffusionConfig
from train.model import TwoStreamLM
from train.rollout import student_rollouts

B, THRESHOLD, MAX_TOKENS = 4, 0.5, 12


def _reference(path, loaded, prompt, *, clean_causal: bool, within_block_causal: bool):
    model = ref.ReferenceModel(
        path, mask_id=loaded.mask_id, clean_causal=clean_causal, within_block_causal=within_block_causal
    )
    return ref.diffusion(
        model,
        prompt,
        block=B,
        budget=B - 1,
        threshold=THRESHOLD,
        fuse_commit=True,
        mask_id=loaded.mask_id,
        max_tokens=MAX_TOKENS,
        stop_ids=loaded.stop_ids,
    )


@pytest.mark.parametrize(
    "clean_causal,within_block_causal", [(False, False), (True, True)], ids=["block_causal_clean", "within_block"]
)
def test_rollouts_follow_the_students_attention_rule(tmp_path, clean_causal, within_block_causal):
    path = tiny_checkpoint(tmp_path, bd_size=B, clean_causal=clean_causal, within_block_causal=within_block_causal)
    loaded = load_checkpoint(path)
    cfg = BlockDiffusionConfig(
        bd_size=B, ar_loss_weight=0.2 if clean_causal else 0.0, within_block_causal=within_block_causal
    )
    assert cfg.clean_causal == clean_causal
    prompts = _prompts(loaded.tokenizer, 4, seed=6)
    got = student_rollouts(
        TwoStreamLM(loaded.model, cfg),
        prompts,
        mask_id=loaded.mask_id,
        stop_ids=loaded.stop_ids,
        decode=DecodeConfig(mode="diffusion", threshold=THRESHOLD),
        params=SamplingParams(max_tokens=MAX_TOKENS),
        seed=0,
    )
    differs = 0  # prompts the default rule (causal clean stream, bidirectional blocks) would decode otherwise
    for prompt, ro in zip(prompts, got):
        want = _reference(path, loaded, prompt, clean_causal=clean_causal, within_block_causal=within_block_causal)
        assert ro.tokens == want.tokens and ro.stats.forwards == want.forwards
        other = _reference(path, loaded, prompt, clean_causal=True, within_block_causal=False)
        differs += other.tokens != want.tokens
    assert differs > 0, "the rule changes some answer (the test can tell the rules apart)"
