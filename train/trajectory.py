"""The log-probability of a block-diffusion trajectory under the student: one shared definition.

A rollout (`train/rollout.py`) commits every answer token from some state: a block's seed from an AR
row (the clean context), every other token from a canvas (the block's slots, some still masked). The
log-probability of a trajectory is the sum over its committed tokens of the student's log-probability
of that token in the state it was committed from (`<|mask|>` banned, temperature 1). The order in which
slots were committed enters only through those states (which slots a state still masked); the choice
of which slots to commit at a step (the threshold rule) is a deterministic function of the student's own
confidences and contributes no probability of its own. Tokens committed past the answer's stop token are
discarded by decoding and are not part of the trajectory.

`trajectory_logprobs` recomputes these log-probabilities with one differentiable training forward per
batch of rollouts: a two-stream row whose clean stream is [prompt, answer], followed by every recorded
canvas state as its own noised segment (a view of its own, at its block's positions), so each state
sees exactly the clean context before its block and itself, as at decode time. On-policy distillation
and RL both score trajectories with it, and it equals what the student computed while decoding
(`tests/test_trajectory.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bdcore.attention_rule import CLEAN_STREAM, PAD_STREAM, TokenMeta
from train.rollout import Rollout
from train.rows import TwoStreamBatch


@dataclass
class ScoredRows:
    """A batch of trajectory rows and, per committed token, the row that scores it."""

    batch: TwoStreamBatch
    rows: torch.Tensor  # [N] flat index (row * T + t) of the row predicting each committed token
    targets: torch.Tensor  # [N] the committed tokens
    owner: torch.Tensor  # [N] index of the rollout each token belongs to
    index: torch.Tensor  # [N] its place in that rollout's response
    from_canvas: torch.Tensor  # [N] bool: committed from a canvas (False: a seed, from an AR row)
    canvas_first: list[int]  # per recorded canvas, in rollout and step order: flat index of the row before it


def _empty() -> torch.Tensor:
    return torch.zeros(0, dtype=torch.long)


class _Row:
    """One trajectory row's tokens and per-token metadata, appended run by run."""

    def __init__(self):
        self.cols = {k: [] for k in ("input", *TokenMeta._fields)}

    def add(self, tokens: list[int], stream: int, start: int, blk: int, bstart: int | None) -> int:
        """Tokens at positions start, start+1, ...; `bstart` None: each token is its own block start.
        Returns the index of the first one."""
        first = len(self.cols["input"])
        for i, t in enumerate(tokens):
            values = (t, stream, 0, start + i, blk, start + i if bstart is None else bstart)
            for key, value in zip(self.cols, values):
                self.cols[key].append(value)
        return first


def trajectory_rows(rollouts: list[Rollout], *, block: int, filler_id: int) -> ScoredRows:
    """Lay out every rollout as one row: [clean prompt + answer ; one segment per recorded canvas]."""
    built, rows, targets, owner, index, from_canvas, canvas_first = [], [], [], [], [], [], []
    for r, ro in enumerate(rollouts):
        P, resp = len(ro.prompt_ids), ro.response
        end = P + len(resp)  # positions at or past `end` lie beyond the answer
        row = _Row()
        row.add(list(ro.prompt_ids), CLEAN_STREAM, 0, -1, None)
        for k in range(0, len(resp), block):
            row.add(resp[k : k + block], CLEAN_STREAM, P + k, k // block, P + k)
        view = 0
        for step in ro.steps:
            kept = [(s, t) for s, t in zip(step.slots, step.tokens) if step.start + s < end]
            if step.canvas is None:  # a seed: the AR row before it scores it
                first = step.start - 1
            else:  # its own view at its block's positions, scored by the canvas rows
                view += 1
                first = row.add(step.canvas, view, step.start, (step.start - P) // block, step.start) - 1
                canvas_first.append((r, first))
            for s, t in kept:
                rows.append((r, first + s)), targets.append(t), owner.append(r)
                index.append(step.start + s - P), from_canvas.append(step.canvas is not None)
        built.append(row.cols)
    T = max(len(cols["input"]) for cols in built)
    pad = {"input": filler_id, "stream": PAD_STREAM, "doc": -1, "pos": 0, "blk": -1, "bstart": 0}
    t = {k: torch.tensor([cols[k] + [pad[k]] * (T - len(cols[k])) for cols in built]) for k in pad}
    meta = TokenMeta(*(t[f] for f in TokenMeta._fields))
    batch = TwoStreamBatch(
        input_ids=t["input"],
        meta=meta,
        clean_ids=t["input"],
        masked=torch.zeros_like(t["input"], dtype=torch.bool),
        ar_index=_empty(),
        ar_labels=_empty(),
        diff_index=_empty(),
        diff_labels=_empty(),
        diff_rate=torch.zeros(0),
        diff_offset=_empty(),
    )
    flat = torch.tensor([r * T + i for r, i in rows], dtype=torch.long)
    as_long = [torch.tensor(x, dtype=torch.long) for x in (targets, owner, index)]
    firsts = [r * T + i for r, i in canvas_first]
    return ScoredRows(batch, flat, *as_long, torch.tensor(from_canvas, dtype=torch.bool), firsts)


def trajectory_logprobs(lm, rollouts: list[Rollout], *, mask_id: int, filler_id: int) -> list[torch.Tensor]:
    """Per rollout, the student's log-probability of each committed answer token in the state it was
    committed from, in commit order (differentiable). `lm` is the trainer's `TwoStreamLM`; its config's
    `bd_size` is the canvas size the rollouts decoded with."""
    scored = trajectory_rows(rollouts, block=lm.cfg.bd_size, filler_id=filler_id)
    device = next(lm.parameters()).device
    batch = scored.batch.to(device)
    logits = lm(batch, rows=scored.rows.to(device))
    logits[:, mask_id] = float("-inf")
    logp = logits.log_softmax(-1).gather(-1, scored.targets.to(device)[:, None]).squeeze(-1)
    return [logp[scored.owner.to(device) == r] for r in range(len(rollouts))]
