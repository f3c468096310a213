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
        """The canvases after the clean rows, in order: (rows, clean rows of these rows it sees)."""
        n, out = self.n_clean, []
        for i in range(n, len(self.stream)):
            if i == n or self.stream[i] != self.stream[i - 1]:
                out.append([0, sum(1 for p in self.pos[:n] if p < self.bstart[i])])
            out[-1][0] += 1
        return [tuple(c) for c in out]

    def canvas(self, tokens: list[int], start: int, view: int = CANVAS_STREAM) -> Rows:
        """A noised block: sees the clean context before `start` and its whole canvas. Canvases of one
        forward in different views (>= 1) never see each other, as the training row's noised views."""
        return self._add(tokens, start, view, CANVAS_BLOCK, True)


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
    return allowed[None, None]
