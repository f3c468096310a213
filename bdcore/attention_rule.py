"""The attention rule of docs/design.md section 3: one definition, two renderings.

`visible(q, k, ...)` is written with elementwise tensor ops only, so the same function serves
- the dense path: metadata broadcast as [B, T, 1] x [B, 1, T] -> a 4D boolean SDPA mask, and
- the flex path: metadata gathered at scalar (q_idx, kv_idx) inside a `mask_mod` -> a `BlockMask`.

Per-token metadata (all int tensors of one row layout, see `train/rows.py`):
- `stream`: 0 clean stream C, v >= 1 noised view N_v, -1 padding.
- `doc`:    document id, unique within a row (padding: -1).
- `pos`:    position id (RoPE); noised tokens reuse the positions of their clean copies.
- `blk`:    response block id, unique within a row; -1 for clean tokens outside any response block.
- `bstart`: position of the first token of the token's block (the token's own position when blk == -1).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

PAD_STREAM = -1
CLEAN_STREAM = 0


class TokenMeta(NamedTuple):
    stream: torch.Tensor
    doc: torch.Tensor
    pos: torch.Tensor
    blk: torch.Tensor
    bstart: torch.Tensor

    def index(self, *idx) -> TokenMeta:
        return TokenMeta(*(t[idx] for t in self))

    def to(self, device) -> TokenMeta:
        return TokenMeta(*(t.to(device) for t in self))


def visible(
    q: TokenMeta,
    k: TokenMeta,
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    *,
    clean_causal: bool,
    within_block_causal: bool,
) -> torch.Tensor:
    """True where query q may attend key k. Inputs broadcast against each other."""
    same_doc = q.doc == k.doc
    k_clean = k.stream == CLEAN_STREAM
    q_clean = q.stream == CLEAN_STREAM
    q_noised = q.stream > CLEAN_STREAM
    causal = k.pos <= q.pos
    before_block = k.pos < q.bstart
    same_block = k.blk == q.blk

    # Clean queries: prompt tokens (blk == -1) are always causal; response tokens are causal when
    # the clean stream is an AR stream, else block-causal (everything before the block + the block).
    q_prompt = q.blk < 0
    clean_rows = causal if clean_causal else torch.where(q_prompt, causal, before_block | same_block)
    from_clean = q_clean & k_clean & clean_rows

    # Noised queries: the clean context before the block, plus their own block in their own view.
    in_own_block = (k.stream == q.stream) & same_block
    if within_block_causal:
        in_own_block = in_own_block & causal
    from_noised = q_noised & ((k_clean & before_block) | in_own_block)

    # Padding attends only to itself, so SDPA never sees a query row with no visible key.
    pad_self = (q.stream == PAD_STREAM) & (q_idx == k_idx)
    return ((from_clean | from_noised) & same_doc) | pad_self


def dense_mask(meta: TokenMeta, *, clean_causal: bool, within_block_causal: bool) -> torch.Tensor:
    """[B, 1, T, T] boolean mask (True = attend) for SDPA."""
    T = meta.stream.shape[-1]
    idx = torch.arange(T, device=meta.stream.device)
    q = TokenMeta(*(t[:, :, None] for t in meta))
    k = TokenMeta(*(t[:, None, :] for t in meta))
    allowed = visible(
        q, k, idx[:, None], idx[None, :], clean_causal=clean_causal, within_block_causal=within_block_causal
    )
    return allowed[:, None, :, :]


def flex_mask_mod(meta: TokenMeta, *, clean_causal: bool, within_block_causal: bool):
    """A flex-attention `mask_mod(b, h, q_idx, kv_idx)` for the same rule."""

    def mask_mod(b, h, q_idx, kv_idx):
        return visible(
            meta.index(b, q_idx),
            meta.index(b, kv_idx),
            q_idx,
            kv_idx,
            clean_causal=clean_causal,
            within_block_causal=within_block_causal,
        )

    return mask_mod


def flex_block_mask(meta: TokenMeta, *, clean_causal: bool, within_block_causal: bool, block_size: int = 128):
    """A block-sparse flex-attention `BlockMask` for the same rule (shared by all heads)."""
    from torch.nn.attention.flex_attention import create_block_mask

    B, T = meta.stream.shape
    mask_mod = flex_mask_mod(meta, clean_causal=clean_causal, within_block_causal=within_block_causal)
    return create_block_mask(mask_mod, B, None, T, T, device=meta.stream.device, BLOCK_SIZE=block_size)
