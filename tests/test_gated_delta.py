"""The chunked two-stream gated-delta operation against a plain per-token recurrence."""

import random

import pytest
import torch

from bdcore.gated_delta_reference import reference_conv, reference_gated_delta
from tests.tiny import FILLER_ID, MASK_ID, random_sample
from train.config import BlockDiffusionConfig
from train.hybrid import build_layout
from train.noise import noise_generator
from train.rows import SpecialIds, build_batch
from train.two_stream_gated_delta import two_stream_conv, two_stream_gated_delta

IDS = SpecialIds(mask_id=MASK_ID, filler_id=FILLER_ID)


def _batch(seed, cfg, turns, pack):
    rng = random.Random(seed)
    rows = [[random_sample(rng, turns=turns, max_prompt=12, max_resp=14) for _ in range(pack)] for _ in range(2)]
    return build_batch(rows, cfg, IDS, noise_generator(seed, 0, 0))


def _inputs(N, H=3, dk=4, dv=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(N, H, dk, generator=gen), dim=-1) * dk**-0.5
    k = torch.nn.functional.normalize(torch.randn(N, H, dk, generator=gen), dim=-1)
    v = torch.randn(N, H, dv, generator=gen)
    g = -torch.rand(N, H, generator=gen) * 2
    beta = torch.rand(N, H, generator=gen)
    return [x.requires_grad_() for x in (q, k, v, g, beta)]


CASES = [
    # bd_size, views, clean_causal, within_block_causal, turns, pack, chunk
    (4, 2, True, False, 1, 1, 64),
    (3, 2, True, True, 2, 2, 5),
    (5, 1, False, False, 3, 1, 4),
    (2, 3, False, True, 2, 3, 7),
    (8, 2, True, False, 2, 2, 3),
]


@pytest.mark.parametrize("bd,views,cc,wbc,turns,pack,chunk", CASES)
def test_chunked_matches_recurrence_outputs_and_gradients(bd, views, cc, wbc, turns, pack, chunk):
    cfg = BlockDiffusionConfig(
        bd_size=bd, views=views, ar_loss_weight=0.2 if cc else 0.0, clean_causal=cc, within_block_causal=wbc
    )
    batch = _batch(bd * 7 + turns, cfg, turns, pack)
    layout = build_layout(batch.meta, cfg, conv_width=4, chunk=chunk)
    N = batch.input_ids.numel()
    got_in, ref_in = _inputs(N), _inputs(N)
    got = two_stream_gated_delta(*got_in, layout)
    want = reference_gated_delta(batch.meta, *ref_in, clean_causal=cc, within_block_causal=wbc)
    real = batch.meta.stream.reshape(-1) >= 0
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-4)
    probe = torch.randn(got.shape, generator=torch.Generator().manual_seed(1)) * real[:, None, None]
    (got * probe).sum().backward()
    (want * probe).sum().backward()
    for a, b in zip(got_in, ref_in):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("bd,views,cc,wbc,turns,pack,chunk", CASES[:3])
def test_conv_taps_before_a_block_read_the_clean_stream(bd, views, cc, wbc, turns, pack, chunk):
    cfg = BlockDiffusionConfig(bd_size=bd, views=views, ar_loss_weight=0.0, clean_causal=cc, within_block_causal=wbc)
    batch = _batch(3, cfg, turns, pack)
    layout = build_layout(batch.meta, cfg, conv_width=4, chunk=chunk)
    x = torch.randn(batch.input_ids.numel(), 6)
    w = torch.randn(6, 4)
    got = two_stream_conv(x, w, None, layout.conv_src)
    want = reference_conv(batch.meta, x, w)
    real = batch.meta.stream.reshape(-1) >= 0
    torch.testing.assert_close(got[real], want[real])


def test_clean_stream_equals_plain_chunked_rule():
    """With one document and no noised view the clean stream is the stock causal gated delta."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    cfg = BlockDiffusionConfig(bd_size=4, views=1)
    batch = _batch(0, cfg, 2, 1)
    layout = build_layout(batch.meta, cfg, conv_width=4, chunk=6)
    N = batch.input_ids.numel()
    q, k, v, g, beta = (x.detach() for x in _inputs(N))
    got = two_stream_gated_delta(q, k, v, g, beta, layout)
    T = batch.input_ids.shape[1]
    for row in range(2):
        sel = (batch.meta.stream[row] == 0).nonzero().flatten() + row * T
        # the stock rule scales q itself: undo ours
        ref, _ = torch_chunk_gated_delta_rule(
            q[sel][None] * q.shape[-1] ** 0.5, k[sel][None], v[sel][None], g[sel][None], beta[sel][None], chunk_size=8
        )
        torch.testing.assert_close(got[sel], ref[0], atol=1e-5, rtol=1e-4)
