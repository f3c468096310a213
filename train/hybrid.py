"""Hybrid models (Qwen3.5: gated-delta linear attention + full attention) on two-stream rows.

Full-attention layers take the shared attention rule. Each gated-delta layer gets a two-stream
forward (bound to the instance, so parameter names and checkpoints stay stock) that reads the
batch's `GatedDeltaLayout`, passed down as the "linear_attention" entry of the decoder's mask
mapping.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from bdcore.attention_rule import CLEAN_STREAM, TokenMeta
from bdcore.gated_delta import prepare_qk
from train.config import BlockDiffusionConfig
from train.two_stream_gated_delta import GatedDeltaLayout, two_stream_conv, two_stream_gated_delta


def build_layout(
    meta: TokenMeta, cfg: BlockDiffusionConfig, *, conv_width: int, chunk: int | None = None
) -> GatedDeltaLayout:
    """Index maps for the gated-delta layers from the row metadata (see `GatedDeltaLayout`).

    Prompt text is cut into segments of `chunk` tokens (default: the block size, at least 16), so
    prompt and block segments share one padded length and no compute goes to padding.
    """
    chunk = chunk or max(16, cfg.bd_size)
    B, T = meta.stream.shape
    m = TokenMeta(*(x.detach().cpu().reshape(-1) for x in meta))
    stream, doc, pos, blk, bstart = (x.tolist() for x in m)
    flat = torch.arange(B * T)

    # Flat index of position 0 of each token's document in the clean stream.
    key = (flat // T) * (T + 1) + m.doc + 1  # unique per (row, doc); padding (doc -1) maps to its own key
    clean = m.stream == CLEAN_STREAM
    first_clean = torch.full((B * (T + 1) + 1,), -1, dtype=torch.long)
    first_clean.scatter_reduce_(0, key[clean], flat[clean], reduce="amin", include_self=False)
    c_base = first_clean[key]

    # Conv taps: inside a noised block its own noised tokens, before the block the clean stream.
    offs = torch.arange(conv_width - 1, -1, -1)  # tap k reads position pos - (K - 1 - k)
    j = m.pos[:, None] - offs[None, :]
    noised = (m.stream > CLEAN_STREAM)[:, None]
    from_block = flat[:, None] - offs[None, :]
    from_clean = torch.where(j >= 0, c_base[:, None] + j, -1)
    src = torch.where(noised & (j >= m.bstart[:, None]), from_block, from_clean)
    src = torch.where((m.stream < 0)[:, None], -1, src)

    # Clean-stream segments per document: each response block alone, prompt text every `chunk` tokens.
    lanes, seg_of_block = [], {}
    t = 0
    while t < B * T:
        if stream[t] != CLEAN_STREAM:
            t += 1
            continue
        lane, start = [], t
        while t < B * T and stream[t] == CLEAN_STREAM and doc[t] == doc[start] and t // T == start // T:
            s = t
            if blk[t] >= 0:
                while t < B * T and stream[t] == CLEAN_STREAM and blk[t] == blk[s] and t // T == s // T:
                    t += 1
                seg_of_block[(s // T, blk[s])] = (len(lanes), len(lane))
            else:
                while (
                    t < B * T
                    and stream[t] == CLEAN_STREAM
                    and blk[t] < 0
                    and doc[t] == doc[s]
                    and t - s < chunk
                    and t // T == s // T
                ):
                    t += 1
            lane.append((s, t, blk[s] >= 0))
        lanes.append(lane)
    S = max([e - s for lane in lanes for s, e, _ in lane] or [1])
    n_segs = max([len(lane) for lane in lanes] or [1])
    seg_tok = torch.full((max(1, len(lanes)), n_segs, S), -1, dtype=torch.long)
    seg_end = torch.zeros(seg_tok.shape[:2], dtype=torch.bool)
    for li, lane in enumerate(lanes):
        for si, (s, e, is_block) in enumerate(lane):
            seg_tok[li, si, : e - s] = torch.arange(s, e)
            seg_end[li, si] = is_block and not cfg.clean_causal

    # Noised blocks: contiguous runs of one (view, block); each starts from its clean block's entry state.
    blk_tok, blk_lane, blk_seg = [], [], []
    t = 0
    while t < B * T:
        if stream[t] > CLEAN_STREAM and pos[t] == bstart[t]:
            lane_seg = seg_of_block[(t // T, blk[t])]
            blk_tok.append(list(range(t, t + cfg.bd_size)))
            blk_lane.append(lane_seg[0])
            blk_seg.append(lane_seg[1])
            t += cfg.bd_size
        else:
            t += 1
    return GatedDeltaLayout(
        seg_tok=seg_tok,
        seg_end_readout=seg_end,
        blk_tok=torch.tensor(blk_tok, dtype=torch.long).reshape(-1, cfg.bd_size),
        blk_lane=torch.tensor(blk_lane, dtype=torch.long),
        blk_seg=torch.tensor(blk_seg, dtype=torch.long),
        conv_src=src,
        noised_end_readout=not cfg.within_block_causal,
        num_tokens=B * T,
    )


def two_stream_gated_delta_forward(self, hidden_states, cache_params=None, attention_mask=None, **kwargs):
    """Drop-in forward for a Qwen3.5-style gated-delta module over a two-stream row.

    `attention_mask` is the batch's `GatedDeltaLayout`; the projections, gating, norm and output
    follow the stock layer so the clean stream reproduces it exactly.
    """
    layout: GatedDeltaLayout = attention_mask
    if not isinstance(layout, GatedDeltaLayout):
        raise TypeError("two-stream gated-delta layer called without a GatedDeltaLayout (call it through TwoStreamLM)")
    Bsz, T, _ = hidden_states.shape
    x = hidden_states.reshape(Bsz * T, -1)
    mixed = two_stream_conv(self.in_proj_qkv(x), self.conv1d.weight.squeeze(1), self.conv1d.bias, layout.conv_src)
    mixed = ACT2FN[self.activation](mixed).to(hidden_states.dtype)
    q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
    q = q.reshape(Bsz * T, -1, self.head_k_dim)
    k = k.reshape(Bsz * T, -1, self.head_k_dim)
    v = v.reshape(Bsz * T, -1, self.head_v_dim)
    beta = self.in_proj_b(x).sigmoid()
    g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)
    q, k = prepare_qk(q, k, self.num_v_heads)
    core = two_stream_gated_delta(q, k, v, g, beta, layout).to(hidden_states.dtype)
    z = self.in_proj_z(x).reshape(-1, self.head_v_dim)
    core = self.norm(core.reshape(-1, self.head_v_dim), z).reshape(Bsz, T, -1)
    return self.out_proj(core)


def linear_attention_modules(model) -> list:
    return [layer.linear_attn for layer in model.get_decoder().layers if hasattr(layer, "linear_attn")]


def patch_gated_delta_layers(model) -> None:
    """Bind the two-stream forward to every gated-delta module (idempotent)."""
    for module in linear_attention_modules(model):
        for attr in ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "conv1d", "A_log", "dt_bias", "norm"):
            if not hasattr(module, attr):
                raise NotImplementedError(
                    f"{type(module).__name__} lacks `{attr}`: only Qwen3.5-style gated-delta layers are supported"
                )
        module.forward = types.MethodType(two_stream_gated_delta_forward, module)
