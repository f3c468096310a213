"""The decode runner: one model forward over the next rows of one or more sequences.

Each sequence keeps its own cache (`SequenceCache`: keys/values per attention layer, gated-delta
states). A forward right-pads the caches to the longest one and the new rows to the longest row list,
builds each sequence's mask with `decode_mask` (padding is never visible; a padding row sees only
itself, so no row is empty), runs the model once and keeps each sequence's first `keep` new rows. A
batch of one is a batch: its cache goes in without padding or copies. Prompts run in a forward of their own
when sequences already decoding share the call (padding them all to a prompt's length costs more than the
second forward). Hybrid models: the gated-delta
layers get one `DecodePlan` per batch row and run sequence by sequence, exactly as alone; a crop
restores the state the sequence's last (rollback) forward snapshotted.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import torch

from bdcore.decode.gated_delta_layers import DecodePlan, patch_for_decode
from bdcore.decode.rows import Forward, decode_mask
from bdcore.decode.sampling import ban
from bdcore.decode.sequence import SequenceCache
from bdcore.draft_adapter import draft_rows
from bdcore.gated_delta import is_hybrid

if TYPE_CHECKING:
    from bdcore.capabilities import Capabilities


class ModelRunner:
    def __init__(self, model, *, banned: int | None, clean_causal: bool = True, within_block_causal: bool = False):
        self.model = model
        self.hybrid = is_hybrid(model.config)
        self.linear_layers = patch_for_decode(model) if self.hybrid else []
        self.attn_layers = [i for i in range(len(model.get_decoder().layers)) if i not in self.linear_layers]
        self.banned = banned
        self.clean_causal = clean_causal
        self.within_block_causal = within_block_causal
        self.device = next(model.parameters()).device
        self.serving_only = False  # set by the engine: see _no_autograd
        from transformers import DynamicCache

        # Built once and copied blank per forward: building from the config walks it (~1 ms a forward on a CPU,
        # 2-3% of a 135M model's decode step).
        self._cache_template = DynamicCache(config=model.config)

    @classmethod
    def for_checkpoint(cls, model, caps: Capabilities) -> ModelRunner:
        """The runner for a checkpoint with capabilities `caps`: its mask ban and the attention it was trained with."""
        return cls(
            model, banned=caps.mask_id, clean_causal=caps.clean_causal, within_block_causal=caps.within_block_causal
        )

    def _blank_cache(self):
        """A new, empty forward cache: the template's layers copied before any forward filled them."""
        kv = copy.copy(self._cache_template)
        kv.layers = [_blank_layer(layer) for layer in self._cache_template.layers]
        return kv

    def forward(self, batch: list[tuple[SequenceCache, Forward]]) -> list[torch.Tensor]:
        """Logits [len(rows), V] per (cache, forward), `<|mask|>` banned; each cache keeps its first `keep`
        new rows. Prompts (sequences with an empty cache) run apart from the sequences already decoding: a
        forward pads every sequence's rows to the longest, so one prompt among decode steps of a row or a
        few would make every sequence in the batch prompt-long."""
        fresh = [cache.length == 0 for cache, _ in batch]
        if all(fresh) or not any(fresh):
            return self._logits(batch)
        out: list[torch.Tensor | None] = [None] * len(batch)
        for want in (True, False):
            idx = [i for i, f in enumerate(fresh) if f == want]
            for i, logits in zip(idx, self._logits([batch[i] for i in idx])):
                out[i] = logits
        return out

    def _logits(self, batch: list[tuple[SequenceCache, Forward]]) -> list[torch.Tensor]:
        """Logits as ordinary fp32 tensors, which callers may change and train on (rollouts)."""
        with self._no_autograd():
            raw = self._forward_padded(batch)
        logits = ban(raw, self.banned)
        return [logits[b, : len(op.rows.tokens)] for b, (_, op) in enumerate(batch)]

    def _no_autograd(self):
        """Inference mode where the caller said the model only serves (the engine: about 5% of a small
        model's decode step on a CPU, against no_grad); no_grad otherwise: a model that also trains (rollouts)
        has autograd machinery (checkpointing, FSDP hooks) that refuses inference tensors."""
        return torch.inference_mode() if self.serving_only else torch.no_grad()

    def _forward_padded(self, batch: list[tuple[SequenceCache, Forward]]) -> torch.Tensor:
        """One model forward over every sequence of `batch`, right-padded to the longest cache and row list:
        its raw logits [batch, longest row list, V]."""
        n, dev = len(batch), self.device
        lengths = [cache.length for cache, _ in batch]
        sizes = [len(op.rows.tokens) for _, op in batch]
        L, Q = max(lengths), max(sizes)
        ids = torch.zeros(n, Q, dtype=torch.long, device=dev)
        pos = torch.zeros(n, Q, dtype=torch.long, device=dev)
        mask = torch.zeros(n, 1, Q, L + Q, dtype=torch.bool, device=dev)
        mask[:, 0, torch.arange(Q), L + torch.arange(Q)] = True  # padding rows see themselves
        for b, ((_, op), c, q) in enumerate(zip(batch, lengths, sizes)):
            ids[b, :q] = torch.tensor(op.rows.tokens, device=dev)
            pos[b, :q] = torch.tensor(op.rows.pos, device=dev)
            m = decode_mask(c, op.rows, self.clean_causal, self.within_block_causal, dev)[0, 0]
            mask[b, 0, :q] = False
            mask[b, 0, :q, :c] = m[:, :c]
            mask[b, 0, :q, L : L + q] = m[:, c:]
        kv = self._blank_cache()
        if L:
            for j, layer in enumerate(self.attn_layers):
                self._fill(kv.layers[layer], [cache for cache, _ in batch], j, L)
        masks = mask
        if self.hybrid:
            plans = []
            for (cache, op), c in zip(batch, lengths):
                rows = op.rows
                plan = DecodePlan(
                    rows.n_clean,
                    op.keep,
                    not self.within_block_causal,
                    cache.states,
                    op.rollback,
                    rows=len(rows.tokens),
                    clean_block_end=rows.block_causal_commit,
                    canvases=rows.canvases(),
                    parents=rows.parents,
                )
                cache.plan, cache.plan_base = plan, c
                plans.append(plan)
            masks = {"full_attention": mask, "linear_attention": plans}
        drafting = torch.zeros(n, Q, dtype=torch.bool, device=dev)  # a draft-only adapter acts at canvas rows only
        for b, (_, op) in enumerate(batch):
            drafting[b, : len(op.rows.stream)] = torch.tensor(op.rows.drafting(), device=dev)
        with draft_rows(self.model, drafting):
            out = self.model(input_ids=ids, position_ids=pos, attention_mask=masks, past_key_values=kv, use_cache=True)
        for b, (cache, op) in enumerate(batch):
            keep_to = L + op.keep
            if n == 1:  # the layer's tensor is [cache, new rows]: keep a view, no copy
                cache.keys = [kv.layers[i].keys[0, :, :keep_to] for i in self.attn_layers]
                cache.values = [kv.layers[i].values[0, :, :keep_to] for i in self.attn_layers]
                continue
            new_k = [kv.layers[i].keys[b, :, L:keep_to] for i in self.attn_layers]
            new_v = [kv.layers[i].values[b, :, L:keep_to] for i in self.attn_layers]
            if cache.keys:
                cache.keys = [torch.cat([k, nk], 1) for k, nk in zip(cache.keys, new_k)]
                cache.values = [torch.cat([v, nv], 1) for v, nv in zip(cache.values, new_v)]
            else:
                cache.keys, cache.values = [k.clone() for k in new_k], [v.clone() for v in new_v]
        return out.logits

    @staticmethod
    def _fill(layer, caches: list[SequenceCache], j: int, L: int) -> None:
        """Seed one attention layer of the forward's cache with every sequence's keys/values, right-padded
        to L. The model's own update then appends the new rows."""
        if len(caches) == 1:
            keys, values = caches[0].keys[j][None], caches[0].values[j][None]
        else:
            like = next(c.keys[j] for c in caches if c.keys)

            def padded(c: SequenceCache, which: str) -> torch.Tensor:
                t = getattr(c, which)[j] if getattr(c, which) else torch.zeros_like(like[:, :0])
                return torch.nn.functional.pad(t, (0, 0, 0, L - t.shape[1]))

            keys = torch.stack([padded(c, "keys") for c in caches])
            values = torch.stack([padded(c, "values") for c in caches])
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values


def _blank_layer(layer):
    """A copy of an unfilled cache layer: its fields are None, numbers, flags and dicts of them (the linear
    attention layers' per-state flags), so copying each field one level deep shares nothing."""
    blank = object.__new__(type(layer))
    blank.__dict__.update({k: copy.copy(v) for k, v in vars(layer).items()})
    return blank
