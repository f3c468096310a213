"""Block-sparse SDPA (CPU training) equals dense SDPA in logits and gradients."""

import copy
import random

import pytest
import torch

from tests.numerics import assert_as_close_to_truth
from tests.tiny import FILLER_ID, MASK_ID, random_sample, tiny_hybrid_model, tiny_model
from train import sparse_attention
from train.config import BlockDiffusionConfig
from train.model import TwoStreamLM
from train.noise import noise_generator
from train.rows import SpecialIds, build_batch

IDS = SpecialIds(mask_id=MASK_ID, filler_id=FILLER_ID)


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen3_5"])
def test_sparse_equals_dense_logits_and_gradients(arch, monkeypatch):
    monkeypatch.setattr(sparse_attention, "TILE", 16)  # several tiles per row even on tiny rows
    make = tiny_hybrid_model if arch == "qwen3_5" else (lambda: tiny_model(arch))
    dense_model, sparse_model = make(), make()
    rng = random.Random(3)
    rows = [[random_sample(rng, turns=2, max_prompt=20, max_resp=24) for _ in range(3)] for _ in range(2)]
    cfg = BlockDiffusionConfig(bd_size=4, ar_loss_weight=0.3)
    batch = build_batch(rows, cfg, IDS, noise_generator(0, 0, 0))
    truth_model = copy.deepcopy(dense_model).double()  # the fp64 truth both fp32 paths approximate
    dense = TwoStreamLM(dense_model, cfg, cpu_block_sparse=False)
    truth = TwoStreamLM(truth_model, cfg, cpu_block_sparse=False)
    sparse = TwoStreamLM(sparse_model, cfg, cpu_block_sparse=True)
    assert sparse_model.config._attn_implementation == sparse_attention.NAME
    real = batch.meta.stream >= 0
    with torch.no_grad():
        logits = [lm.logits(batch)[real] for lm in (sparse, dense, truth)]
    assert_as_close_to_truth(*logits, "logits")
    for lm in (dense, sparse, truth):
        lm(batch).loss.backward()
    params = zip(dense_model.named_parameters(), sparse_model.parameters(), truth_model.parameters())
    for (n, a), b, t in params:
        assert_as_close_to_truth(b.grad, a.grad, t.grad, f"gradient of {n}")


def test_plain_forward_of_a_switched_model_is_unchanged():
    base, switched = tiny_model("qwen3"), tiny_model("qwen3")
    TwoStreamLM(switched, BlockDiffusionConfig(bd_size=4), cpu_block_sparse=True)
    ids = torch.randint(0, 90, (2, 17))
    pad = torch.ones_like(ids)
    pad[1, :5] = 0  # left padding must still be honoured (the mask function is registered too)
    with torch.no_grad():
        torch.testing.assert_close(
            switched(input_ids=ids, attention_mask=pad).logits[pad.bool()],
            base(input_ids=ids, attention_mask=pad).logits[pad.bool()],
            atol=1e-5,
            rtol=1e-5,
        )
    assert copy.deepcopy(switched.config)._attn_implementation == sparse_attention.NAME


def test_a_new_mask_never_reuses_an_old_plan():
    """Masks of one shape come and go every step; a plan must follow the mask object, not its address."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 40, 8) for _ in range(3))

    class Module:
        training = False

    for seed in range(6):
        g = torch.Generator().manual_seed(seed)
        mask = torch.rand(1, 1, 40, 40, generator=g) < 0.3
        mask |= torch.eye(40, dtype=torch.bool)  # every row sees something
        got, _ = sparse_attention.sparse_sdpa_forward(Module(), q, k, v, mask)
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)
        torch.testing.assert_close(got, want)
        del mask
