"""The block-diffusion objective (docs/design.md section 4).

Logits are only ever formed at supervised rows: the caller gathers those hidden states first,
then `token_ce` projects and scores them chunk by chunk (recomputed in backward, so a chunk's
[rows, vocab] logits never outlive it), or with Liger's fused linear CE on CUDA.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from train.config import BlockDiffusionConfig


def liger_available() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("liger_kernel") is not None


def _chunk_ce(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = (hidden @ weight.t()).float()
    return F.cross_entropy(logits, labels, reduction="none")


def token_ce(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    chunk_rows: int = 2048,
    fused: bool = False,
) -> torch.Tensor:
    """Per-row cross entropy of `hidden @ weight.T` against `labels`; [M, H] -> [M] (fp32)."""
    if hidden.shape[0] == 0:
        return hidden.new_zeros(0, dtype=torch.float32) + 0.0 * weight.sum()
    if fused:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

        return LigerFusedLinearCrossEntropyLoss(reduction="none")(weight, hidden, labels).float()
    parts = []
    for start in range(0, hidden.shape[0], chunk_rows):
        h, y = hidden[start : start + chunk_rows], labels[start : start + chunk_rows]
        if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
            parts.append(checkpoint(_chunk_ce, h, weight, y, use_reentrant=False))
        else:
            parts.append(_chunk_ce(h, weight, y))
    return torch.cat(parts)


@dataclass
class LossParts:
    loss: torch.Tensor  # (diff + w * ar) / (1 + w), what backward runs on
    diff: torch.Tensor  # weighted mean diffusion CE (detached)
    ar: torch.Tensor  # mean AR CE (detached)
    num_diff_tokens: int
    num_ar_tokens: int
    aux: torch.Tensor | None = None  # mixture of experts: the router's load-balancing loss (detached), in `loss`


def diffusion_weights(
    rate: torch.Tensor, cfg: BlockDiffusionConfig, offset: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-target weights: 1 (uniform) or 1/rate of the target's own view (inverse_rate), times
    exp(-offset/prefix_gamma) with `prefix_gamma` > 0 (`offset`: which draft of its block the target is)."""
    w = 1.0 / rate.float() if cfg.loss_weighting == "inverse_rate" else torch.ones_like(rate, dtype=torch.float32)
    if cfg.prefix_gamma > 0:
        if offset is None:
            raise ValueError("prefix_gamma needs each diffusion target's draft offset; this objective has none")
        w = w * torch.exp(-offset.float() / cfg.prefix_gamma)
    return w


def combine_losses(
    diff_ce: torch.Tensor,
    diff_rate: torch.Tensor,
    ar_ce: torch.Tensor,
    cfg: BlockDiffusionConfig,
    *,
    diff_norm: float | torch.Tensor | None = None,
    ar_norm: float | torch.Tensor | None = None,
    diff_offset: torch.Tensor | None = None,
) -> LossParts:
    """Combine per-token CEs into the objective.

    `diff_norm` / `ar_norm` override the local denominators (sum of diffusion weights, number of AR
    targets) so a trainer can normalise by global totals across micro-batches and ranks; a weighted
    mean with weights normalised to mean 1 equals sum(w * ce) / sum(w).
    """
    w = diffusion_weights(diff_rate, cfg, diff_offset)
    d_den = w.sum() if diff_norm is None else diff_norm
    a_den = ar_ce.new_tensor(ar_ce.numel()) if ar_norm is None else ar_norm
    diff = (w * diff_ce).sum() / torch.clamp_min(torch.as_tensor(d_den, dtype=torch.float32), 1e-12)
    ar = ar_ce.sum() / torch.clamp_min(torch.as_tensor(a_den, dtype=torch.float32), 1.0)
    arw = cfg.ar_loss_weight
    if cfg.ar_only:
        loss = ar
    else:
        loss = (diff + arw * ar) / (1.0 + arw) if arw > 0 else diff
    return LossParts(loss, diff.detach(), ar.detach(), int(diff_ce.numel()), int(ar_ce.numel()))
