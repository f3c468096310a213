"""Gated-delta input conventions shared by the trainer's chunked op and the engine's recurrence.

Qwen3.5's gated-delta layers L2-normalise q and k, scale q by d_k^-1/2 and repeat grouped q/k heads to
the value heads; both sides must do exactly this for invariant 3 to hold.
"""

from __future__ import annotations

import torch


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def prepare_qk(q: torch.Tensor, k: torch.Tensor, num_v_heads: int):
    """q, k: [..., heads, d] -> fp32, repeated to `num_v_heads`, L2-normalised, q scaled."""
    if q.shape[-2] != num_v_heads:
        rep = num_v_heads // q.shape[-2]
        q, k = q.repeat_interleave(rep, dim=-2), k.repeat_interleave(rep, dim=-2)
    q, k = l2norm(q.float()), l2norm(k.float())
    return q * q.shape[-1] ** -0.5, k
