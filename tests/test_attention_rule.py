"""The attention rule: dense mask vs a brute-force reference, and dense vs flex renderings."""

import random

import pytest
import torch
from torch.nn.attention.flex_attention import create_mask, flex_attention

from bdcore.attention_rule import dense_mask, flex_block_mask, flex_mask_mod
from tests.tiny import FILLER_ID, MASK_ID, random_sample
from train.config import BlockDiffusionConfig
from train.noise import noise_generator
from train.rows import SpecialIds, build_batch

IDS = SpecialIds(mask_id=MASK_ID, filler_id=FILLER_ID)


def reference_mask(meta, clean_causal: bool, within_block_causal: bool) -> torch.Tensor:
    """the table of docs/design.md section 3, pair by pair, with block extents found by scanning the row."""
    B, T = meta.stream.shape
    out = torch.zeros(B, T, T, dtype=torch.bool)
    for b in range(B):
        s, d, p, k_blk = (meta.stream[b].tolist(), meta.doc[b].tolist(), meta.pos[b].tolist(), meta.blk[b].tolist())
        # Block extents: first position over all copies, last position of the clean copy
        # (fillers exist only in the noised copies and may overlap the next turn's positions).
        first, last = {}, {}
        for i in range(T):
            if k_blk[i] >= 0:
                first[k_blk[i]] = min(first.get(k_blk[i], p[i]), p[i])
                if s[i] == 0:
                    last[k_blk[i]] = max(last.get(k_blk[i], p[i]), p[i])
        for q in range(T):
            for k in range(T):
                if s[q] == -1:
                    out[b, q, k] = q == k
                    continue
                if s[k] == -1 or d[q] != d[k]:
                    continue
                if s[q] == 0:
                    if s[k] != 0:
                        continue
                    if k_blk[q] < 0 or clean_causal:
                        out[b, q, k] = p[k] <= p[q]
                    else:  # block-causal: everything up to the last clean token of q's block
                        out[b, q, k] = p[k] <= last[k_blk[q]]
                else:
                    start = first[k_blk[q]]
                    if s[k] == 0:
                        out[b, q, k] = p[k] < start
                    elif s[k] == s[q] and k_blk[k] == k_blk[q]:
                        out[b, q, k] = (p[k] <= p[q]) if within_block_causal else True
    return out


CASES = [(cc, wbc) for cc in (True, False) for wbc in (False, True)]


@pytest.mark.parametrize("clean_causal,wbc", CASES)
@pytest.mark.parametrize("seed", range(3))
def test_dense_mask_matches_brute_force(seed, clean_causal, wbc):
    rng = random.Random(seed)
    cfg = BlockDiffusionConfig(
        bd_size=rng.choice([2, 3, 4]),
        views=rng.choice([1, 2, 3]),
        ar_loss_weight=0.0,
        clean_causal=clean_causal,
        within_block_causal=wbc,
    )
    rows = [
        [random_sample(rng, turns=rng.randint(1, 3), max_prompt=4, max_resp=7) for _ in range(rng.randint(1, 3))]
        for _ in range(2)
    ]
    b = build_batch(rows, cfg, IDS, noise_generator(seed, 0, 0))
    got = dense_mask(b.meta, clean_causal=clean_causal, within_block_causal=wbc)[:, 0]
    want = reference_mask(b.meta, clean_causal, wbc)
    assert torch.equal(got, want)
    assert got.any(-1).all(), "every query row sees at least one key (no NaN rows in SDPA)"


@pytest.mark.parametrize("clean_causal,wbc", CASES)
def test_flex_mask_equals_dense_mask(clean_causal, wbc):
    rng = random.Random(5)
    cfg = BlockDiffusionConfig(bd_size=4, ar_loss_weight=0.0, clean_causal=clean_causal, within_block_causal=wbc)
    rows = [[random_sample(rng, turns=2, max_prompt=20, max_resp=30) for _ in range(3)] for _ in range(2)]
    b = build_batch(rows, cfg, IDS, noise_generator(1, 0, 0))
    T = b.input_ids.shape[1]
    rule = dict(clean_causal=clean_causal, within_block_causal=wbc)
    dense = dense_mask(b.meta, **rule)
    # Token level: the mask_mod evaluated everywhere equals the dense mask.
    token = create_mask(flex_mask_mod(b.meta, **rule), 2, 1, T, T, device="cpu")
    assert torch.equal(token, dense)
    # Block level: the BlockMask marks exactly the tiles that hold a visible pair.
    bs = 16
    bm = flex_block_mask(b.meta, **rule, block_size=bs)
    nb = -(-T // bs)
    padded = torch.zeros(2, 1, nb * bs, nb * bs, dtype=torch.bool)
    padded[..., :T, :T] = dense
    tiles = padded.view(2, 1, nb, bs, nb, bs).any(-1).any(-2)
    assert torch.equal(bm.to_dense().bool(), tiles)
    # And attention through the BlockMask equals SDPA through the dense mask.
    q, k, v = (torch.randn(2, 2, T, 8) for _ in range(3))
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense)
    got = flex_attention(q, k, v, block_mask=bm)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
