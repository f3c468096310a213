"""The decode rules of docs/design.md section 6, backend-neutral: plain tensors in, decisions out.

The decoders (`modes.py`) call these for the native engine, the SGLang and vLLM adapters and the trainer's
rollouts alike, so the logic CI tests on CPU is the logic that runs on GPUs.
"""

from __future__ import annotations

import torch

from bdcore.decode.sampling import SamplingParams, pick


def commit_slots(
    confidence: torch.Tensor, masked: torch.Tensor, *, threshold: float, last_step: bool, left_to_right: bool = False
) -> torch.Tensor:
    """Which canvas slots to commit this denoise step.

    Every masked slot whose confidence exceeds `threshold`; at least one (the most confident masked
    slot); every masked slot on the last allowed step. `left_to_right`: exactly the first masked slot
    (block-by-block causal decoding of an unshifted checkpoint). confidence, masked: [S] -> bool [S].
    """
    if left_to_right:
        first = torch.zeros_like(masked)
        if masked.any():
            first[int(masked.int().argmax())] = True
        return first
    if last_step:
        return masked.clone()
    commit = masked & (confidence > threshold)
    if masked.any() and not commit.any():
        best = torch.where(masked, confidence, torch.full_like(confidence, -1.0)).argmax()
        commit[best] = True
    return commit


def denoise_step(
    logits_rows: torch.Tensor,
    canvas: list[int],
    masked: list[bool],
    params: SamplingParams,
    generator,
    *,
    banned: int | None,
    threshold: float,
    last_step: bool,
    shift: bool = True,
    left_to_right: bool = False,
) -> None:
    """One denoise step of a canvas, in place: row j of `logits_rows` predicts slot j + 1 of a shifted
    canvas ([S-1, V]; slot 0 is the seed), slot j of an unshifted one ([S, V]).

    Masked slots get the row's token (argmax, or a draw when sampling) when `commit_slots` picks them;
    confidence is the token's probability under the sampling distribution (the plain softmax when greedy).
    """
    first = 1 if shift else 0
    tokens, probs = pick(logits_rows, params, banned, generator)
    if probs is None:  # greedy: score by the plain softmax
        probs = logits_rows.float().softmax(-1)
    conf = probs.gather(-1, tokens[:, None]).squeeze(-1)
    commit = commit_slots(
        conf.cpu(), torch.tensor(masked[first:]), threshold=threshold, last_step=last_step, left_to_right=left_to_right
    )
    for s in commit.nonzero().flatten().tolist():
        canvas[s + first] = int(tokens[s])
        masked[s + first] = False


def block_decided(canvas: list[int], masked: list[bool], stop_ids) -> bool:
    """A canvas needs no more denoising: nothing is masked, or a stop token is committed with every slot
    up to it decided (the answer ends in this block)."""
    if not any(masked):
        return True
    stop = first_stop(canvas, stop_ids)
    return stop is not None and not any(masked[: stop + 1])


def greedy_accept(drafts: torch.Tensor, ar_tokens: torch.Tensor) -> int:
    """Number of leading drafts equal to the AR head's tokens at the same positions.

    drafts: [n] proposed tokens for positions c+1..c+n; ar_tokens: [n + 1] AR argmax for c+1..c+n+1.
    The caller emits drafts[:k] and then ar_tokens[k] (the correction, or the bonus token).
    """
    n = drafts.numel()
    agree = (drafts == ar_tokens[:n]).int()
    return int(agree.cumprod(0).sum()) if n else 0


def speculative_accept(
    drafts: torch.Tensor, q: torch.Tensor, p: torch.Tensor, generator: torch.Generator | None
) -> tuple[int, int]:
    """Speculative rejection sampling: output tokens follow the target distribution p exactly.

    drafts: [n] tokens drawn from q [n, V]; p: [n + 1, V] target (AR) distributions for the same
    positions plus the bonus one. Returns (k accepted drafts, the token to emit after them).
    """
    n = drafts.numel()
    for i in range(n):
        d = int(drafts[i])
        ratio = float(p[i, d]) / max(float(q[i, d]), 1e-20)
        u = float(torch.rand((), generator=generator))
        if u >= min(1.0, ratio):
            residual = (p[i] - q[i]).clamp_min(0)
            total = float(residual.sum())
            dist = residual / total if total > 0 else p[i]
            return i, int(torch.multinomial(dist.cpu(), 1, generator=generator))
    return n, int(torch.multinomial(p[n].cpu(), 1, generator=generator))


def first_stop(tokens: list[int], stop_ids: set[int]) -> int | None:
    """Index of the first end-of-turn / filler token, if any."""
    for i, t in enumerate(tokens):
        if t in stop_ids:
            return i
    return None
