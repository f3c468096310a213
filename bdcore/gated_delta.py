"""Gated-delta math shared by the trainer's two-stream op and the engine's decode forward.

Input conventions: Qwen3.5's gated-delta layers L2-normalise q and k, scale q by d_k^-1/2 and repeat
grouped q/k heads to the value heads; both sides must do exactly this for invariant 3 to hold.

The chunk step (WY/UT form): for a chunk of L tokens, every intra-chunk term is computed at once
(`chunk_terms`, independent of the entry state), then `chunk_step` applies the chunk to an entry
state and returns the outputs and the exit state. The trainer chains it over segments and runs noised
blocks from their clean entry states; the engine chains it over a prefill.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LINEAR_LAYER_TYPES = frozenset({"linear_attention"})


def is_hybrid(config) -> bool:
    """A model with gated-delta (linear attention) layers, as its config's `layer_types` say (a config
    object, or config.json's dict, whose text model may sit under `text_config`)."""
    if isinstance(config, dict):
        layer_types = config.get("layer_types") or (config.get("text_config") or {}).get("layer_types")
    else:
        layer_types = getattr(config, "layer_types", None)
    return bool(set(layer_types or []) & LINEAR_LAYER_TYPES)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def prepare_qk(q: torch.Tensor, k: torch.Tensor, num_v_heads: int):
    """q, k: [..., heads, d] -> fp32, repeated to `num_v_heads`, L2-normalised, q scaled."""
    if q.shape[-2] != num_v_heads:
        rep = num_v_heads // q.shape[-2]
        q, k = q.repeat_interleave(rep, dim=-2), k.repeat_interleave(rep, dim=-2)
    q, k = l2norm(q.float()), l2norm(k.float())
    return q * q.shape[-1] ** -0.5, k


@dataclass
class ChunkTerms:
    """Intra-chunk quantities of a batch of chunks [..., L, d] that do not depend on the entry state."""

    new_values: torch.Tensor  # [..., L, dv]  (I + strict_tril(A))^-1 (beta v)
    k_cumdecay: torch.Tensor  # [..., L, dk]  (I + strict_tril(A))^-1 (beta k exp(cum))
    intra: torch.Tensor  # [..., L, L]   (q k^T) * decay(i, j), j <= i
    q_decayed: torch.Tensor  # [..., L, dk]  q exp(cum)
    k_to_end: torch.Tensor  # [..., L, dk]  k exp(cum_L - cum)
    chunk_decay: torch.Tensor  # [..., 1, 1]   exp(cum_L)
    q: torch.Tensor  # [..., L, dk]  for block-end readout


def chunk_terms(q, k, v, g, beta) -> ChunkTerms:
    """q, k: [..., L, dk]; v: [..., L, dv]; g, beta: [..., L]. Padding slots must have k = v = beta = g = 0."""
    L = q.shape[-2]
    cum = g.cumsum(-1)
    upper = torch.ones(L, L, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    k_beta = k * beta.unsqueeze(-1)
    system = ((k_beta @ k.transpose(-1, -2)) * decay).tril(-1) + torch.eye(L, dtype=q.dtype, device=q.device)
    rhs = torch.cat([v * beta.unsqueeze(-1), k_beta * cum.exp().unsqueeze(-1)], dim=-1)
    sol = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    dv = v.shape[-1]
    return ChunkTerms(
        new_values=sol[..., :dv],
        k_cumdecay=sol[..., dv:],
        intra=(q @ k.transpose(-1, -2)) * decay,
        q_decayed=q * cum.exp().unsqueeze(-1),
        k_to_end=k * (cum[..., -1:] - cum).exp().unsqueeze(-1),
        chunk_decay=cum[..., -1].exp()[..., None, None],
        q=q,
    )


def chunk_step(t: ChunkTerms, state: torch.Tensor, *, block_end_readout: bool):
    """Apply one chunk to its entry state [..., dk, dv]; return (outputs [..., L, dv], exit state)."""
    v_new = t.new_values - t.k_cumdecay @ state
    end = state * t.chunk_decay + t.k_to_end.transpose(-1, -2) @ v_new
    out = t.q @ end if block_end_readout else t.q_decayed @ state + t.intra @ v_new
    return out, end
