"""AdamW and the warm-up + cosine learning-rate schedule."""

from __future__ import annotations

import math

import torch


def build_optimizer(model: torch.nn.Module, *, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only (not norms, biases or other vectors)."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)


def lr_factor(step: int, *, warmup: int, max_steps: int, min_ratio: float) -> float:
    """Multiplier of the peak lr at optimizer step `step` (0-based): linear warm-up, then cosine to min_ratio."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    span = max(1, max_steps - warmup)
    progress = min(1.0, (step - warmup) / span)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(opt, *, warmup: int, max_steps: int, min_ratio: float):
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, warmup=warmup, max_steps=max_steps, min_ratio=min_ratio)
    )


def fast_forward(sched, step: int) -> None:
    """Put a fresh scheduler at `step` completed optimizer steps (the lr it gives is recomputed, not loaded)."""
    sched.last_epoch = step
    for group, base, fn in zip(sched.optimizer.param_groups, sched.base_lrs, sched.lr_lambdas):
        group["lr"] = base * fn(step)
    sched._last_lr = [g["lr"] for g in sched.optimizer.param_groups]
