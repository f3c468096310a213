"""The objective (docs/design.md section 4) against hand-computed references."""

import math
import random

import pytest
import torch

from tests.tiny import FILLER_ID, MASK_ID, random_sample, tiny_model
from train.config import BlockDiffusionConfig
from train.loss import combine_losses, token_ce
from train.model import TwoStreamLM
from train.noise import noise_generator
from train.rows import SpecialIds, build_batch

IDS = SpecialIds(mask_id=MASK_ID, filler_id=FILLER_ID)


def test_token_ce_by_hand():
    hidden = torch.tensor([[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]])
    weight = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, -1.0]])
    labels = torch.tensor([0, 2, 1])
    got = token_ce(hidden, weight, labels, chunk_rows=2)
    want = []
    for h, y in zip(hidden.tolist(), labels.tolist()):
        z = [sum(a * b for a, b in zip(h, w)) for w in weight.tolist()]
        want.append(math.log(sum(math.exp(v) for v in z)) - z[y])
    torch.testing.assert_close(got, torch.tensor(want))


def test_combine_by_hand():
    diff_ce = torch.tensor([1.0, 2.0, 4.0])
    rate = torch.tensor([0.5, 0.25, 1.0])
    ar_ce = torch.tensor([3.0, 5.0])
    uni = combine_losses(diff_ce, rate, ar_ce, BlockDiffusionConfig(ar_loss_weight=0.5))
    assert uni.diff.item() == pytest.approx(7 / 3)
    assert uni.ar.item() == pytest.approx(4.0)
    assert uni.loss.item() == pytest.approx((7 / 3 + 0.5 * 4.0) / 1.5)
    inv = combine_losses(diff_ce, rate, ar_ce, BlockDiffusionConfig(ar_loss_weight=0.5, loss_weighting="inverse_rate"))
    # weights 2, 4, 1 normalised to mean 1: (2*1 + 4*2 + 1*4) / 7
    assert inv.diff.item() == pytest.approx(14 / 7)
    no_ar = combine_losses(diff_ce, rate, ar_ce, BlockDiffusionConfig(ar_loss_weight=0.0))
    assert no_ar.loss.item() == pytest.approx(7 / 3)
    glob = combine_losses(diff_ce, rate, ar_ce, BlockDiffusionConfig(ar_loss_weight=1.0), diff_norm=7.0, ar_norm=4.0)
    assert glob.loss.item() == pytest.approx((7 / 7 + 8 / 4) / 2)


def test_prefix_weights_by_hand():
    diff_ce = torch.tensor([1.0, 2.0, 4.0])
    rate = torch.tensor([0.5, 0.25, 1.0])
    offset = torch.tensor([0, 2, 1])
    cfg = BlockDiffusionConfig(ar_loss_weight=0.0, prefix_gamma=2.0)
    got = combine_losses(diff_ce, rate, torch.zeros(0), cfg, diff_offset=offset)
    w = [1.0, math.exp(-1.0), math.exp(-0.5)]
    assert got.diff.item() == pytest.approx((w[0] * 1 + w[1] * 2 + w[2] * 4) / sum(w))
    both = BlockDiffusionConfig(ar_loss_weight=0.0, prefix_gamma=2.0, loss_weighting="inverse_rate")
    got = combine_losses(diff_ce, rate, torch.zeros(0), both, diff_offset=offset)
    w = [2 * w[0], 4 * w[1], 1 * w[2]]
    assert got.diff.item() == pytest.approx((w[0] * 1 + w[1] * 2 + w[2] * 4) / sum(w))
    with pytest.raises(ValueError, match="draft offset"):
        combine_losses(diff_ce, rate, torch.zeros(0), cfg)
    with pytest.raises(ValueError, match="prefix_gamma"):
        BlockDiffusionConfig(prefix_gamma=-1.0)


def test_chunked_ce_matches_plain_in_value_and_gradient():
    torch.manual_seed(0)
    h = torch.randn(37, 16, requires_grad=True)
    w = torch.randn(50, 16, requires_grad=True)
    y = torch.randint(0, 50, (37,))
    a = token_ce(h, w, y, chunk_rows=8)
    ga = torch.autograd.grad(a.sum(), (h, w))
    b = torch.nn.functional.cross_entropy(h @ w.t(), y, reduction="none")
    gb = torch.autograd.grad(b.sum(), (h, w))
    torch.testing.assert_close(a, b)
    for x, z in zip(ga, gb):
        torch.testing.assert_close(x, z)


@pytest.mark.parametrize("weighting,gamma", [("uniform", 0.0), ("inverse_rate", 0.0), ("uniform", 1.5)])
@pytest.mark.parametrize("ar_w", [0.0, 0.3])
def test_model_loss_equals_reference_from_full_logits(weighting, gamma, ar_w):
    model = tiny_model("qwen3", tied=False)
    rng = random.Random(4)
    rows = [[random_sample(rng, turns=2) for _ in range(2)] for _ in range(2)]
    cfg = BlockDiffusionConfig(bd_size=4, ar_loss_weight=ar_w, loss_weighting=weighting, prefix_gamma=gamma)
    batch = build_batch(rows, cfg, IDS, noise_generator(4, 0, 0))
    lm = TwoStreamLM(model, cfg, ce_chunk_rows=7)
    with torch.no_grad():
        got = lm(batch)
        logp = torch.log_softmax(lm.logits(batch).flatten(0, 1), -1)
    diff_nll = -logp[batch.diff_index, batch.diff_labels]
    w = 1 / batch.diff_rate if weighting == "inverse_rate" else torch.ones_like(diff_nll)
    if gamma:  # the target at block offset k (k = 1 right after the seed) is draft k - 1
        target = batch.diff_index + 1
        k = batch.meta.pos.flatten()[target] - batch.meta.bstart.flatten()[target]
        assert k.min() == 1 and k.max() == 3
        w = w * torch.exp(-(k - 1).float() / gamma)
    diff = (w / w.mean() * diff_nll).mean()
    ar = (-logp[batch.ar_index, batch.ar_labels]).mean()
    want = (diff + ar_w * ar) / (1 + ar_w)
    torch.testing.assert_close(got.loss, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.diff, diff, atol=1e-5, rtol=1e-5)
    assert got.num_diff_tokens == batch.diff_index.numel() > 0
    assert got.num_ar_tokens == (batch.ar_index.numel() if ar_w > 0 else 0)


@pytest.mark.parametrize("arch,tied", [("qwen3", True), ("qwen3", False), ("llama", False)])
def test_gradients_reach_every_trainable_parameter(arch, tied):
    model = tiny_model(arch, tied=tied).train()
    rng = random.Random(9)
    rows = [[random_sample(rng, turns=2) for _ in range(2)]]
    cfg = BlockDiffusionConfig(bd_size=4, ar_loss_weight=0.2)
    TwoStreamLM(model, cfg)(build_batch(rows, cfg, IDS, noise_generator(0, 0, 0))).loss.backward()
    missing = [n for n, p in model.named_parameters() if p.requires_grad and (p.grad is None or not p.grad.any())]
    assert not missing


@pytest.mark.parametrize("attn", [pytest.param("flex_attention", marks=pytest.mark.e2e), "eager"])  # flex: compiles
def test_other_attention_backends_render_the_same_rule(attn):
    ref = tiny_model("qwen3")
    other = tiny_model("qwen3", attn=attn)
    other.load_state_dict(ref.state_dict())
    rng = random.Random(2)
    rows = [[random_sample(rng, turns=2) for _ in range(2)] for _ in range(2)]
    cfg = BlockDiffusionConfig(bd_size=4)
    batch = build_batch(rows, cfg, IDS, noise_generator(0, 0, 0))
    real = batch.meta.stream >= 0
    with torch.no_grad():
        want = TwoStreamLM(ref, cfg).logits(batch)[real]
        got = TwoStreamLM(other, cfg).logits(batch)[real]
    torch.testing.assert_close(got, want, atol=5e-5, rtol=1e-5)


def test_ar_only_loss_is_the_plain_sft_loss():
    model = tiny_model("llama")
    rng = random.Random(1)
    samples = [random_sample(rng, turns=2) for _ in range(2)]
    cfg = BlockDiffusionConfig(views=0, ar_loss_weight=1.0)
    batch = build_batch([[s] for s in samples], cfg, IDS, noise_generator(0, 0, 0))
    with torch.no_grad():
        got = TwoStreamLM(model, cfg)(batch).loss
        nll = []
        for s in samples:  # plain HF forward, labels on response tokens only
            logits = model(input_ids=torch.tensor([list(s.input_ids)])).logits[0]
            for start, end in s.spans:
                for t in range(start, end):
                    nll.append(-torch.log_softmax(logits[t - 1], -1)[s.input_ids[t]])
    torch.testing.assert_close(got, torch.stack(nll).mean(), atol=1e-5, rtol=1e-5)
