"""A slow reference decoder for greedy decoding, written for clarity, not speed.

No KV cache and no recurrent state carried between forwards: every forward is one full-sequence
forward over [clean tokens (prompt + everything committed so far, plus the rows being verified),
canvas], whose attention mask comes straight from `bdcore.attention_rule.dense_mask` over per-token
metadata, as a training row's does. Hybrid (gated-delta) layers run the trainer's two-stream forward
over the same metadata (`train.hybrid`), so canvases start from the clean state before their block
and read as the trainer reads them. The decode logic (seeds, the threshold commit rule, the step
budget, fused commits, self-spec acceptance and cold steps, stop tokens and max_tokens) is written
out here again from docs/design.md section 6 instead of calling the engine's helpers, so a bug in the
engine's bookkeeping cannot hide behind the same code on both sides.

The engine must equal this decoder token for token and forward for forward
(`tests/test_reference_decoder.py`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from bdcore.attention_rule import TokenMeta, dense_mask


@dataclass(frozen=True)
class _LayoutRule:
    """What `train.hybrid.build_layout` reads of a config; `bd_size` is this forward's canvas length."""

    bd_size: int
    clean_causal: bool
    within_block_causal: bool


@dataclass
class Result:
    tokens: list[int] = field(default_factory=list)  # the answer, without its stop token
    finish_reason: str | None = None
    generated: int = 0  # tokens the model produced for the answer, the stop token included
    forwards: int = 0
    accepted: Counter = field(default_factory=Counter)  # self-spec: drafts accepted per step (cold steps: 0)
    off_spine: int = 0  # self-spec with a tree: verify steps whose accepted path took a side candidate


class ReferenceModel:
    """Full-sequence forwards of one model (fp32, stock SDPA), mask token banned."""

    def __init__(self, model_dir, *, mask_id: int, clean_causal: bool, within_block_causal: bool):
        from transformers import AutoModelForCausalLM

        from bdcore.gated_delta import is_hybrid
        from train.hybrid import patch_gated_delta_layers

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
        self.model.eval()
        self.hybrid = is_hybrid(self.model.config)
        if self.hybrid:
            patch_gated_delta_layers(self.model)
        self.mask_id = mask_id
        self.clean_causal = clean_causal
        self.within_block_causal = within_block_causal

    @torch.no_grad()
    def __call__(self, clean: list[int], blocks: list[tuple[int, int]], canvas: list[int] | None = None):
        """Logits of the clean rows [len(clean), V] and of the canvas rows [len(canvas), V] (or None).

        `blocks`: [start, end) ranges of `clean` that are committed response blocks (they matter when
        the clean stream is block-causal). The canvas sits right after `clean` (same positions as the
        tokens it will become). For hybrids the clean stream also carries a stand-in for the canvas's
        block, which nothing sees, because the trainer's layout finds a noised block's entry state
        through the clean block at the same place.
        """
        n = len(clean)
        tokens, stream, pos, blk, bstart = [], [], [], [], []

        def add(tok, s, p, b, start):
            tokens.append(tok), stream.append(s), pos.append(p), blk.append(b), bstart.append(start)

        block_of = {}
        for b, (s, e) in enumerate(blocks):
            for i in range(s, e):
                block_of[i] = (b, s)
        for i, t in enumerate(clean):
            b, s = block_of.get(i, (-1, i))
            add(t, 0, i, b, s)
        if canvas is not None:
            cb = len(blocks)
            if self.hybrid:
                for j, t in enumerate(canvas):
                    add(t, 0, n + j, cb, n)
            for j, t in enumerate(canvas):
                add(t, 1, n + j, cb, n)
        meta = TokenMeta(*(torch.tensor([x]) for x in (stream, [0] * len(tokens), pos, blk, bstart)))
        mask = dense_mask(meta, clean_causal=self.clean_causal, within_block_causal=self.within_block_causal)
        if self.hybrid:
            from train.hybrid import build_layout

            rule = _LayoutRule(len(canvas) if canvas else 1, self.clean_causal, self.within_block_causal)
            width = self.model.config.linear_conv_kernel_dim
            mask = {"full_attention": mask, "linear_attention": build_layout(meta, rule, conv_width=width)}
        hidden = self.model.get_decoder()(
            input_ids=torch.tensor([tokens]), attention_mask=mask, position_ids=meta.pos, use_cache=False
        ).last_hidden_state[0]
        logits = self.model.get_output_embeddings()(hidden).float()
        logits[:, self.mask_id] = float("-inf")
        canvas_logits = logits[len(tokens) - len(canvas) :] if canvas is not None else None
        return logits[:n], canvas_logits


def _argmax(logits: torch.Tensor) -> list[int]:
    return logits.argmax(-1).tolist()


class _Answer:
    """The answer so far: a stop token ends it (and is counted as generated), so does max_tokens."""

    def __init__(self, result: Result, max_tokens: int, stop_ids):
        self.r, self.max_tokens, self.stop_ids = result, max_tokens, set(stop_ids)

    def add(self, new: list[int]) -> bool:
        for t in new:
            self.r.generated += 1
            if t in self.stop_ids:
                self.r.finish_reason = "stop"
                return True
            self.r.tokens.append(t)
            if len(self.r.tokens) == self.max_tokens:
                self.r.finish_reason = "length"
                return True
        return False


def causal(ref: ReferenceModel, prompt: list[int], *, max_tokens: int, stop_ids) -> Result:
    r = Result()
    answer = _Answer(r, max_tokens, stop_ids)
    seq = list(prompt)
    while True:
        clean_logits, _ = ref(seq, [])
        r.forwards += 1
        tok = _argmax(clean_logits[-1])
        if answer.add([tok]):
            return r
        seq.append(tok)


def _denoise(rows_logits, canvas, masked, *, threshold, last_step, shift=True, left_to_right=False):
    """Row j predicts slot j + 1 (`shift`; unshifted: slot j). Commit every masked slot above the threshold,
    at least the most confident masked slot, and every masked slot on the last allowed step; left to right:
    the first masked slot alone."""
    first = 1 if shift else 0  # the slot row 0 predicts
    probs = rows_logits.softmax(-1)
    tokens = _argmax(rows_logits)
    confidence = [float(probs[j, tokens[j]]) for j in range(len(tokens))]
    slots = [s for s in range(first, len(canvas)) if masked[s]]
    if left_to_right:
        chosen = slots[:1]
    elif last_step:
        chosen = slots
    else:
        chosen = [s for s in slots if confidence[s - first] > threshold]
        if not chosen and slots:
            chosen = [max(slots, key=lambda s: confidence[s - first])]
    for s in chosen:
        canvas[s], masked[s] = tokens[s - first], False


def _decided(canvas, masked, stop_ids) -> bool:
    if not any(masked):
        return True
    for i, t in enumerate(canvas):
        if not masked[i] and t in stop_ids:
            return not any(masked[:i])
    return False


def diffusion(
    ref: ReferenceModel,
    prompt: list[int],
    *,
    block: int,
    budget: int,
    threshold: float,
    fuse_commit: bool,
    max_tokens: int,
    stop_ids,
    mask_id: int,
) -> Result:
    r = Result()
    answer = _Answer(r, max_tokens, stop_ids)
    B, P = block, len(prompt)
    committed: list[int] = []

    def blocks():
        return [(P + i, P + i + B) for i in range(0, len(committed), B)]

    def start_block(clean_logits, canvas_logits):
        """A new block: its seed from the last clean row; with a fused commit, its first denoise step
        from the canvas of masks that rode along (whose seed slot was still masked)."""
        canvas = [_argmax(clean_logits[-1])] + [mask_id] * (B - 1)
        masked = [False] + [True] * (B - 1)
        steps = 0
        if canvas_logits is not None:
            _denoise(canvas_logits[:-1], canvas, masked, threshold=threshold, last_step=budget <= 1)
            steps = 1
        return canvas, masked, steps

    ride_along = [mask_id] * B if fuse_commit else None
    clean_logits, canvas_logits = ref(prompt, [], ride_along)
    r.forwards += 1
    canvas, masked, steps = start_block(clean_logits, canvas_logits)
    while True:
        while not _decided(canvas, masked, stop_ids):
            _, canvas_logits = ref(prompt + committed, blocks(), canvas)
            r.forwards += 1
            steps += 1
            _denoise(canvas_logits[:-1], canvas, masked, threshold=threshold, last_step=steps >= budget)
        if answer.add(canvas):
            return r
        committed += canvas
        clean_logits, canvas_logits = ref(prompt + committed, blocks(), ride_along)
        r.forwards += 1
        canvas, masked, steps = start_block(clean_logits, canvas_logits)


def unshifted_diffusion(
    ref: ReferenceModel,
    prompt: list[int],
    *,
    block: int,
    budget: int,
    threshold: float,
    fuse_commit: bool,
    left_to_right: bool,
    max_tokens: int,
    stop_ids,
    mask_id: int,
) -> Result:
    """An unshifted (single-stream) checkpoint: a block is B masks, each row predicting its own slot; the
    forward that commits the previous block (or the prompt's prefill) carries the canvas's first denoise
    step when fused, else spends a forward of its own. Causal mode: `left_to_right`, one slot a step."""
    r = Result()
    answer = _Answer(r, max_tokens, stop_ids)
    B, P = block, len(prompt)
    committed: list[int] = []
    unshifted = {"shift": False, "left_to_right": left_to_right}
    while True:
        blocks = [(P + i, P + i + B) for i in range(0, len(committed), B)]
        canvas, masked, steps = [mask_id] * B, [True] * B, 0
        r.forwards += 1  # the prefill, or the forward that commits the block before
        if fuse_commit:
            steps = 1
            rows = ref(prompt + committed, blocks, canvas)[1]
            _denoise(rows, canvas, masked, threshold=threshold, last_step=budget <= 1, **unshifted)
        while not _decided(canvas, masked, stop_ids):
            rows = ref(prompt + committed, blocks, canvas)[1]
            r.forwards += 1
            steps += 1
            _denoise(rows, canvas, masked, threshold=threshold, last_step=steps >= budget, **unshifted)
        if answer.add(canvas):
            return r
        committed += canvas


def _candidates(canvas_logits: torch.Tensor, k: int = 4) -> list[list[int]]:
    """Each canvas row's k best tokens, best first, equal logits by lower id (as argmax breaks them)."""
    return [torch.sort(-row, stable=True).indices[:k].tolist() for row in canvas_logits]


def _walk_tree(ref: ReferenceModel, known: list[int], candidates, widths, spine: bool, depth: int):
    """Greedy verification of a draft tree, one full-sequence forward per node on the way: from the pending
    token, while the AR token after the path is offered below it, take it. Below a node at depth d the tree
    offers slot d + 1's first widths[d] candidates (past the widths: the argmax only); with `spine`, only
    nodes on the argmax chain have children. Returns (accepted tokens, the AR token after them, whether
    every accepted token was its slot's argmax)."""
    path, on_spine = [], True
    while True:
        ar = _argmax(ref(known + path, [])[0][-1])
        d = len(path)
        if d == depth:
            return path, ar, on_spine
        width = widths[d] if d < len(widths) else 1
        offered = candidates[d][:width] if on_spine or not spine else []
        if ar not in offered:
            return path, ar, on_spine
        on_spine = on_spine and ar == candidates[d][0]
        path.append(ar)


def self_spec(
    ref: ReferenceModel,
    prompt: list[int],
    *,
    draft_len: int,
    max_tokens: int,
    stop_ids,
    mask_id,
    canvases="last",
    layouts=None,
    tree=None,
) -> Result:
    """Greedy self-spec. `known` is the prompt and every emitted token; its last token (`pending`) has
    not been verified into the context yet, which only matters to the engine's cache. `canvases="all"`:
    the engine's verify forward also drafts, after every clean row, what would follow it; here the drafts
    after the accepted prefix come from a forward of their own over that prefix (one engine forward).

    `layouts`: an iterator of (drafts n, canvas length L, first canvas row m) per step, the prefill first,
    instead of `draft_len`/`canvases`: a step verifies the first min(n, drafts in hand) drafts, and its
    canvases of L masks follow the clean rows m.. (L = 0: none; no drafts in hand: a cold or causal step),
    so the drafts after the accepted prefix k exist when L > 0 and k >= m.

    `tree` (a `TreeShape`, or a fourth item of a layout): verify a draft tree of that shape, cut to the drafts
    in hand, over each slot's top candidates of the canvas that drafted them (`_walk_tree`); its drafts for
    the next step exist as above, and only when every accepted token was its slot's argmax (the canvases
    follow the argmax chain's rows)."""
    if layouts is None:
        n = draft_len - 1
        layouts = iter(lambda: (n, n, n if canvases == "last" else 0, tree), None)
    r = Result()
    answer = _Answer(r, max_tokens, stop_ids)
    # The prefill: the last prompt row gives the first token; a canvas of L + 1 masks at its place drafts
    # the L tokens after it.
    _, L, _, *_ = next(layouts)
    clean_logits, canvas_logits = ref(prompt, [], [mask_id] * (L + 1) if L else None)
    r.forwards += 1
    known = list(prompt) + [_argmax(clean_logits[-1])]
    drafts = _argmax(canvas_logits[:L]) if L else None
    candidates = _candidates(canvas_logits[:L]) if L else None
    if answer.add(known[-1:]):
        return r
    while True:
        n, L, m, *shape = next(layouts)
        shape = shape[0] if shape else None
        v = min(n, len(drafts)) if drafts else 0
        r.forwards += 1
        on_spine = True
        if v == 0:  # cold step (a canvas at the next token's place) or a causal step: the next AR token
            emitted = [_argmax(ref(known, [])[0][-1])]
            k = 0
            if L:
                r.accepted[0] += 1
        elif shape is not None:  # a tree: walk it node by node
            path, last, on_spine = _walk_tree(ref, known, candidates, shape.widths, shape.spine, v)
            k = len(path)
            r.off_spine += not on_spine
            r.accepted[k] += 1
            emitted = path + [last]
        else:  # verify: AR tokens after `pending` and after each of the first v drafts
            ar = _argmax(ref(known + drafts[:v], [])[0][len(known) - 1 :])
            k = 0
            while k < v and drafts[k] == ar[k]:
                k += 1
            r.accepted[k] += 1
            emitted = drafts[:k] + [ar[k]]
        # The canvas after clean row k (it sees the pending token and the k accepted drafts), if one was there.
        drafted = L and k >= min(m, v) and on_spine
        canvas_logits = ref(known + emitted[:-1], [], [mask_id] * L)[1] if drafted else None
        drafts = _argmax(canvas_logits) if drafted else None
        candidates = _candidates(canvas_logits) if drafted else None
        if answer.add(emitted):
            return r
        known += emitted
