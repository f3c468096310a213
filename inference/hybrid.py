"""Gated-delta (Qwen3.5) layers in the decode engine: the engine owns their conv and recurrent state.

A decode forward's rows are clean rows then canvas rows (see `runner.py`). For a gated-delta layer:
- clean rows: the ordinary recurrence from the committed state, token-causal readout;
- canvas rows: start from the state after the clean rows, absorb the canvas, and read the
  block-end state (token-causal with `within_block_causal`); nothing of theirs is kept;
- the causal conv runs over [last K-1 committed features, clean rows, canvas rows], so taps before the
  canvas read clean features, as in training.
The state after each clean row is kept until the next forward, so a self-spec rollback restores the
state after exactly the accepted tokens (snapshot and restore; a recurrent state is never truncated).
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from bdcore.gated_delta import prepare_qk


@dataclass
class LayerState:
    conv: torch.Tensor  # [K-1, C] pre-conv features of the last committed tokens (zeros before the start)
    rec: torch.Tensor  # [Hv, dk, dv] fp32 recurrent state after the committed tokens


@dataclass
class DecodePlan:
    """Travels as the "linear_attention" entry of the mask mapping into every gated-delta layer."""

    n_clean: int
    keep: int
    end_readout: bool
    states: dict[int, LayerState]
    steps: dict[int, list[LayerState]] = field(default_factory=dict)  # state after each clean row


def _step(S, q, k, v, g, beta):
    """One gated-delta step; q, k already normalised/scaled; S [H, dk, dv]."""
    S = S * g.exp()[:, None, None]
    delta = beta[:, None] * (v - torch.einsum("hkv,hk->hv", S, k))
    S = S + k[:, :, None] * delta[:, None, :]
    return S, torch.einsum("hkv,hk->hv", S, q)


def decode_forward(self, hidden_states, cache_params=None, attention_mask=None, **kwargs):
    plan: DecodePlan = attention_mask
    x = hidden_states[0]
    Q, K = x.shape[0], self.conv_kernel_size
    st = plan.states.get(self.layer_idx)
    if st is None:
        st = LayerState(
            x.new_zeros(K - 1, self.conv_dim),
            x.new_zeros(self.num_v_heads, self.head_k_dim, self.head_v_dim, dtype=torch.float32),
        )
    mixed = self.in_proj_qkv(x)
    seq = torch.cat([st.conv.to(mixed.dtype), mixed], 0)
    conv = F.conv1d(seq.t()[None], self.conv1d.weight, self.conv1d.bias, groups=self.conv_dim)[0].t()
    conv = F.silu(conv) if self.activation in ("silu", "swish") else getattr(F, self.activation)(conv)
    q, k, v = torch.split(conv, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
    q, k = prepare_qk(q.reshape(Q, -1, self.head_k_dim), k.reshape(Q, -1, self.head_k_dim), self.num_v_heads)
    v = v.reshape(Q, -1, self.head_v_dim).float()
    beta = self.in_proj_b(x).sigmoid().float()
    g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)

    S, outs, steps = st.rec, [], []
    for t in range(plan.n_clean):
        S, o = _step(S, q[t], k[t], v[t], g[t], beta[t])
        outs.append(o)
        steps.append(LayerState(seq[t + 1 : t + K], S))
    canvas_state = S
    canvas_outs = []
    for t in range(plan.n_clean, Q):
        canvas_state, o = _step(canvas_state, q[t], k[t], v[t], g[t], beta[t])
        canvas_outs.append(o)
    if plan.end_readout and canvas_outs:
        canvas_outs = list(torch.einsum("hkv,thk->thv", canvas_state, q[plan.n_clean :]))
    core = torch.stack(outs + canvas_outs).to(x.dtype)
    # Commit the state after `keep` clean rows; remember every clean row's for a later rollback.
    plan.steps[self.layer_idx] = [st, *steps]
    plan.states[self.layer_idx] = plan.steps[self.layer_idx][plan.keep]
    z = self.in_proj_z(x).reshape(-1, self.head_v_dim)
    core = self.norm(core.reshape(-1, self.head_v_dim), z).reshape(1, Q, -1)
    return self.out_proj(core)


def patch_for_decode(model) -> list[int]:
    """Bind the decode forward to every gated-delta layer; return their layer indices."""
    idx = []
    for i, layer in enumerate(model.get_decoder().layers):
        if hasattr(layer, "linear_attn"):
            layer.linear_attn.forward = types.MethodType(decode_forward, layer.linear_attn)
            idx.append(i)
    return idx
