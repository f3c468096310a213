"""Block-sparse SDPA for CPU training: skip the key tiles the attention rule hides.

On CUDA, flex attention's `BlockMask` skips hidden tiles. CPU has no flex backward, and SDPA with a
dense boolean mask pays for the whole (L + V n)^2 square of a two-stream row, most of which the rule
hides (clean rows never see noised keys; a noised block sees the clean prefix and its own block).
This attention function takes the same dense boolean mask, and for each tile of query rows gathers
only the keys some row of the tile may see, then runs SDPA on that compressed set. Results equal
dense SDPA (the skipped keys have zero weight); the tiling plan is computed once per mask and shared
by every layer. Registered with transformers as attn_implementation "bdstack_sparse_sdpa".
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

NAME = "bdstack_sparse_sdpa"
TILE = 128
# The plan of the mask tensor currently in use. Keyed by the live tensor object (a weak reference),
# never by its address: a later mask may be allocated at a freed mask's address with other contents.
_plan_cache: dict = {"mask": None, "tile": None, "plan": None}


def _plan(mask: torch.Tensor, tile: int):
    """Per batch row: [(q_start, q_end, key_index)] for the tiles of a [B, 1, T, T] bool mask."""
    cached = _plan_cache["mask"]
    if cached is None or cached() is not mask or _plan_cache["tile"] != tile:
        B, _, T, _ = mask.shape
        plans = []
        for b in range(B):
            tiles = []
            for qs in range(0, T, tile):
                qe = min(T, qs + tile)
                cols = mask[b, 0, qs:qe].any(0).nonzero().flatten()
                tiles.append((qs, qe, cols))
            plans.append(tiles)
        _plan_cache.update(mask=weakref.ref(mask), tile=tile, plan=plans)
    return _plan_cache["plan"]


def sparse_sdpa_forward(
    module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, is_causal=None, **kwargs
):
    """transformers attention interface: query [B, H, T, D], key/value [B, Hkv, S, D] -> ([B, T, H, D], None)."""
    if attention_mask is None or attention_mask.dtype != torch.bool or attention_mask.shape[-2] != query.shape[2]:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    rows = []
    for b, tiles in enumerate(_plan(attention_mask, TILE)):
        parts = []
        for qs, qe, cols in tiles:
            k, v = key[b : b + 1, :, cols], value[b : b + 1, :, cols]
            m = attention_mask[b : b + 1, :, qs:qe][..., cols]
            parts.append(
                F.scaled_dot_product_attention(
                    query[b : b + 1, :, qs:qe],
                    k,
                    v,
                    attn_mask=m,
                    dropout_p=dropout if module.training else 0.0,
                    scale=scaling,
                )
            )
        rows.append(torch.cat(parts, dim=2))
    return torch.cat(rows, dim=0).transpose(1, 2).contiguous(), None


def register() -> str:
    """Make "bdstack_sparse_sdpa" a valid attn_implementation (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(NAME, sparse_sdpa_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)  # plain forwards keep their causal/padding masks
    return NAME
