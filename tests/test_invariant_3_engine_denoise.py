"""Invariant 3: the engine's denoise logits for a canvas equal the training forward's logits for the
same noised block (same weights, same tokens, same positions)."""

import random

import pytest
import torch

from bdcore.decode.rows import Rows
from tests.one_sequence import OneSequence
from tests.tiny import FILLER_ID, MASK_ID, random_sample, tiny_hybrid_model, tiny_model
from train.config import BlockDiffusionConfig
from train.model import TwoStreamLM
from train.noise import noise_generator
from train.rows import SpecialIds, build_batch

IDS = SpecialIds(mask_id=MASK_ID, filler_id=FILLER_ID)


# Every combination the trainer can produce: {dense, hybrid} x clean_causal x within_block_causal.
@pytest.mark.parametrize("wbc", [False, True])
@pytest.mark.parametrize("clean_causal", [True, False])
@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen3_5", "qwen3_moe"])
def test_engine_canvas_logits_equal_training_logits(arch, clean_causal, wbc):
    # Hybrids: the engine and the trainer both use the chunked gated-delta form, but cut it into
    # different chunks, so fp32 rounding differs by ~1e-5 of the logit scale (exactness of the chunked
    # form is pinned in float64 by tests/test_hybrid_decode.py).
    check_engine_canvas_logits(arch, clean_causal, wbc, atol=1e-4 if arch == "qwen3_5" else 2e-5)


def check_engine_canvas_logits(
    arch, clean_causal, wbc, *, device="cpu", train_attn="sdpa", atol=2e-5, rtol=1e-5, min_checked=6, adapt=None
):
    """The engine's canvas logits == the training forward's, with the training model on `train_attn`
    (the CUDA twin runs flex attention there, as the trainer does on CUDA) and both models on `device`.
    `adapt(model)` changes both models alike before the comparison (e.g. adds a draft adapter)."""
    # Separate instances with equal weights: training and decode patch gated-delta layers differently,
    # and the engine always runs SDPA (`bdcore/loading.py`).
    if arch == "qwen3_5":
        model, engine_model = tiny_hybrid_model(attn=train_attn), tiny_hybrid_model()
    else:
        model = tiny_model(arch, attn=train_attn)
        engine_model = model if train_attn == "sdpa" else tiny_model(arch)
    if adapt is not None:
        shared = engine_model is model
        model = adapt(model)
        engine_model = model if shared else adapt(engine_model)
    model, engine_model = model.to(device), engine_model.to(device)
    cfg = BlockDiffusionConfig(
        bd_size=4, ar_loss_weight=0.2 if clean_causal else 0.0, clean_causal=clean_causal, within_block_causal=wbc
    )
    rng = random.Random(7)
    samples = [random_sample(rng, max_prompt=10, max_resp=14) for _ in range(3)]
    batch = build_batch([[s] for s in samples], cfg, IDS, noise_generator(3, 0, 0)).to(device)
    m = batch.meta
    checked = 0
    with torch.no_grad():
        train_logits = TwoStreamLM(model, cfg).logits(batch)
        for r, s in enumerate(samples):
            resp_start = s.spans[0][0]
            for blk in m.blk[r, m.stream[r] == 1].unique().tolist():
                idx = ((m.stream[r] == 1) & (m.blk[r] == blk)).nonzero().flatten()
                start = int(m.bstart[r, idx[0]])
                runner = OneSequence(engine_model, clean_causal=clean_causal, within_block_causal=wbc)
                # The committed context as the engine holds it: prompt causally, then each earlier block.
                runner.forward(Rows().clean(list(s.input_ids[:resp_start]), 0), keep=resp_start)
                for b0 in range(resp_start, start, cfg.bd_size):
                    runner.forward(
                        Rows().commit(list(s.input_ids[b0 : b0 + cfg.bd_size]), b0, block_causal=not clean_causal),
                        keep=cfg.bd_size,
                    )
                got = runner.forward(Rows().canvas(batch.input_ids[r, idx].tolist(), start), keep=0)
                assert runner.length == start, "a denoise forward persists nothing"
                torch.testing.assert_close(got, train_logits[r, idx], atol=atol, rtol=rtol)
                checked += 1
    assert checked >= min_checked
