"""Invariant 2: noised block b of the two-stream forward equals a single-stream forward of
[prompt, clean blocks < b, noised block b] with a bidirectional (or causal) last block."""

import random

import pytest
import torch

from tests.tiny import FILLER_ID, MASK_ID, random_sample, tiny_model
from train.config import BlockDiffusionConfig
from train.model import TwoStreamLM
from train.noise import noise_generator
from train.rows import SpecialIds, build_batch

IDS = SpecialIds(mask_id=MASK_ID, filler_id=FILLER_ID)


def single_stream_reference(model, sample, start, block_ids, bd_size, clean_causal, within_block_causal):
    """Logits of the block rows of one plain forward over [clean prefix, noised block]."""
    prefix = list(sample.input_ids[:start])
    P, B = len(prefix), len(block_ids)
    limit = list(range(P))  # last key position each prefix row may see
    if not clean_causal:
        for s, e in sample.spans:
            for i in range(s, min(e, P)):
                limit[i] = min(e, s + ((i - s) // bd_size + 1) * bd_size) - 1
    mask = torch.zeros(P + B, P + B, dtype=torch.bool)
    for i in range(P):
        mask[i, : limit[i] + 1] = True
    mask[P:, :P] = True
    mask[P:, P:] = torch.tril(torch.ones(B, B, dtype=torch.bool)) if within_block_causal else True
    dev = next(model.parameters()).device
    ids = torch.tensor([prefix + block_ids], device=dev)
    out = model(
        input_ids=ids, attention_mask=mask[None, None].to(dev), position_ids=torch.arange(P + B, device=dev)[None]
    )
    return out.logits[0, P:]


@pytest.mark.parametrize(
    "arch,clean_causal,wbc,turns,pack",
    [
        ("qwen3", True, False, 1, 1),
        ("qwen3", True, True, 1, 1),
        ("qwen3", False, False, 1, 1),
        ("qwen3", True, False, 1, 3),  # packing: documents never see each other
        ("qwen3", True, False, 3, 1),  # multi-turn: blocks restart at each assistant turn
        ("llama", False, True, 2, 2),
    ],
)
def test_noised_block_equals_single_stream(arch, clean_causal, wbc, turns, pack):
    model = tiny_model(arch)
    reference = tiny_model(arch)  # same weights, stock SDPA (TwoStreamLM switches `model` to the tiled SDPA)
    rng = random.Random(turns * 10 + pack)
    bd = 4
    rows = [[random_sample(rng, turns=turns, max_prompt=8, max_resp=11) for _ in range(pack)] for _ in range(2)]
    cfg = BlockDiffusionConfig(
        bd_size=bd, ar_loss_weight=0.3 if clean_causal else 0.0, clean_causal=clean_causal, within_block_causal=wbc
    )
    batch = build_batch(rows, cfg, IDS, noise_generator(1, 0, 0))
    m = batch.meta
    checked = 0
    with torch.no_grad():
        logits = TwoStreamLM(model, cfg).logits(batch)
        assert reference.config._attn_implementation == "sdpa" != model.config._attn_implementation
        for r, samples in enumerate(rows):
            for d, sample in enumerate(samples):
                for view in range(1, cfg.views + 1):
                    sel = (m.doc[r] == d) & (m.stream[r] == view)
                    for blk in m.blk[r, sel].unique().tolist():
                        rows_b = (sel & (m.blk[r] == blk)).nonzero().flatten()
                        start = int(m.bstart[r, rows_b[0]])
                        block_ids = batch.input_ids[r, rows_b].tolist()
                        want = single_stream_reference(reference, sample, start, block_ids, bd, clean_causal, wbc)
                        torch.testing.assert_close(logits[r, rows_b], want, atol=2e-5, rtol=1e-5)
                        checked += 1
    assert checked >= 2 * pack * turns * 2
