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


def _chunk_draft(
    hidden: torch.Tensor,
    teacher_hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    has_teacher: torch.Tensor,
    cfg: BlockDiffusionConfig,
    ban: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = (hidden @ weight.t()).float()
    with torch.no_grad():
        teacher = (teacher_hidden @ weight.t()).float()
    if ban is not None and ban < logits.shape[-1]:  # <|mask|>: never served, so neither side's mass goes there
        logits, teacher = logits.clone(), teacher.clone()
        logits[:, ban] = teacher[:, ban] = float("-inf")
    ce = F.cross_entropy(logits, labels, reduction="none")
    term = ce
    if cfg.draft_loss != "ce":
        t = cfg.draft_temperature
        student_logp, teacher_logp = (logits / t).log_softmax(-1), (teacher / t).log_softmax(-1)
        p = teacher_logp.exp()
        kl = torch.where(p > 0, p * (teacher_logp - student_logp), torch.zeros_like(p)).sum(-1) * (t * t)
        distilled = kl if cfg.draft_loss == "kl" else cfg.draft_kl_mix * kl + (1.0 - cfg.draft_kl_mix) * ce
        term = torch.where(has_teacher, distilled, ce)
    if not cfg.chain_weights:  # the acceptance only weighs the chain: not computed (or recomputed) otherwise
        return term, term.new_zeros(0)
    with torch.no_grad():  # how likely self-spec accepts this draft: 1 - TV(drafter, verifier) at temperature 1
        probs = logits.softmax(-1)
        accept = 1.0 - 0.5 * (probs - teacher.softmax(-1)).abs().sum(-1)
        accept = torch.where(has_teacher, accept, probs.gather(-1, labels[:, None]).squeeze(-1))
    return term, accept


def draft_loss(
    hidden: torch.Tensor,
    teacher_hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    has_teacher: torch.Tensor,
    cfg: BlockDiffusionConfig,
    *,
    ban: int | None = None,
    chunk_rows: int = 2048,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per drafting row: its loss under `cfg.draft_loss` against the verifier's rows `teacher_hidden` (detached:
    the teacher is what self-spec verifies against, never trained through this term) and the data's `labels`;
    and, with `cfg.chain_weights` (else empty), the probability (detached) that self-spec accepts its draft. A
    row where `has_teacher` is False (a filler past its document's end, which no AR row predicts) learns its
    label by cross-entropy. [M, H] x2 -> [M], [M] (fp32)."""
    teacher_hidden = teacher_hidden.detach()
    if hidden.shape[0] == 0:
        zero = hidden.new_zeros(0, dtype=torch.float32)
        return zero + 0.0 * weight.sum(), zero
    terms, accepts = [], []
    for start in range(0, hidden.shape[0], chunk_rows):
        part = slice(start, start + chunk_rows)
        args = (hidden[part], teacher_hidden[part], weight, labels[part], has_teacher[part], cfg, ban)
        if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
            term, accept = checkpoint(_chunk_draft, *args, use_reentrant=False)
        else:
            term, accept = _chunk_draft(*args)
        terms.append(term)
        accepts.append(accept.detach())
    return torch.cat(terms), torch.cat(accepts)


def chain_weights(accept: torch.Tensor, block: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """Each drafting slot's probability that every slot before it in its block is accepted: the product of
    `accept` over the block's earlier offsets (their mean where several views draft one offset; a slot no view
    drafts counts as accepted). Two complementary views draft every slot of a block once between them, so each
    block's chain is whole. [M] -> [M], detached."""
    accept, offset = accept.detach().double().clamp_min(1e-12), offset.long()
    width = int(offset.max()) + 1 if offset.numel() else 1
    pairs, where = torch.unique(block.long() * width + offset, return_inverse=True)  # sorted: by block, then offset
    log_a = torch.zeros(len(pairs), dtype=torch.float64).index_add_(0, where, accept.log())
    log_a /= torch.zeros(len(pairs), dtype=torch.float64).index_add_(0, where, torch.ones_like(accept))
    before = log_a.cumsum(0) - log_a  # the sum over every earlier pair ...
    owner = pairs // width
    first = torch.ones_like(owner, dtype=torch.bool)
    first[1:] = owner[1:] != owner[:-1]
    start = torch.cummax(torch.where(first, torch.arange(len(pairs)), 0), 0).values
    before = before - before[start]  # ... less the pairs of earlier blocks
    return before.exp()[where].float()


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
    chain: torch.Tensor | None = None,
) -> LossParts:
    """Combine per-token CEs into the objective.

    `diff_norm` / `ar_norm` override the local denominators (sum of diffusion weights, number of AR
    targets) so a trainer can normalise by global totals across micro-batches and ranks; a weighted
    mean with weights normalised to mean 1 equals sum(w * ce) / sum(w).
    """
    w = diffusion_weights(diff_rate, cfg, diff_offset)
    if chain is not None:
        # redistributes the micro-batch's weight, never its total: the trainer's normaliser (the sum of the
        # fixed weights over every micro-batch, known before the forward) stays exact
        w = w * chain * (w.sum() / (w * chain).sum().clamp_min(1e-12))
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
