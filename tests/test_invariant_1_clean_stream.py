"""Invariant 1: at step 0 the clean stream's logits equal the base model's logits on S+R."""

import random

import pytest
import torch

from tests.tiny import FILLER_ID, MASK_ID, random_sample, tiny_model
from train.config import BlockDiffusionConfig
from train.model import TwoStreamLM
from train.noise import noise_generator
from train.rows import SpecialIds, build_batch

IDS = SpecialIds(mask_id=MASK_ID, filler_id=FILLER_ID)


@pytest.mark.parametrize("arch,tied", [("qwen3", True), ("qwen3", False), ("llama", True)])
@pytest.mark.parametrize("pack", [1, 3])
def test_clean_stream_equals_base_model(arch, tied, pack):
    model = tiny_model(arch, tied=tied)
    # The reference is a separate instance with the same weights: TwoStreamLM switches `model` to the
    # project's block-sparse SDPA on CPU, and the reference must be stock SDPA.
    base_model = tiny_model(arch, tied=tied)
    rng = random.Random(pack)
    rows = [
        [random_sample(rng, turns=rng.randint(1, 2), max_prompt=12, max_resp=20) for _ in range(pack)] for _ in range(2)
    ]
    cfg = BlockDiffusionConfig(bd_size=4, ar_loss_weight=0.5)
    batch = build_batch(rows, cfg, IDS, noise_generator(0, 0, 0))
    with torch.no_grad():
        logits = TwoStreamLM(model, cfg).logits(batch)
        assert base_model.config._attn_implementation == "sdpa" != model.config._attn_implementation
        for r, samples in enumerate(rows):
            for d, sample in enumerate(samples):
                sel = (batch.meta.doc[r] == d) & (batch.meta.stream[r] == 0)
                base = base_model(input_ids=torch.tensor([list(sample.input_ids)])).logits[0]
                torch.testing.assert_close(logits[r, sel], base, atol=1e-5, rtol=1e-5)
                # The test model is sensitive: a different context changes these logits a lot.
                assert (base[1:] - base[:-1]).abs().max() > 0.1
