"""Invariant 1 (hybrid): at step 0 the clean stream's logits equal the stock Qwen3.5 model's on S+R."""

import random

import pytest
import torch

from tests.tiny import FILLER_ID, MASK_ID, random_sample, tiny_hybrid_model
from train.config import BlockDiffusionConfig
from train.model import TwoStreamLM
from train.noise import noise_generator
from train.rows import SpecialIds, build_batch

IDS = SpecialIds(mask_id=MASK_ID, filler_id=FILLER_ID)


@pytest.mark.parametrize("pack,turns", [(1, 1), (3, 2)])
def test_clean_stream_equals_stock_hybrid_model(pack, turns):
    base, model = tiny_hybrid_model(), tiny_hybrid_model()
    rng = random.Random(pack)
    rows = [[random_sample(rng, turns=turns, max_prompt=70, max_resp=20) for _ in range(pack)] for _ in range(2)]
    cfg = BlockDiffusionConfig(bd_size=4, ar_loss_weight=0.5)
    batch = build_batch(rows, cfg, IDS, noise_generator(0, 0, 0))
    with torch.no_grad():
        logits = TwoStreamLM(model, cfg).logits(batch)
        for r, samples in enumerate(rows):
            for d, sample in enumerate(samples):
                sel = (batch.meta.doc[r] == d) & (batch.meta.stream[r] == 0)
                want = base(input_ids=torch.tensor([list(sample.input_ids)])).logits[0]
                torch.testing.assert_close(logits[r, sel], want, atol=5e-5, rtol=1e-5)
