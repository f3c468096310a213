"""Slow references of the two-stream gated delta, written for clarity: a per-token recurrence over the
row metadata and a causal conv by dictionary lookups. Tests hold the chunked trainer op
(`train/two_stream_gated_delta.py`) against them, and `benchmark/gated_delta.py` times them."""

from __future__ import annotations

import torch


def _step(S, q, k, v, g, beta):
    S = S * g.exp()[:, None, None]
    delta = beta[:, None] * (v - torch.einsum("hkv,hk->hv", S, k))
    S = S + k[:, :, None] * delta[:, None, :]
    return S, torch.einsum("hkv,hk->hv", S, q)


def reference_gated_delta(meta, q, k, v, g, beta, *, clean_causal, within_block_causal):
    """The two-stream gated delta of docs/design.md section 3.1 token by token, walking the row metadata
    (no layout indices). q, k, v: [N, H, d] over the flattened rows; g, beta: [N, H]."""
    stream, doc, pos, blk = (x.reshape(-1).tolist() for x in (meta.stream, meta.doc, meta.pos, meta.blk))
    T = meta.stream.shape[1]
    N, H, dk = q.shape
    out = [torch.zeros(H, v.shape[-1]) for _ in range(N)]
    groups = {}
    for t in range(N):
        if stream[t] >= 0:
            groups.setdefault((t // T, doc[t], stream[t], blk[t] if stream[t] > 0 else None), []).append(t)
    before, clean_end = {}, {}
    for (row, d, s, _), toks in groups.items():
        if s != 0:
            continue
        S = torch.zeros(H, dk, v.shape[-1])
        for t in sorted(toks, key=lambda t: pos[t]):
            before[(row, d, pos[t])] = S
            S, out[t] = _step(S, q[t], k[t], v[t], g[t], beta[t])
            if blk[t] >= 0:
                clean_end[(row, blk[t])] = S
        if not clean_causal:
            for t in toks:
                if blk[t] >= 0:
                    out[t] = torch.einsum("hkv,hk->hv", clean_end[(row, blk[t])], q[t])
    for (row, d, s, _b), toks in groups.items():
        if s == 0:
            continue
        toks = sorted(toks, key=lambda t: pos[t])
        S = before[(row, d, pos[toks[0]])]
        for t in toks:
            S, out[t] = _step(S, q[t], k[t], v[t], g[t], beta[t])
        if not within_block_causal:
            for t in toks:
                out[t] = torch.einsum("hkv,hk->hv", S, q[t])
    return torch.stack(out)


def reference_conv(meta, x, weight):
    """Causal conv whose taps before a noised block read the clean stream, by dictionary lookups."""
    stream, doc, pos, blk, bstart = (t.reshape(-1).tolist() for t in meta)
    T = meta.stream.shape[1]
    where = {(t // T, doc[t], stream[t], blk[t] if stream[t] > 0 else None, pos[t]): t for t in range(len(stream))}
    K = weight.shape[1]
    out = torch.zeros_like(x)
    for t in range(len(stream)):
        if stream[t] < 0:
            continue
        for kk in range(K):
            j = pos[t] - (K - 1 - kk)
            if stream[t] > 0 and j >= bstart[t]:
                src = where[(t // T, doc[t], stream[t], blk[t], j)]
            elif j >= 0:
                src = where[(t // T, doc[t], 0, None, j)]
            else:
                continue
            out[t] += weight[:, kk] * x[src]
    return out
