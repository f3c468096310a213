"""One model forward for several requests at once, each with its own KV cache (and gated-delta state).

Every request keeps its committed keys/values per attention layer. A batched forward right-pads each
request's cache to the longest one and its new rows to the longest row list, builds the attention
mask per request with the same `decode_mask` the one-request runner uses (padding is never visible;
a padding row sees only itself, so no row of the batch is empty), runs the model once, and keeps each
request's first `keep` new rows. A crop only shortens one request's cache. The copies this costs are
small next to the forward on the sizes the native engine serves; SGLang covers large-scale serving.

Hybrid models: each request also keeps its gated-delta layers' states; the layers get one
`DecodePlan` per batch row (`hybrid.py` runs them request by request, exactly as alone), and a crop
restores the state the request's last (rollback) forward snapshotted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from inference.hybrid import DecodePlan, patch_for_decode, roll_back
from inference.runner import Rows, decode_mask


@dataclass
class RequestCache:
    keys: list[torch.Tensor] = field(default_factory=list)  # per attention layer [kv_heads, L, d]
    values: list[torch.Tensor] = field(default_factory=list)
    states: dict = field(default_factory=dict)  # gated-delta layer -> LayerState (hybrids)
    plan: DecodePlan | None = None  # the last forward's plan (hybrids), for a rollback
    plan_base: int = 0

    @property
    def length(self) -> int:
        return self.keys[0].shape[1] if self.keys else 0

    def crop(self, length: int) -> None:
        if length >= self.length:
            return
        if self.plan is not None:  # gated-delta layers: the state after exactly `length` tokens
            roll_back(self.plan, self.plan_base, length, self.states)
        self.keys = [k[:, :length] for k in self.keys]
        self.values = [v[:, :length] for v in self.values]


class BatchRunner:
    def __init__(self, model, *, banned: int | None, clean_causal: bool = True, within_block_causal: bool = False):
        self.model = model
        self.hybrid = "linear_attention" in set(getattr(model.config, "layer_types", None) or [])
        linear = patch_for_decode(model) if self.hybrid else []
        self.attn_layers = [i for i in range(len(model.get_decoder().layers)) if i not in linear]
        self.banned = banned
        self.clean_causal = clean_causal
        self.within_block_causal = within_block_causal
        self.device = next(model.parameters()).device

    @torch.no_grad()
    def forward(self, batch: list[tuple[RequestCache, Rows, int, bool]]) -> list[torch.Tensor]:
        """Logits [len(rows), V] per (cache, rows, keep, rollback) (mask token banned); each request keeps
        its first `keep` rows; `rollback`: a crop may later cut back into this forward's clean rows."""
        from transformers import DynamicCache

        n, dev = len(batch), self.device
        lengths = [cache.length for cache, *_ in batch]
        sizes = [len(rows.tokens) for _, rows, *_ in batch]
        L, Q = max(lengths), max(sizes)
        ids = torch.zeros(n, Q, dtype=torch.long, device=dev)
        pos = torch.zeros(n, Q, dtype=torch.long, device=dev)
        mask = torch.zeros(n, 1, Q, L + Q, dtype=torch.bool, device=dev)
        mask[:, 0, torch.arange(Q), L + torch.arange(Q)] = True  # padding rows see themselves
        for b, ((_, rows, *_), c, q) in enumerate(zip(batch, lengths, sizes)):
            ids[b, :q] = torch.tensor(rows.tokens, device=dev)
            pos[b, :q] = torch.tensor(rows.pos, device=dev)
            m = decode_mask(c, rows, self.clean_causal, self.within_block_causal, dev)[0, 0]
            mask[b, 0, :q] = False
            mask[b, 0, :q, :c] = m[:, :c]
            mask[b, 0, :q, L : L + q] = m[:, c:]
        cache = DynamicCache(config=self.model.config)
        if L:
            for j, layer in enumerate(self.attn_layers):
                cache.update(*(self._padded(batch, j, which, L) for which in ("keys", "values")), layer)
        masks = mask
        if self.hybrid:
            plans = []
            for (req, rows, keep, rollback), c in zip(batch, lengths):
                end_readout = not self.within_block_causal
                plans.append(
                    DecodePlan(
                        rows.n_clean,
                        keep,
                        end_readout,
                        req.states,
                        rollback,
                        rows=len(rows.tokens),
                        clean_block_end=rows.block_causal_commit,
                    )
                )
                req.plan, req.plan_base = plans[-1], c
            masks = {"full_attention": mask, "linear_attention": plans}
        out = self.model(input_ids=ids, position_ids=pos, attention_mask=masks, past_key_values=cache, use_cache=True)
        logits = out.logits.float()
        if self.banned is not None:
            logits[..., self.banned] = float("-inf")
        results = []
        for b, (req, _rows, keep, _rollback) in enumerate(batch):
            new_k = [cache.layers[i].keys[b, :, L : L + keep] for i in self.attn_layers]
            new_v = [cache.layers[i].values[b, :, L : L + keep] for i in self.attn_layers]
            if req.keys:
                req.keys = [torch.cat([k, nk], 1) for k, nk in zip(req.keys, new_k)]
                req.values = [torch.cat([v, nv], 1) for v, nv in zip(req.values, new_v)]
            else:
                req.keys, req.values = [k.clone() for k in new_k], [v.clone() for v in new_v]
            results.append(logits[b, : sizes[b]])
        return results

    @staticmethod
    def _padded(batch, layer: int, which: str, L: int) -> torch.Tensor:
        parts = []
        for cache, *_ in batch:
            t = getattr(cache, which)[layer] if getattr(cache, which) else None
            if t is None:
                parts.append(None)
                continue
            parts.append(torch.nn.functional.pad(t, (0, 0, 0, L - t.shape[1])))
        like = next(p for p in parts if p is not None)
        return torch.stack([p if p is not None else torch.zeros_like(like) for p in parts])
