"""The two-stream gated-delta operation (docs/design.md section 3.1), exact and differentiable.

Gated delta rule, per head (state S: [d_k, d_v]; q, k L2-normalised, q scaled by d_k^-1/2):
    S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - (exp(g_t) S_{t-1})^T k_t))^T,   o_t = S_t^T q_t

Two streams over one packed row:
- clean stream C: the ordinary recurrence over each document (zero state at its start), with
  token-causal readout o_t = S_t^T q_t; response tokens read the block-end state instead when the
  clean stream is block-causal (`clean_causal` off);
- noised block b of view v: starts from the clean state just before start(b), absorbs its own
  tokens, and every token reads the block-end state (token-causal with `within_block_causal`).
  The noised state is never carried on.

Chunked like the usual WY/UT formulation: the clean stream of each document is cut into segments
(every response block is one segment, prompt text is cut every `chunk` tokens); all intra-segment
terms are computed at once, then one short scan over segment index carries the state. Noised
blocks are all computed in one batched chunk step from their entry states.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bdcore.gated_delta import ChunkTerms, chunk_step, chunk_terms


@dataclass
class GatedDeltaLayout:
    """Index maps of one batch of two-stream rows (flat token index = row * T + t), built by `train/hybrid.py`.

    seg_tok:    [lanes, segs, S] clean-stream tokens of each segment (-1: padding slot); a lane is one document
    seg_end_readout: [lanes, segs] bool: the segment's tokens read the segment-end state
    blk_tok:    [nblk, B] noised tokens of each noised block (B = bd_size)
    blk_lane, blk_seg: [nblk] the clean segment of the same block, whose entry state the noised block starts from
    conv_src:   [N, K] flat source token of each conv tap (-1: zero), N = rows * T
    noised_end_readout: every noised token reads its block-end state (False with within_block_causal)
    """

    seg_tok: torch.Tensor
    seg_end_readout: torch.Tensor
    blk_tok: torch.Tensor
    blk_lane: torch.Tensor
    blk_seg: torch.Tensor
    conv_src: torch.Tensor
    noised_end_readout: bool
    num_tokens: int

    def to(self, device) -> GatedDeltaLayout:
        moved = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in vars(self).items()}
        return GatedDeltaLayout(**moved)


def _gather(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x: [N, ...]; idx: any shape with -1 for padding -> [*idx.shape, ...] with zeros at padding."""
    out = x[idx.clamp_min(0)]
    keep = (idx >= 0).reshape(*idx.shape, *([1] * (x.dim() - 1)))
    return out * keep


def two_stream_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, src: torch.Tensor):
    """Depthwise causal conv whose taps come from `src`: x [N, C], weight [C, K], src [N, K] -> [N, C]."""
    taps = _gather(x, src)  # [N, K, C]
    out = torch.einsum("nkc,ck->nc", taps.to(weight.dtype), weight)
    return out + bias if bias is not None else out


def two_stream_gated_delta(q, k, v, g, beta, layout: GatedDeltaLayout) -> torch.Tensor:
    """q, k: [N, H, dk] (L2-normalised, q scaled); v: [N, H, dv]; g, beta: [N, H] -> outputs [N, H, dv] (fp32).

    Tokens in no segment and no block (padding) get zeros.
    """
    N, H, dv = v.shape
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    out = v.new_zeros(N, H, dv)

    def heads_first(x, idx):  # [*, S, H, d] -> [*, H, S, d]   ([*, S, H] -> [*, H, S])
        y = _gather(x, idx)
        return y.transpose(-2, -3) if y.dim() == idx.dim() + 2 else y.transpose(-1, -2)

    # Clean stream: intra-segment terms for every segment at once, then a scan over segment index.
    st = layout.seg_tok
    lanes, segs, _ = st.shape
    terms = chunk_terms(*(heads_first(x, st) for x in (q, k, v, g, beta)))
    state = q.new_zeros(lanes, H, q.shape[-1], dv)
    entry, seg_out = [], []
    per_seg = [ChunkTerms(*parts) for parts in zip(*(f.unbind(1) for f in vars(terms).values()))]
    any_end = bool(layout.seg_end_readout.any())
    for j, tj in enumerate(per_seg):
        causal, end = chunk_step(tj, state, block_end_readout=False)
        if any_end:  # block-causal clean stream: response blocks read their block-end state
            causal = torch.where(layout.seg_end_readout[:, j, None, None, None], tj.q @ end, causal)
        entry.append(state)
        seg_out.append(causal)
        state = end
    seg_out = torch.stack(seg_out, 1).transpose(-2, -3)  # [lanes, segs, S, H, dv]
    real = st >= 0
    out = out.index_copy(0, st[real], seg_out[real])

    # Noised blocks: one batched chunk step from the clean state entering the same block.
    bt = layout.blk_tok
    if bt.numel():
        s0 = torch.stack(entry, 1)[layout.blk_lane, layout.blk_seg]  # [nblk, H, dk, dv]
        bterms = chunk_terms(*(heads_first(x, bt) for x in (q, k, v, g, beta)))
        bout, _ = chunk_step(bterms, s0, block_end_readout=layout.noised_end_readout)
        out = out.index_copy(0, bt.flatten(), bout.transpose(-2, -3).flatten(0, 1))
    return out
