"""LoRA+ (`--lora_plus_ratio`): the LoRA B matrices learn at a multiple of --lr, everything else at --lr, the
schedule scales both alike, and a real AdamW step on a draft adapter moves B by that multiple."""

import random

import pytest
import torch

from bdcore.draft_adapter import MASK_ROW, LoraSpec, add_lora
from tests.tiny import FILLER_ID, MASK_ID, random_sample, tiny_model
from train.config import BlockDiffusionConfig
from train.model import TwoStreamLM
from train.noise import noise_generator
from train.optim import build_optimizer, build_scheduler, lr_factor
from train.rows import SpecialIds, build_batch

CFG = BlockDiffusionConfig(bd_size=4, views=2, ar_loss_weight=0.0, clean_causal=True)
LR = 1e-3


def _adapter_lm():
    model = add_lora(tiny_model(), LoraSpec(rank=4, alpha=8), MASK_ID)  # B = 0, as a conversion starts
    lm = TwoStreamLM(model, CFG, frozen_clean=True)
    for name, p in lm.named_parameters():
        p.requires_grad_("lora_" in name or MASK_ROW in name)
    return lm


def _names(lm, opt):
    ids = {id(p): n for n, p in lm.named_parameters()}
    return [(g["lr"], sorted(ids[id(p)] for p in g["params"])) for g in opt.param_groups]


def test_only_the_b_matrices_get_the_ratio():
    lm = _adapter_lm()
    trainable = {n for n, p in lm.named_parameters() if p.requires_grad}
    groups = _names(lm, build_optimizer(lm, lr=LR, weight_decay=0.1, lora_b_lr_ratio=8.0))
    fast = [names for lr, names in groups if lr == pytest.approx(8 * LR)]
    slow = {n for lr, names in groups if lr == pytest.approx(LR) for n in names}
    assert len(fast) == 1 and fast[0] and all(".lora_B." in n for n in fast[0])
    assert set(fast[0]) == {n for n in trainable if ".lora_B." in n}
    assert slow == trainable - set(fast[0]) and any(MASK_ROW in n for n in slow)
    one_rate = _names(lm, build_optimizer(lm, lr=LR, weight_decay=0.1))  # ratio 1: the two groups of before
    assert [lr for lr, _ in one_rate] == [LR, LR] and {n for _, names in one_rate for n in names} == trainable


def test_the_schedule_scales_every_group_alike():
    lm = _adapter_lm()
    opt = build_optimizer(lm, lr=LR, weight_decay=0.0, lora_b_lr_ratio=4.0)
    sched = build_scheduler(opt, warmup=4, max_steps=10, min_ratio=0.1)
    for step in range(1, 8):
        opt.step(), sched.step()
        factor = lr_factor(step, warmup=4, max_steps=10, min_ratio=0.1)
        assert sorted(g["lr"] for g in opt.param_groups) == pytest.approx([factor * LR] * 2 + [4 * factor * LR])


def test_a_real_step_moves_b_by_the_ratio():
    """Adam's first step moves each weight by lr * g / (|g| + eps): about lr where the gradient is not tiny,
    so the largest move of a B matrix is ratio * lr and of the `<|mask|>` row lr."""
    rng = random.Random(0)
    rows = [[random_sample(rng, max_prompt=10, max_resp=14)] for _ in range(2)]
    batch = build_batch(rows, CFG, SpecialIds(MASK_ID, FILLER_ID), noise_generator(0, 0, 0))
    moves = {}
    for ratio in (1.0, 16.0):
        torch.manual_seed(0)
        lm = _adapter_lm()
        before = {n: p.detach().clone() for n, p in lm.named_parameters() if p.requires_grad}
        opt = build_optimizer(lm, lr=LR, weight_decay=0.0, lora_b_lr_ratio=ratio)
        lm(batch).loss.backward()
        opt.step()
        delta = {n: (p.detach() - before[n]).abs().max().item() for n, p in lm.named_parameters() if n in before}
        moves[ratio] = (
            max(d for n, d in delta.items() if ".lora_B." in n),
            max(d for n, d in delta.items() if ".lora_A." in n),  # 0: A's gradient is 0 while B is 0
            max(d for n, d in delta.items() if MASK_ROW in n),
        )
    for ratio, (b, a, row) in moves.items():
        assert b == pytest.approx(ratio * LR, rel=1e-2) and row == pytest.approx(LR, rel=1e-2) and a == 0.0


def test_a_model_without_lora_refuses_a_ratio():
    with pytest.raises(ValueError, match="no LoRA B"):
        build_optimizer(tiny_model(), lr=LR, weight_decay=0.0, lora_b_lr_ratio=2.0)
