"""The rows of one decode forward and who each of them sees (docs/design.md section 6).

Every decode forward (prefill, causal step, denoise, fused commit + denoise, self-spec verify +
draft) is a list of rows: clean rows (stream 0, causal like the AR model) followed by canvas rows
(a noised block: stream 1, sees the clean context before its start and its whole canvas). The mask
comes from `bdcore.attention_rule.visible`, the function the training rows use, with the cached
tokens as clean keys; this is why the engine's denoise logits equal the training forward's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from bdcore.attention_rule import CLEAN_STREAM, TokenMeta, visible
from bdcore.decode.tree import ancestry

CANVAS_STREAM = 1
CANVAS_BLOCK = 1
COMMIT_BLOCK = 2  # a committed block's clean rows, when the clean stream is block-causal


@dataclass
class Rows:
    tokens: list[int] = field(default_factory=list)
    stream: list[int] = field(default_factory=list)
    pos: list[int] = field(default_factory=list)
    blk: list[int] = field(default_factory=list)
    bstart: list[int] = field(default_factory=list)
    # A draft tree's forward (`bdcore.decode.tree`): the parent row of each of its first rows, the tree
    # (-1: the root), and the tree row each canvas row follows; None in every other forward.
    parents: list[int] | None = None
    follows: list[int] | None = None

    def _add(self, tokens, start, stream, blk, block_start):
        for i, t in enumerate(tokens):
            self.tokens.append(int(t))
            self.stream.append(stream)
            self.pos.append(start + i)
            self.blk.append(blk)
            self.bstart.append(start if block_start else start + i)
        return self

    def clean(self, tokens: list[int], start: int) -> Rows:
        """Causal clean rows (prompt, AR steps, self-spec verify rows)."""
        return self._add(tokens, start, CLEAN_STREAM, -1, False)

    def tree(self, tokens: list[int], parents: list[int], depths: list[int], start: int) -> Rows:
        """A draft tree's clean rows, first in the forward: row i at position start + depths[i], seeing the
        cached tokens and its ancestors only (`decode_mask`), so siblings share positions."""
        if self.tokens:
            raise ValueError("a draft tree's rows come first in its forward")
        for t, d in zip(tokens, depths):
            self._add([t], start + d, CLEAN_STREAM, -1, False)
        self.parents, self.follows = list(parents), []
        return self

    def commit(self, tokens: list[int], start: int, *, block_causal: bool) -> Rows:
        """A finished block's clean rows: causal, or block-causal when the checkpoint's clean stream is."""
        return self._add(tokens, start, CLEAN_STREAM, COMMIT_BLOCK if block_causal else -1, block_causal)

    @property
    def n_clean(self) -> int:
        """Clean rows (they come first)."""
        return sum(1 for s in self.stream if s == CLEAN_STREAM)

    def drafting(self) -> list[bool]:
        """Per row: whether a draft-only adapter acts there (canvas rows; clean rows run the base weights).
        The native runner's gate and the vLLM plugin's per-token LoRA mapping are both this."""
        return [s >= CANVAS_STREAM for s in self.stream]

    @property
    def block_causal_commit(self) -> bool:
        """The clean rows are a committed block of a block-causal clean stream."""
        return COMMIT_BLOCK in self.blk[: self.n_clean]

    def canvases(self) -> list[tuple[int, int]]:
        """The canvases after the clean rows, in order: (rows, s), s the clean rows of this forward it sees; in
        a tree's forward, s - 1 is the tree row it follows (a gated-delta canvas starts from the state after
        s clean rows, or after that row's path)."""
        n, out = self.n_clean, []
        for i in range(n, len(self.stream)):
            if i == n or self.stream[i] != self.stream[i - 1]:
                if self.follows is not None:  # a tree's canvas sees the path through the row it follows
                    seen = self.follows[i - n] + 1  # (its gated-delta state: the one after that row)
                else:
                    seen = sum(1 for p in self.pos[:n] if p < self.bstart[i])
                out.append([0, seen])
            out[-1][0] += 1
        return [tuple(c) for c in out]

    def canvas(self, tokens: list[int], start: int, view: int = CANVAS_STREAM, *, after: int | None = None) -> Rows:
        """A noised block: sees the clean context before `start` and its whole canvas. Canvases of one
        forward in different views (>= 1) never see each other, as the training row's noised views. In a
        tree's forward, `after` is the tree row whose path it continues (the only tree rows it sees)."""
        if (self.follows is None) != (after is None):
            raise ValueError("a canvas in a draft tree's forward names the tree row it follows, and only there")
        if after is not None:
            self.follows += [after] * len(tokens)
        return self._add(tokens, start, view, CANVAS_BLOCK, True)

    def ancestry(self) -> torch.Tensor | None:
        """[Q, Q] bool laid over the attention rule among a tree forward's new rows (`bdcore.decode.tree`)."""
        if self.parents is None:
            return None
        return ancestry(self.parents, list(range(len(self.parents))) + self.follows)


@dataclass
class Forward:
    """What a decoder asks the runner for: one forward's rows, and what of them stays in the cache. Plain data
    here, apart from the decoders that make it (modes.py) and the runner and cost model that read it."""

    rows: Rows
    keep: int  # the first `keep` rows stay in the cache
    rollback: bool = False  # a later crop may cut back into this forward's clean rows


def decode_mask(cached: int, rows: Rows, clean_causal: bool, within_block_causal: bool, device) -> torch.Tensor:
    """[1, 1, Q, cached + Q] bool: who each new row sees among the cached tokens and the new rows."""
    c, Q = cached, len(rows.tokens)

    def meta(stream, pos, blk, bstart):
        s = torch.tensor(stream, device=device)
        t = [torch.tensor(x, device=device) for x in (pos, blk, bstart)]
        return TokenMeta(s, torch.zeros_like(s), *t)

    q = meta(rows.stream, rows.pos, rows.blk, rows.bstart)
    cached_pos = list(range(c))  # committed tokens: clean keys, all before any new row's block
    k = meta([CLEAN_STREAM] * c + rows.stream, cached_pos + rows.pos, [-1] * c + rows.blk, cached_pos + rows.bstart)
    qi, ki = torch.arange(c, c + Q, device=device), torch.arange(c + Q, device=device)
    allowed = visible(
        TokenMeta(*(x[:, None] for x in q)),
        TokenMeta(*(x[None, :] for x in k)),
        qi[:, None],
        ki[None, :],
        clean_causal=clean_causal,
        within_block_causal=within_block_causal,
    )
    tree = rows.ancestry()
    if tree is not None:  # a draft tree: each row sees its own path's tree rows only
        allowed[:, c:] &= tree.to(device)
    return allowed[None, None]
