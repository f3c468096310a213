"""The three decode modes of DESIGN section 6 as generators: they yield the forwards they need and
receive the logits back, so one definition serves the one-request runner and the batched scheduler.

A mode yields `Forward(rows, keep, rollback)` (send back the logits [len(rows), V], `<|mask|>` banned)
and `Crop(length)` (drop cached tokens past `length`; send back None), and pushes emitted tokens into
the request's output, returning once it is finished. Forwards are counted in the output's stats.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inference.decode_rules import block_decided, denoise_step, first_stop, greedy_accept, speculative_accept
from inference.runner import Rows
from inference.sampling import SamplingParams, pick


@dataclass
class Forward:
    rows: Rows
    keep: int
    rollback: bool = False  # a later Crop may cut back into this forward's clean rows


@dataclass
class Crop:
    length: int


@dataclass
class Request:
    """What a mode needs from its request: sampling, the output sink and the model's token facts."""

    prompt_ids: list[int]
    params: SamplingParams
    gen: torch.Generator
    out: object  # engine._Output: push(tokens) -> finished, stats
    mask_id: int | None
    stop_ids: frozenset[int]
    block_causal: bool = False  # the checkpoint's clean stream is block-causal (clean_causal off)

    def pick(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return pick(logits, self.params, self.mask_id, self.gen)

    def token(self, logits: torch.Tensor) -> int:
        return int(self.pick(logits)[0][0])


def _forward(req: Request, rows: Rows, keep: int, rollback: bool = False):
    logits = yield Forward(rows, keep, rollback)
    req.out.stats.forwards += 1
    return logits


def causal(req: Request):
    logits = yield from _forward(req, Rows().clean(req.prompt_ids, 0), len(req.prompt_ids))
    tok, pos = req.token(logits[-1:]), len(req.prompt_ids)
    while not req.out.push([tok]):
        logits = yield from _forward(req, Rows().clean([tok], pos), 1)
        tok, pos = req.token(logits), pos + 1


def diffusion(req: Request, *, block: int, budget: int, threshold: float, fuse_commit: bool):
    B, mask = block, req.mask_id

    def denoise(rows_logits, canvas, masked, last_step):
        denoise_step(
            rows_logits, canvas, masked, req.params, req.gen, banned=mask, threshold=threshold, last_step=last_step
        )

    def fresh(seed):
        return [seed] + [mask] * (B - 1), [False] + [True] * (B - 1)

    # The prefill is the prompt's commit forward: fused with block 1's first denoise step, unless
    # commits are unfused (then every block, the first included, starts from a visible seed).
    p = len(req.prompt_ids)
    rows = Rows().clean(req.prompt_ids, 0)
    logits = yield from _forward(req, rows.canvas([mask] * B, p) if fuse_commit else rows, p)
    canvas, masked = fresh(req.token(logits[p - 1 : p]))
    steps = 0
    if fuse_commit:
        denoise(logits[p : p + B - 1], canvas, masked, budget <= 1)
        steps = 1
    while True:
        while not block_decided(canvas, masked, req.stop_ids):
            logits = yield from _forward(req, Rows().canvas(canvas, p), 0)
            steps += 1
            denoise(logits[:-1], canvas, masked, steps >= budget)
        stop = first_stop(canvas, req.stop_ids)
        if req.out.push(canvas[: stop + 1] if stop is not None else canvas):
            return
        commit = Rows().commit(canvas, p, block_causal=req.block_causal)
        if fuse_commit:
            logits = yield from _forward(req, commit.canvas([mask] * B, p + B), B)
            canvas, masked = fresh(req.token(logits[B - 1 : B]))
            denoise(logits[B:-1], canvas, masked, budget <= 1)
            steps = 1
        else:
            logits = yield from _forward(req, commit, B)
            (canvas, masked), steps = fresh(req.token(logits[-1:])), 0
        p += B


def self_spec(req: Request, *, draft_len: int):
    N, mask = draft_len, req.mask_id
    # The prefill doubles as a cold step: its last row gives the first token (position c); a canvas whose
    # seed slot is that still-unknown token proposes the drafts after it (rows c..c+N-2 -> c+1..c+N-1).
    c = len(req.prompt_ids)  # cache length; `pending` sits at position c
    logits = yield from _forward(req, Rows().clean(req.prompt_ids, 0).canvas([mask] * N, c), c)
    pending = req.token(logits[c - 1 : c])
    drafts_t, q = req.pick(logits[c : c + N - 1])
    drafts = drafts_t.tolist()
    if req.out.push([pending]):
        return
    while True:
        if drafts is None:  # cold step: one AR token, drafts for the positions after it
            logits = yield from _forward(req, Rows().clean([pending], c).canvas([mask] * (N - 1), c + 1), 1)
            tok = req.token(logits[:1])
            drafts_t, q = req.pick(logits[1:])
            drafts = drafts_t.tolist()
            req.out.stats.accepted[0] += 1
            emitted = [tok]
            c += 1
        else:  # warm step: verify N - 1 drafts, propose the next N - 1
            rows = Rows().clean([pending, *drafts], c).canvas([mask] * (N - 1), c + N)
            logits = yield from _forward(req, rows, N, rollback=True)
            ar_tokens, p_dist = req.pick(logits[:N])
            d = torch.tensor(drafts)
            if req.params.greedy:
                k = greedy_accept(d, ar_tokens.cpu())
                last = int(ar_tokens[k])
            else:
                k, last = speculative_accept(d, q.cpu(), p_dist.cpu(), req.gen)
            req.out.stats.accepted[k] += 1
            emitted = drafts[:k] + [last]
            yield Crop(c + 1 + k)  # pending + accepted drafts stay cached
            c += 1 + k
            if k == N - 1:
                drafts_t, q = req.pick(logits[N:])
                drafts = drafts_t.tolist()
            else:
                drafts = None
        if req.out.push(emitted):
            return
        pending = emitted[-1]
