"""How well a checkpoint drafts, from one forward per sample instead of a decode loop.

Self-spec (docs/design.md section 6) drafts with a canvas anchored at the position of the token the AR head
emits in the same forward: N - 1 masks at positions a .. a+N-2 that see the clean tokens before a and
themselves, whose row a+i drafts position a+i+1; the AR head verifies greedily and the longest agreeing
prefix is accepted. Along a held-out answer every anchor can be scored at once: one forward over the
clean stream [prompt, answer] plus a canvas at every answer position, each in a view of its own (the
rows `Rows.canvas` builds for all-canvases self-spec; `bdcore.attention_rule` decides who sees whom, so
hybrids get each canvas's recurrent state as the engine does). Per anchor:

    accepted(a) = the longest m such that draft(a+i+1) == argmax AR(a+i+1) for every i < m

where the AR row a+i reads the answer's own tokens. From these the decode walk of linear and
all-canvases self-spec is replayed exactly (prefill, verify steps, cold steps after a rejection), which
gives the tokens per forward they imply. On an answer that is the checkpoint's own greedy output the
walk is what `serve.py --mode self-spec` does, forward for forward; on other answers it is the same
decoder's behaviour along that path. The anchor at the answer's first position mirrors the prefill,
whose canvas is N masks long. Per anchor the rank of the AR token among each slot's draft logits is kept
too: `bdcore.decode.policy.tree_acceptance` reads from them what a tree of top-k drafts would accept.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from bdcore.decode.canvas_fill import CanvasFill
from bdcore.decode.policy.tree_acceptance import (
    TOP_K,
    accepted_depth,
    default_shapes,
    topk_path_acceptance,
    tree_table,
)
from bdcore.decode.rows import Forward, Rows
from bdcore.decode.sequence import SequenceCache
from bdcore.decode.tree import TreeShape


@dataclass
class SampleDrafts:
    """One answer: `accepted[i]` is the accepted prefix at the anchor `start + i` (the last position, the
    stop token's, has none); `ar_nll` the AR head's loss on each answer token; `ranks[i][j]` the rank of the
    AR argmax at position start+i+j+1 among the draft logits of that anchor's slot j (0: the draft's argmax)."""

    start: int  # first answer position (the prompt's length)
    end: int  # one past the answer's last token (its stop token)
    accepted: list[int]
    ar_nll: list[float]
    ar_matches_data: int  # answer tokens after the first that equal the AR head's argmax
    ranks: list[list[int]] = field(default_factory=list)


def accepted_prefix(drafts: torch.Tensor, ar: torch.Tensor) -> int:
    """Leading positions where the draft equals the AR argmax (the greedy acceptance rule)."""
    return int((drafts == ar).int().cumprod(0).sum()) if drafts.numel() else 0


def rank_among(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per row of `logits` [n, V], the rank of `targets[row]`: the tokens scored above it, plus tied ones at
    a lower id, because argmax returns the first maximum; so rank 0 is exactly `argmax == target`, and the
    linear tree reproduces `accepted_prefix` even on ties."""
    score = logits.gather(-1, targets[:, None])
    ids = torch.arange(logits.shape[-1], device=logits.device)
    return (logits > score).sum(-1) + ((logits == score) & (ids < targets[:, None])).sum(-1)


def canvas_forwards(
    ids: list[int], start: int, *, mask_id: int, draft_len: int, max_rows: int, fill: CanvasFill | None = None
) -> list[Rows]:
    """The forwards that score every anchor of one answer: the clean stream, then as many canvases as fit
    in `max_rows` rows (at least one per forward); the first holds the prefill's N-mask canvas. `fill`: what
    the canvases hold (default: `<|mask|>`, `mask_id`)."""
    fill = fill or CanvasFill(mask_id)
    N, L = draft_len, len(ids)
    anchors = list(range(start, L - 1))
    per_forward = max(1, (max_rows - L) // N)
    out = []
    for i in range(0, len(anchors), per_forward):
        rows = Rows().clean(ids, 0)
        for view, a in enumerate(anchors[i : i + per_forward], start=1):
            rows.canvas(fill(N if a == start else N - 1), a, view=view)
        out.append(rows)
    return out or [Rows().clean(ids, 0)]


@torch.no_grad()
def score_sample(
    runner, ids: list[int], start: int, *, mask_id: int, draft_len: int, max_rows: int, fill: CanvasFill | None = None
) -> SampleDrafts:
    """Every anchor of the answer `ids[start:]` (its last token the stop token), through `runner` (a
    `bdcore.decode.runner.ModelRunner`: `<|mask|>` banned, draft-only adapters on at canvas rows)."""
    L, N = len(ids), draft_len
    if not 0 < start < L:
        raise ValueError(f"an answer must follow a prompt: start {start} of {L} tokens")
    accepted, ranks, ar = [], [], None
    for rows in canvas_forwards(ids, start, mask_id=mask_id, draft_len=N, max_rows=max_rows, fill=fill):
        # rollback: the per-row recurrent states a canvas before the last clean row starts from (hybrids)
        logits = runner.forward([(SequenceCache(), Forward(rows, 0, rollback=True))])[0]
        if ar is None:
            ar_logp = logits[:L].log_softmax(-1)
            ar = ar_logp.argmax(-1)  # row p predicts position p + 1
            target = torch.tensor(ids[start:], device=ar_logp.device)
            nll = -ar_logp[start - 1 : L - 1].gather(-1, target[:, None])[:, 0]
        row = L
        for size, _ in rows.canvases():
            a = rows.pos[row]
            n = min(N - 1, L - 1 - a)  # drafts for positions a+1 .. a+n, the stop token's included
            drafts = logits[row : row + n].argmax(-1)
            accepted.append(accepted_prefix(drafts, ar[a : a + n]))
            ranks.append(rank_among(logits[row : row + n], ar[a : a + n]).tolist())
            row += size
    matches = int((ar[start : L - 1] == torch.tensor(ids[start + 1 :], device=ar.device)).sum())
    return SampleDrafts(start, L, accepted, nll.tolist(), matches, ranks)


def walk_forwards(sample: SampleDrafts, draft_len: int, *, all_canvases: bool, tree: TreeShape | None = None) -> int:
    """The forwards self-spec takes to emit the answer, replayed from the accepted prefixes: the prefill
    emits the first token and drafts; a verify step at anchor a emits accepted(a) drafts and one AR token
    (the next anchor); in linear mode a rejection leaves no drafts, so a cold step emits one AR token and
    drafts anew. Ends when the stop token is emitted.

    `tree`: every verify offers that draft tree (`bdcore.decode.tree`), cut to the canvas's N - 1 slots, and
    accepts `accepted_depth` of it (the AR tokens among each depth's offered candidates, from the ranks);
    the canvases follow the spine's rows (the argmax chain), so a path that leaves the spine leaves no
    drafts, as a rejection does in linear mode."""
    a, forwards, warm, last = sample.start, 1, True, sample.end - 1
    while a < last:
        forwards += 1
        if warm:
            i = a - sample.start
            if tree is None:
                k, on_spine = sample.accepted[i], True
            else:
                k = accepted_depth(sample.ranks[i], tree)
                on_spine = all(rank == 0 for rank in sample.ranks[i][:k])
            warm = on_spine and (all_canvases or k == draft_len - 1)
            a += k + 1
        else:  # cold step: [pending, MASK x (N-1)]
            a, warm = a + 1, True
    return forwards


@dataclass
class DraftQuality:
    samples: int = 0
    anchors: int = 0
    first_accepted: int = 0  # anchors whose first draft was accepted
    accepted: int = 0  # drafts accepted over all anchors
    tokens: int = 0  # answer tokens (stop tokens included)
    forwards_linear: int = 0
    forwards_all: int = 0
    ar_nll: float = 0.0
    ar_matches_data: int = 0
    per_sample: list[SampleDrafts] = field(default_factory=list, repr=False)

    def add(self, s: SampleDrafts, draft_len: int) -> None:
        self.samples += 1
        self.anchors += len(s.accepted)
        self.first_accepted += sum(k > 0 for k in s.accepted)
        self.accepted += sum(s.accepted)
        self.tokens += s.end - s.start
        self.forwards_linear += walk_forwards(s, draft_len, all_canvases=False)
        self.forwards_all += walk_forwards(s, draft_len, all_canvases=True)
        self.ar_nll += sum(s.ar_nll)
        self.ar_matches_data += s.ar_matches_data
        self.per_sample.append(s)

    def summary(self) -> dict[str, float]:
        """The figures `benchmark.draft_quality` prints and the trainer logs (`draft_*`, `eval_ar_loss`)."""
        anchors, tokens = max(1, self.anchors), max(1, self.tokens)
        return {
            "draft_first_accept": self.first_accepted / anchors,
            "draft_mean_accepted": self.accepted / anchors,
            "draft_tpf_linear": self.tokens / max(1, self.forwards_linear),
            "draft_tpf_all": self.tokens / max(1, self.forwards_all),
            "eval_ar_loss": self.ar_nll / tokens,
            "eval_ar_matches_data": self.ar_matches_data / max(1, self.tokens - self.samples),
        }

    def trees(self, draft_len: int, shapes: list[TreeShape] | None = None, top_k: int = TOP_K) -> dict[str, list]:
        """What trees of top-k drafts would accept (`bdcore.decode.policy.tree_acceptance`): the per-slot top-k path
        acceptance and, per shape (default: `default_shapes`), node count and mean accepted drafts per verify.
        Apart from `summary` so that the trainer's logged figures stay what they were."""
        anchors = [ranks for s in self.per_sample for ranks in s.ranks]
        shapes = shapes or default_shapes(draft_len)
        rows = tree_table(anchors, shapes, draft_len)
        for row, shape in zip(rows, shapes):  # the tokens per forward a decode verifying this tree would take
            for key, every in (("tpf_linear", False), ("tpf_all", True)):
                forwards = sum(walk_forwards(s, draft_len, all_canvases=every, tree=shape) for s in self.per_sample)
                row[key] = self.tokens / max(1, forwards)
        return {"topk_path_acceptance": topk_path_acceptance(anchors, top_k), "tree_shapes": rows}


def draft_quality(
    runner,
    samples: list[tuple[list[int], int]],
    *,
    mask_id: int,
    draft_len: int,
    max_rows: int = 4096,
    progress=None,
    fill: CanvasFill | None = None,
) -> DraftQuality:
    """`samples`: (ids ending with the answer's stop token, the answer's first position) pairs. `fill`: what
    canvases hold, the checkpoint's (`CanvasFill.for_checkpoint`); default `<|mask|>`."""
    if draft_len < 2:
        raise ValueError(f"draft_len {draft_len}: self-spec drafts N - 1 >= 1 tokens a step")
    out = DraftQuality()
    for ids, start in samples:
        drafts = score_sample(runner, ids, start, mask_id=mask_id, draft_len=draft_len, max_rows=max_rows, fill=fill)
        out.add(drafts, draft_len)
        if progress is not None:
            progress()
    return out
