"""Gated-delta (Qwen3.5) layers in decode forwards: the runner owns their conv and recurrent state.

A decode forward's rows are clean rows then canvas rows (see `rows.py`). For a gated-delta layer:
- clean rows: the ordinary recurrence from the committed state, token-causal readout (a committed
  block of a block-causal clean stream reads its block-end state, as the trainer's clean segments do);
- canvas rows: start from the state after the clean rows, absorb the canvas, and read the
  block-end state (token-causal with `within_block_causal`); nothing of theirs is kept;
- the causal conv runs over [last K-1 committed features, clean rows, canvas rows], so taps before the
  canvas read clean features, as in training.
Clean rows are absorbed in chunks (`bdcore.gated_delta.chunk_step`), so a long prefill costs a few
matrix products per 64 tokens instead of one step per token. A forward that may be rolled back (a
self-spec verify) steps token by token and keeps the state after each clean row until the next
forward, so the rollback restores the state after exactly the accepted tokens (snapshot and restore;
a recurrent state is never truncated). Other forwards keep no per-row snapshots. A draft tree's verify
(`bdcore.decode.tree`) is such a forward whose rows branch: each row steps from its parent's state and
convolves its own path's features, so the state kept after the accepted path is that path's alone.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from bdcore.draft_adapter import one_batch_row
from bdcore.gated_delta import chunk_step, chunk_terms, prepare_qk

CHUNK = 64  # clean rows absorbed per chunk step


@dataclass
class LayerState:
    conv: torch.Tensor  # [K-1, C] pre-conv features of the last committed tokens (zeros before the start)
    rec: torch.Tensor  # [Hv, dk, dv] fp32 recurrent state after the committed tokens


@dataclass
class DecodePlan:
    """Travels as the "linear_attention" entry of the mask mapping into every gated-delta layer."""

    n_clean: int
    keep: int
    end_readout: bool  # canvas rows read the block-end state (a bidirectional canvas)
    states: dict[int, LayerState]
    rollback: bool = False  # keep the state after each clean row (self-spec verify)
    rows: int = 0  # batched decoding: this request's real rows in its batch row
    # The clean rows are one committed block of a block-causal clean stream (sidecar `clean_causal:
    # false`): in training such a block is one segment read at its end state, so the commit must be too.
    clean_block_end: bool = False
    steps: dict[int, list[LayerState]] = field(default_factory=dict)  # state after each clean row
    # The canvas rows after the clean rows, in order: (rows, clean rows of this forward it sees). None: one
    # canvas seeing every clean row. Self-spec with a canvas after every clean row needs several.
    canvases: list[tuple[int, int]] | None = None
    # A draft tree's forward (`bdcore.decode.tree`): each clean row's parent row (-1: the root). Each row's
    # conv taps and recurrent state continue its parent's, and `steps[r + 1]` is the state after row r's path.
    parents: list[int] | None = None


def roll_back(plan: DecodePlan | None, plan_base: int, length: int, states: dict[int, LayerState]) -> None:
    """Put into `states` each gated-delta layer's state after exactly `length` cached tokens, from the
    snapshots of the last forward (which started at `plan_base` and must have run with rollback)."""
    if plan is not None and plan.parents is not None:
        raise ValueError("a draft tree's forward keeps a path of rows (keep_path), not a length")
    restore(plan, length - plan_base, states)


def restore(plan: DecodePlan | None, step: int, states: dict[int, LayerState]) -> None:
    """Put into `states` each gated-delta layer's snapshot `step` of the last forward: the state after its
    first `step` clean rows, or in a tree's forward after row `step - 1`'s path."""
    if plan is None or step < 0 or not plan.rollback:
        raise ValueError("gated-delta state can only roll back within the last forward, run with rollback=True")
    for layer, steps in plan.steps.items():
        states[layer] = steps[step]


def recurrent_step(S, q, k, v, g, beta):
    """One gated-delta step; q, k already normalised/scaled; S [H, dk, dv]."""
    S = S * g.exp()[:, None, None]
    delta = beta[:, None] * (v - torch.einsum("hkv,hk->hv", S, k))
    S = S + k[:, :, None] * delta[:, None, :]
    return S, torch.einsum("hkv,hk->hv", S, q)


def absorb(S, q, k, v, g, beta, *, end_readout: bool = False, chunk: int = CHUNK):
    """Absorb rows [T, H, d] into state S [H, dk, dv] chunk by chunk: (outputs [T, H, dv], exit state).
    With `end_readout` the rows are one chunk and all read its end state (a bidirectional canvas)."""
    T = q.shape[0]
    if T == 0:
        return v.new_zeros(0, *v.shape[1:]), S
    step = T if end_readout else chunk
    outs = []
    for s in range(0, T, step):
        part = slice(s, s + step)
        terms = chunk_terms(*(x[part].transpose(0, 1) for x in (q, k, v, g, beta)))
        o, S = chunk_step(terms, S, block_end_readout=end_readout)
        outs.append(o.transpose(0, 1))
    return torch.cat(outs), S


def decode_forward(self, hidden_states, cache_params=None, attention_mask=None, **kwargs):
    """`attention_mask` is this forward's DecodePlan, or one plan per batch row (batched decoding:
    row b's first `plan.rows` positions are real, the rest padding, whose output is zero)."""
    if isinstance(attention_mask, DecodePlan):
        return _decode_rows(self, hidden_states[0], attention_mask)[None]
    out = hidden_states.new_zeros(*hidden_states.shape[:2], self.out_proj.out_features)
    for b, plan in enumerate(attention_mask):
        with one_batch_row(self, b):  # a draft-only adapter's gate: this batch row's
            out[b, : plan.rows] = _decode_rows(self, hidden_states[b, : plan.rows], plan)
    return out


def _conv(self, seq):
    """The causal conv over [K-1 taps of context, rows] -> the rows' activated features."""
    if seq.shape[0] < self.conv_kernel_size:  # no rows
        return seq[:0]
    conv = F.conv1d(seq.t()[None], self.conv1d.weight, self.conv1d.bias, groups=self.conv_dim)[0].t()
    return F.silu(conv) if self.activation in ("silu", "swish") else getattr(F, self.activation)(conv)


def _tree_windows(start: torch.Tensor, rows: torch.Tensor, parents: list[int]) -> list[torch.Tensor]:
    """Per tree row r, the K pre-conv features of its path ending at r (K - 1 before it, then its own);
    `start`: the K - 1 committed features before the root."""
    windows: list[torch.Tensor] = []
    for r, parent in enumerate(parents):
        before = start if parent < 0 else windows[parent][1:]
        windows.append(torch.cat([before, rows[r : r + 1]]))
    return windows


def _conv_windows(self, windows: torch.Tensor) -> torch.Tensor:
    """The causal conv's output at the last tap of each window [R, K, C] -> [R, C] activated features."""
    conv = F.conv1d(windows.transpose(1, 2), self.conv1d.weight, self.conv1d.bias, groups=self.conv_dim)[:, :, -1]
    return F.silu(conv) if self.activation in ("silu", "swish") else getattr(F, self.activation)(conv)


def _decode_rows(self, x, plan: DecodePlan):
    """One request's rows [Q, hidden] through the gated-delta layer -> [Q, hidden]."""
    Q, K = x.shape[0], self.conv_kernel_size
    st = plan.states.get(self.layer_idx)
    if st is None:
        st = LayerState(
            x.new_zeros(K - 1, self.conv_dim),
            x.new_zeros(self.num_v_heads, self.head_k_dim, self.head_v_dim, dtype=torch.float32),
        )
    n, keep = plan.n_clean, plan.keep
    canvases = plan.canvases if plan.canvases is not None else [(Q - n, n)]
    mixed = self.in_proj_qkv(x)
    if plan.parents is not None:  # each tree row's conv window: the K - 1 features of its path, then its own
        windows = _tree_windows(st.conv.to(mixed.dtype), mixed[:n], plan.parents)
        parts = [_conv_windows(self, torch.stack(windows)) if windows else mixed[:0]]

        def taps_after(s: int) -> torch.Tensor:  # the K - 1 features after s rows of the path (s - 1: its row)
            return windows[s - 1][1:] if s else st.conv.to(mixed.dtype)
    else:
        seq = torch.cat([st.conv.to(mixed.dtype), mixed[:n]], 0)  # committed features, then the clean rows
        parts = [_conv(self, seq)]

        def taps_after(s: int) -> torch.Tensor:  # the K - 1 features after the first s clean rows
            return seq[s : s + K - 1]

    a = n
    for m, seen in canvases:  # each canvas's taps before it read the clean rows it sees
        parts.append(_conv(self, torch.cat([taps_after(seen), mixed[a : a + m]], 0)))
        a += m
    conv = torch.cat(parts)
    q, k, v = torch.split(conv, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
    q, k = prepare_qk(q.reshape(Q, -1, self.head_k_dim), k.reshape(Q, -1, self.head_k_dim), self.num_v_heads)
    v = v.reshape(Q, -1, self.head_v_dim).float()
    beta = self.in_proj_b(x).sigmoid().float()
    g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)

    if plan.clean_block_end and (plan.rollback or keep != n):
        raise ValueError(
            "a block-causal commit keeps its whole block and is never rolled back (self-spec needs clean_causal: true)"
        )
    if plan.parents is not None and not plan.rollback:
        raise ValueError("a draft tree's forward keeps a path of its rows, so it runs with rollback=True")
    if plan.rollback:  # token by token, remembering every clean row's state for a later rollback
        S, outs, steps = st.rec, [], []
        for t in range(n):
            parent = plan.parents[t] if plan.parents is not None else t - 1  # a chain's parent: the row before
            S = steps[parent].rec if parent >= 0 else st.rec
            S, o = recurrent_step(S, q[t], k[t], v[t], g[t], beta[t])
            outs.append(o)
            steps.append(LayerState(taps_after(t + 1), S))
        clean = torch.stack(outs) if outs else v.new_zeros(0, *v.shape[1:])
        plan.steps[self.layer_idx] = [st, *steps]
        plan.states[self.layer_idx] = plan.steps[self.layer_idx][keep]
    else:  # chunked; the committed state is the one after `keep` clean rows
        rows = (q, k, v, g, beta)
        kept_out, S_keep = absorb(st.rec, *(x[:keep] for x in rows), end_readout=plan.clean_block_end)
        rest_out, S = absorb(S_keep, *(x[keep:n] for x in rows))
        clean = torch.cat([kept_out, rest_out])
        plan.states[self.layer_idx] = LayerState(seq[keep : keep + K - 1], S_keep)
    outs, a = [clean], n
    for m, seen in canvases:  # each canvas starts from the state after the clean rows it sees
        if seen != n and not plan.rollback:
            raise ValueError("a canvas before the last clean row needs the per-row states of a rollback forward")
        start = S if seen == n else plan.steps[self.layer_idx][seen].rec
        out, _ = absorb(start, *(x[a : a + m] for x in (q, k, v, g, beta)), end_readout=plan.end_readout)
        outs.append(out)
        a += m
    core = torch.cat(outs).to(x.dtype)
    z = self.in_proj_z(x).reshape(-1, self.head_v_dim)
    core = self.norm(core.reshape(-1, self.head_v_dim), z).reshape(Q, -1)
    return self.out_proj(core)


def patch_for_decode(model) -> list[int]:
    """Bind the decode forward to every gated-delta layer; return their layer indices."""
    idx = []
    for i, layer in enumerate(model.get_decoder().layers):
        if hasattr(layer, "linear_attn"):
            layer.linear_attn.forward = types.MethodType(decode_forward, layer.linear_attn)
            idx.append(i)
    return idx
