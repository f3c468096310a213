"""The three decode modes of docs/design.md section 6 as small state machines.

A decoder names the forward its sequence needs next (`next_forward`: rows, how many of them stay
cached, whether a later crop may cut back into them) and takes the logits back (`take`): it counts
the forward, applies the decode rules, pushes emitted tokens to the sequence's sink and crops the
sequence's cache after a self-spec rejection. Its state (canvas, counters, drafts) lives in plain
fields, so a batched scheduler and a one-request loop drive the same objects (a rollout loop could too).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from bdcore.decode.config import DecodeConfig, ResolvedDecode
from bdcore.decode.layout import Layout, fixed_layout
from bdcore.decode.rows import Forward, Rows
from bdcore.decode.rules import block_decided, denoise_step, first_stop, greedy_accept, speculative_accept
from bdcore.decode.sequence import Sequence
from bdcore.decode.tree import (
    CANDIDATES,
    DraftTree,
    KeptPath,
    TreeShape,
    build_tree,
    cut,
    top_candidates,
    verify_greedy,
)

if TYPE_CHECKING:  # a decoder holds its request's policy state; it runs no policy code
    from bdcore.decode.policy.request import RequestPolicy


@dataclass
class CommitStep:
    """What one forward committed in a diffusion block, and the state it committed it from (recorded for
    on-policy training: a training forward can revisit exactly this state)."""

    start: int  # position of the block's first slot
    canvas: list[int] | None  # the canvas rows the forward saw; None: the block's seed, from an AR row
    slots: list[int]  # committed slots (canvas row j predicts slot j + 1)
    tokens: list[int]
    logprobs: list[float]  # the student's log-probability of each, `<|mask|>` banned, temperature 1


@dataclass
class DraftVerdict:
    """One self-spec verify of a chain of drafts (recorded for on-policy draft training): the drafts came from
    a canvas of masks whose first row sat at `start` (the pending token's place, which it did not see) and
    predicted the positions start + 1, ...; the AR head accepted the first `accepted` of the `verified`."""

    start: int
    canvas: int  # the canvas's length in masks (the prefill's holds one more than it drafts)
    drafts: list[int]  # every token the canvas drafted (a layout may verify fewer)
    verified: int
    accepted: int


class Decoder:
    def __init__(self, seq: Sequence):
        self.seq = seq
        self.finished = False

    def next_forward(self) -> Forward:
        raise NotImplementedError

    def receive(self, logits: torch.Tensor) -> int | KeptPath | None:
        """Consume this forward's logits [len(rows), V]; return a cache length to crop to, the path of a draft
        tree's rows to keep, or None."""
        raise NotImplementedError

    def take(self, logits: torch.Tensor) -> None:
        self.seq.stats.forwards += 1
        crop = self.receive(logits)
        if isinstance(crop, KeptPath):
            self.seq.cache.keep_path(crop.base, crop.rows)
        elif crop is not None:
            self.seq.cache.crop(crop)


class CausalDecoder(Decoder):
    def __init__(self, seq: Sequence):
        super().__init__(seq)
        self.pos = len(seq.prompt_ids)  # position of the next token
        self.rows, self.keep = Rows().clean(seq.prompt_ids, 0), len(seq.prompt_ids)

    def next_forward(self) -> Forward:
        return Forward(self.rows, self.keep)

    def receive(self, logits):
        tok = self.seq.token(logits[-1:])
        self.finished = self.seq.out.push([tok], self.seq.score(logits[-1:], [tok]))
        self.rows, self.keep = Rows().clean([tok], self.pos), 1
        self.pos += 1
        return None


class DiffusionDecoder(Decoder):
    """Per block: a forward that commits (the prompt's prefill, then each decided block) and yields the
    next block's seed from its last clean row, fused with that block's first denoise step (a canvas of
    masks whose seed slot is still masked) unless `fuse_commit` is off; then denoise forwards until the
    block is decided. Row j of a canvas predicts slot j + 1."""

    shift = True  # canvas row j predicts slot j + 1
    left_to_right = False  # commit by the threshold rule (True: exactly the first masked slot a step)

    def __init__(self, seq: Sequence, *, block: int, budget: int, threshold: float, fuse_commit: bool):
        super().__init__(seq)
        self.block, self.budget, self.threshold, self.fuse_commit = block, budget, threshold, fuse_commit
        self.phase = "prefill"  # prefill | denoise | commit
        self.start = len(seq.prompt_ids)  # position of the current block's first slot
        self.canvas: list[int] = []
        self.masked: list[bool] = []
        self.steps = 0  # denoise steps spent on the current block
        self.trace: list[CommitStep] | None = None  # set to a list to record every commit
        self.slot_scores: list = []  # per canvas slot, its TokenLogprob once committed (when asked for)

    def next_forward(self) -> Forward:
        B, p = self.block, self.start
        if self.phase == "denoise":
            return Forward(Rows().canvas(self.canvas, p), 0)
        if self.phase == "prefill":
            rows, keep, next_start = Rows().clean(self.seq.prompt_ids, 0), p, p
        else:
            rows, keep, next_start = Rows().commit(self.canvas, p, block_causal=self.seq.block_causal), B, p + B
        if self.fuse_commit:
            rows.canvas([self.seq.mask_id] * B, next_start)
        return Forward(rows, keep)

    def receive(self, logits):
        B = self.block
        if self.phase == "denoise":
            self.steps += 1
            self._denoise(logits[:-1], list(self.canvas), last_step=self.steps >= self.budget)
        else:
            n = self.start if self.phase == "prefill" else B  # clean rows of this forward
            if self.phase == "commit":
                self.start += B
            self.canvas = [self.seq.token(logits[n - 1 : n])] + [self.seq.mask_id] * (B - 1)
            self.masked = [False] + [True] * (B - 1)
            self.slot_scores = [None] * B
            self._record(None, [0], logits[n - 1 : n])
            self._score([0], logits[n - 1 : n])
            self.steps = 0
            if self.fuse_commit:  # the canvas rode along with its seed slot still masked
                self.steps = 1
                self._denoise(logits[n : n + B - 1], [self.seq.mask_id] * B, last_step=self.budget <= 1)
        self._next_phase()
        return None

    def _next_phase(self) -> None:
        """A decided block goes to the answer and is committed next; an undecided one is denoised again."""
        if block_decided(self.canvas, self.masked, self.seq.stop_ids):
            stop = first_stop(self.canvas, self.seq.stop_ids)
            done = self.canvas[: stop + 1] if stop is not None else self.canvas
            scored = self.seq.params.logprobs is not None
            self.finished = self.seq.out.push(done, self.slot_scores[: len(done)] if scored else None)
            self.phase = "commit"
        else:
            self.phase = "denoise"

    def _denoise(self, rows_logits, seen: list[int] | None, *, last_step: bool) -> None:
        """One denoise step on canvas rows `rows_logits` computed from the canvas `seen`."""
        seq, first = self.seq, 1 if self.shift else 0  # the first slot a canvas row predicts
        noting = self.trace is not None or seq.params.logprobs is not None  # who committed what is wanted
        before = list(self.masked) if noting else None
        denoise_step(
            rows_logits,
            self.canvas,
            self.masked,
            seq.params,
            seq.generator,
            banned=seq.mask_id,
            threshold=self.threshold,
            last_step=last_step,
            shift=self.shift,
            left_to_right=self.left_to_right,
        )
        if noting:
            committed = [s for s in range(first, len(before)) if before[s] and not self.masked[s]]
            rows = rows_logits[[s - first for s in committed]]
            self._record(seen, committed, rows)
            self._score(committed, rows)

    def _score(self, slots: list[int], rows_logits) -> None:
        """Each committed slot's log-probability in the state it was committed from (the server's
        `logprobs` in diffusion mode: the shared diffusion log-probability of train/trajectory.py)."""
        scores = self.seq.score(rows_logits, [self.canvas[s] for s in slots])
        if scores is not None:
            for s, entry in zip(slots, scores):
                self.slot_scores[s] = entry

    def _record(self, seen: list[int] | None, slots: list[int], rows_logits) -> None:
        """Note the commits of `slots`, scored by the rows that predicted them."""
        if self.trace is None:
            return
        tokens = [self.canvas[s] for s in slots]
        logp = rows_logits.float().log_softmax(-1)  # <|mask|> is already -inf in the runner's logits
        scores = [float(logp[i, t]) for i, t in enumerate(tokens)]
        self.trace.append(CommitStep(self.start, seen, slots, tokens, scores))


class SelfSpecDecoder(Decoder):
    """One forward per step over [pending, drafts, canvases]: the clean rows verify the drafts (their
    logits are the AR logits), each canvas of masks drafts the tokens after the clean row it follows. The
    step's `layout` (`bdcore.decode.layout.Layout`) says how many drafts it verifies, the canvases'
    length, and which clean rows they follow; a driver with a policy sets it before every forward, and
    without one it is the fixed layout of `draft_len` N and `canvases`:

    - `"last"`: N - 1 drafts and one canvas of N - 1 masks after the last clean row. After a rejection the
      drafts are stale, so the next step is a cold step: [pending, MASK x (N-1)], one AR token and fresh
      drafts after it. The prefill doubles as a cold step.
    - `"all"`: a canvas after *every* clean row j (at the positions after it, seeing the clean rows up to
      j, each canvas in its own view so none sees another). Whatever prefix k is accepted, the canvas after
      row k already drafted the tokens after the emitted AR token, so every step after the prefill is a
      verify step: no cold steps, N + N(N-1) rows a forward.

    A layout with a `tree` (greedy requests only) verifies a draft tree instead of the chain: each drafted
    slot's top candidates under the nodes of the depth before (`bdcore.decode.tree`); its canvases follow the
    spine's rows, so a path that ends on the spine leaves drafts as the chain would, and one that ends on a
    side branch leaves none (a cold step follows).

    A backend that cannot mix causal and canvas rows in one forward (SGLang) splits a step instead: a
    causal step, a `seeded` drafting forward ([pending, MASK x L], `Layout.seeded`), then a verify step
    without a canvas.

    Any layout, any step, emits the AR head's tokens (greedy acceptance, or rejection sampling against the
    drafts' own distributions): the layout changes speed, never the output."""

    def __init__(
        self,
        seq: Sequence,
        *,
        draft_len: int,
        canvases: str = DecodeConfig.self_spec_canvases,
        tree: TreeShape | None = None,
    ):
        super().__init__(seq)
        self.N = draft_len
        tree = tree if seq.params.greedy else None  # sampled requests verify the chain (rejection sampling)
        self.layout = fixed_layout(draft_len, canvases if canvases != "auto" else "last", tree)
        self._fixed_tree = tree is not None  # a fixed tree verifies each slot's top candidates
        self.candidates: list[list[int]] | None = None  # per draft in hand, its slot's candidates, best first
        self.tree: DraftTree | None = None  # the tree of the forward in flight
        self.policy: RequestPolicy | None = None  # where the engine's policy picks the layouts (`attach`)
        self.stale = False  # the drafts in hand came from a canvas after a rejected draft
        self.c = len(seq.prompt_ids)  # cached tokens; the pending token sits at position c
        self.prefill = True
        self.pending: int | None = None  # emitted, not cached yet
        self.drafts: list[int] | None = None  # proposals for the positions after `pending`
        self.q: torch.Tensor | None = None  # their sampling distributions
        self.step: Layout | None = None  # the layout of the forward in flight, drafts cut to those in hand
        self.trace: list[DraftVerdict] | None = None  # set to a list to record each chain verify (rollouts)
        # masks in the canvas of the forward in flight, and in the one that drafted the drafts in hand (0: a
        # seeded canvas, which holds the pending token: not a canvas of masks a training forward can revisit)
        self.canvas_len = self.drafted_from = 0

    def next_forward(self) -> Forward:
        lay, c, fill = self.layout, self.c, self.seq.fill
        if lay.seeded:  # the canvas holds the pending token at its place: rows c..c+L-1 draft c+1..c+L
            if self.prefill:
                raise ValueError("a seeded drafting forward follows a pending token: it cannot be the prefill")
            self.step, self.canvas_len = lay, 0
            return Forward(Rows().canvas([self.pending] + fill(lay.canvas), c), 0)
        if self.prefill:  # the canvas sits at the first token's place: rows c..c+L-1 draft c+1..c+L
            rows = Rows().clean(self.seq.prompt_ids, 0)
            if lay.canvas:
                rows.canvas(fill(lay.canvas + 1), c)
            self.step, self.canvas_len = Layout(0, lay.canvas, 0), lay.canvas + 1
            return Forward(rows, c)
        v = min(lay.drafts, len(self.drafts)) if self.drafts else 0
        tree = cut(lay.tree, v) if lay.tree is not None and self.candidates else None
        self.step = step = Layout(v, lay.canvas, min(lay.first_canvas, v), tree=tree)
        self.canvas_len = step.canvas
        if tree is not None:  # spine row j is the chain's row j, so the canvases follow the same rows
            self.tree = t = build_tree(self.pending, tree, self.candidates)
            rows = Rows().tree(t.tokens, t.parents, t.depths, c)
        else:
            rows = Rows().clean([self.pending, *(self.drafts or [])[:v]], c)
        for j in step.canvas_rows():  # the canvas after clean row j, in a view of its own
            after = j if tree is not None else None
            rows.canvas(fill(step.canvas), c + j + 1, view=1 + j - step.first_canvas, after=after)
        return Forward(rows, rows.n_clean, v > 0)

    def receive(self, logits):
        c, seq, step = self.c, self.seq, self.step
        seq.stats.drafted[step.canvas] += 1
        crop = None
        if step.seeded:  # drafts only: nothing verified, emitted or cached
            self._draft(logits[: step.canvas])
            self.stale = False
            return None
        if self.prefill:
            self.prefill = False
            ar_rows = logits[c - 1 : c]  # the AR rows that produced the emitted tokens
            emitted, k, canvas_at = [seq.token(ar_rows)], 0, c
        elif step.drafts == 0:  # a cold step (a canvas drafts after the AR token) or a plain causal step
            ar_rows = logits[:1]
            emitted, k, canvas_at = [seq.token(ar_rows)], 0, 1
            if step.canvas:
                seq.stats.accepted[0] += 1
            self.c += 1
        else:  # verify the first `step.drafts` drafts
            v, n_clean = step.drafts, (self.tree.rows if step.tree is not None else step.drafts + 1)
            ar_tokens, p = seq.pick(logits[:n_clean])
            if step.tree is not None:
                verdict = verify_greedy(self.tree, ar_tokens.tolist())
                k, spine_k, on_spine = verdict.accepted, verdict.spine_accepted, verdict.on_spine
                seq.stats.tree_verifies += 1
                seq.stats.off_spine += not on_spine
                emitted = [self.tree.tokens[r] for r in verdict.path[1:]] + [verdict.last]
                ar_rows, crop = logits[verdict.path], KeptPath(c, verdict.path)
            else:
                drafts = torch.tensor(self.drafts[:v])
                if seq.params.greedy:
                    k = greedy_accept(drafts, ar_tokens.cpu())
                    last = int(ar_tokens[k])
                else:
                    k, last = speculative_accept(drafts, self.q[:v].cpu(), p.cpu(), seq.generator)
                spine_k, on_spine = k, True
                if self.trace is not None:
                    self.trace.append(DraftVerdict(c, self.drafted_from, list(self.drafts), v, k))
                emitted = self.drafts[:k] + [last]
                ar_rows, crop = logits[: k + 1], c + 1 + k  # pending + accepted drafts stay cached
            seq.stats.accepted[k] += 1
            if self.policy is not None:  # what the argmax chain alone accepted
                self.policy.verified(v, spine_k, self.stale, self._alternative(v, spine_k, int(ar_tokens[spine_k])))
            self.c = c + 1 + k
            canvas_at = n_clean + (k - step.first_canvas) * step.canvas  # the canvas after row k, if any
            k = k if on_spine else -1  # a path off the spine has no canvas after it
        if step.canvas and k >= step.first_canvas:
            self._draft(logits[canvas_at : canvas_at + step.canvas])
            self.stale = k < step.drafts  # drafted past the AR head's correction, which it did not see
        else:  # no drafts in hand (nor their distributions, which a sampled request holds on the device)
            self.drafts, self.q, self.candidates = None, None, None
        self.finished = seq.out.push(emitted, seq.score(ar_rows, emitted))
        self.pending = emitted[-1]
        return crop

    @property
    def keep_candidates(self) -> bool:
        """Keep each drafted slot's top candidates: a fixed tree verifies them; with a policy, where it weighs
        trees (which it rates from them)."""
        return self.policy.keeps_candidates if self.policy is not None else self._fixed_tree

    def _alternative(self, verified: int, accepted: int, ar_token: int) -> tuple[int, int] | None:
        """Where the argmax chain stopped short of `verified` drafts with the slots' candidates kept: (the
        rejected slot, 1-based; the AR token `ar_token`'s rank among its candidates)."""
        if self.candidates is None or accepted >= verified:
            return None
        slot = self.candidates[accepted]
        return accepted + 1, slot.index(ar_token) if ar_token in slot else CANDIDATES

    def _draft(self, rows_logits) -> None:
        self.drafted_from = self.canvas_len
        tokens, self.q = self.seq.pick(rows_logits)
        self.drafts = tokens.tolist()
        if self.keep_candidates and self.seq.params.greedy:
            self.candidates = top_candidates(rows_logits, self.drafts)


class UnshiftedDiffusionDecoder(DiffusionDecoder):
    """Diffusion for an unshifted (single-stream) checkpoint: a block is a canvas of B masks whose row j
    predicts slot j itself, so no forward before it seeds it. The forwards are the shifted decoder's (the
    prompt's prefill or a block's commit, block-bidirectional as training saw a block, carrying the next
    canvas when fused; denoise forwards until the block is decided). `left_to_right` commits exactly one
    slot a forward, the first masked one: the causal mode of a checkpoint without a token-causal AR head."""

    shift = False  # canvas row j predicts slot j (no commit trace: on-policy training refuses unshifted students)

    def __init__(
        self, seq: Sequence, *, block: int, budget: int, threshold: float, fuse_commit: bool, left_to_right: bool
    ):
        super().__init__(seq, block=block, budget=budget, threshold=threshold, fuse_commit=fuse_commit)
        self.left_to_right = left_to_right

    def receive(self, logits):
        B = self.block
        if self.phase == "denoise":
            self.steps += 1
            self._denoise(logits, None, last_step=self.steps >= self.budget)
        else:
            n = self.start if self.phase == "prefill" else B  # clean rows of this forward
            if self.phase == "commit":
                self.start += B
            self.canvas, self.masked, self.steps = [self.seq.mask_id] * B, [True] * B, 0
            self.slot_scores = [None] * B
            if self.fuse_commit:  # the next block's canvas rode along
                self.steps = 1
                self._denoise(logits[n : n + B], None, last_step=self.budget <= 1)
        self._next_phase()
        return None


def make_decoder(decode: ResolvedDecode, seq: Sequence) -> Decoder:
    if not seq.shift:  # `DecodeConfig.resolve(shift=False)` has refused self-spec
        return UnshiftedDiffusionDecoder(
            seq,
            block=decode.block,
            budget=decode.budget,
            threshold=decode.threshold,
            fuse_commit=decode.fuse_commit,
            left_to_right=decode.mode == "causal",
        )
    if decode.mode == "causal":
        return CausalDecoder(seq)
    if decode.mode == "diffusion":
        return DiffusionDecoder(
            seq, block=decode.block, budget=decode.budget, threshold=decode.threshold, fuse_commit=decode.fuse_commit
        )
    return SelfSpecDecoder(seq, draft_len=decode.draft_len, canvases=decode.canvases, tree=decode.tree_shape)
