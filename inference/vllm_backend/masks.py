"""A decode forward's rows (`bdcore.decode.rows.Rows`) as vLLM 0.33's attention inputs.

vLLM's model runner v2 hands the attention backend, per request, a causal flag and a list of
bidirectional position ranges (`build_attn_metadata(causal=..., mm_req_doc_ranges={req: [(start, end)]})`
in `vllm/v1/worker/gpu/attn_utils.py`). The Triton backend's mask
(`vllm/v1/attention/ops/triton_attention_helpers.py: compute_kv_seq_mask`) lets the query at absolute
position q see the key at position k when

    k <= q (causal)   or   start <= q <= end and start <= k <= end for a range with start < end

(ends inclusive). Our rows (docs/design.md section 6) are clean rows, causal, then at most one canvas
that sees the clean context before it and its whole self: that is one range over the canvas. Layouts
with several canvases at the same positions (`--self-spec-canvases all`) have no such form: vLLM's KV
cache holds one token per position. `ranges_for` refuses them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bdcore.attention_rule import CLEAN_STREAM
from bdcore.decode.rows import Rows


class NotExpressible(ValueError):
    """Rows whose mask vLLM's causal flag and bidirectional ranges cannot state."""


@dataclass(frozen=True)
class AttentionSpec:
    """One request's attention in a vLLM forward: its causal flag and bidirectional ranges (absolute
    positions, ends inclusive), as `build_attn_metadata` takes them."""

    causal: bool
    ranges: tuple[tuple[int, int], ...]


def ranges_for(rows: Rows, cached: int, *, within_block_causal: bool) -> AttentionSpec:
    """The causal flag and ranges that give `rows` (after `cached` committed tokens) the decode mask
    `bdcore.decode.rows.decode_mask` gives them (clean stream causal: the sidecar's clean_causal)."""
    if rows.pos != list(range(cached, cached + len(rows.pos))):
        raise NotExpressible(
            f"rows at positions {rows.pos} do not follow the {cached} cached tokens one per position; vLLM's KV "
            "cache holds one token per position (one canvas per forward: --self-spec-canvases last)"
        )
    n = rows.n_clean
    if any(s == CLEAN_STREAM for s in rows.stream[n:]):
        raise NotExpressible("clean rows after a canvas: the plugin's forwards put the canvas last")
    if rows.block_causal_commit:
        raise NotExpressible("a block-causal clean stream (clean_causal: false) is not served by the vLLM plugin")
    canvases = rows.canvases()
    if len(canvases) > 1:
        raise NotExpressible("more than one canvas in a forward (--self-spec-canvases all) is a native-engine decode")
    if not canvases or within_block_causal or canvases[0][0] < 2:
        return AttentionSpec(True, ())  # a causal canvas, or one slot: the causal rule already is the mask
    start = cached + n
    return AttentionSpec(True, ((start, start + canvases[0][0] - 1),))


def triton_visible(spec: AttentionSpec, cached: int, new_rows: int) -> torch.Tensor:
    """[new_rows, cached + new_rows] bool: what vLLM 0.33's Triton attention lets each new row see under
    `spec` (the rule in this module's docstring, restated for the contract check and the tests)."""
    q = torch.arange(cached, cached + new_rows)[:, None]
    k = torch.arange(cached + new_rows)[None, :]
    seen = k <= q if spec.causal else torch.ones(new_rows, cached + new_rows, dtype=torch.bool)
    for start, end in spec.ranges:
        if start < end:
            seen = seen | ((q >= start) & (q <= end) & (k >= start) & (k <= end))
    return seen
