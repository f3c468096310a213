"""The decode runner: one model forward over the next rows of one or more sequences.

Each sequence keeps its own cache (`SequenceCache`: keys/values per attention layer, gated-delta states, in
buffers with room for new rows: `SequenceCache.reserve`). A batch of one decodes in its own cache's buffers;
sequences decoding together keep theirs as the rows of one buffer per layer (`kv_slab.BatchSlab`: a join
copies the newcomer into a free row), and a forward runs them in their rows' order. The model's attention
layers write each sequence's new keys and values in place right after its own cached tokens
(`written_in_place`); the new rows are right-padded to the longest row list, each sequence's mask built with
`decode_mask` (what lies past a sequence's tokens is never visible; a padding row sees only itself, so no
row is empty). The model runs once and each sequence keeps its first `keep` new rows. Prompts run in a
forward of their own when sequences already decoding share the call (padding them all to a prompt's length
costs more than the second forward). Hybrid models: the gated-delta
layers get one `DecodePlan` per batch row and run sequence by sequence, exactly as alone; a crop restores
the state the sequence's last (rollback) forward snapshotted.
"""

from __future__ import annotations

import copy
import functools
from typing import TYPE_CHECKING

import torch

from bdcore.decode.compiled_step import CompiledModels, compile_works
from bdcore.decode.gated_delta_layers import DecodePlan, patch_for_decode
from bdcore.decode.kv_slab import BatchSlab, offsets_index
from bdcore.decode.rows import Forward, decode_mask
from bdcore.decode.sampling import ban
from bdcore.decode.sequence import SequenceCache
from bdcore.draft_adapter import draft_gate, draft_rows
from bdcore.draft_adapter_serving import DraftingTwin, base_twin, is_served
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
        self._twin = None  # the base modules of a served draft-adapter model (`_model_for`), made on first use
        self._drafter: DraftingTwin | None = None  # its compiled drafting forwards' modules (`_compiled_for`)
        self.compiled: CompiledModels | None = None  # set by `compile_decode`: decode forwards run compiled
        self.slab = BatchSlab()  # the caches of the sequences decoding together
        from transformers import DynamicCache

        # Built once and copied blank per forward: building from the config walks it (~1 ms a forward on a CPU,
        # 2-3% of a 135M model's decode step).
        self._cache_template = DynamicCache(config=model.config)
        other = {type(self._cache_template.layers[i]).__name__ for i in self.attn_layers}
        if other != {"DynamicLayer"}:  # e.g. sliding-window layers, which keep only the window
            raise NotImplementedError(
                f"the decode runner keeps every attention layer's whole context and writes new rows in place; "
                f"this model's attention cache layers are {sorted(other)}. Serve it with a backend made for them "
                f"(SGLang, vLLM) or disable its sliding window in config.json."
            )

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
        """One model forward over every sequence of `batch`, its new rows right-padded to the longest row list
        and written after its own cached tokens: its raw logits [batch, longest row list, V]."""
        n, dev = len(batch), self.device
        seats, slab = None, None
        if n > 1 and batch[0][0].length:  # decoding together (prompts run apart): in their rows of the slab,
            total = max(c.length for c, _ in batch) + max(len(op.rows.tokens) for _, op in batch)
            seats, slab = self.slab.seat([cache for cache, _ in batch], total)
            batch = [batch[i] for i in sorted(range(n), key=seats.__getitem__)]  # in row order
        lengths = [cache.length for cache, _ in batch]
        sizes = [len(op.rows.tokens) for _, op in batch]
        L, Q = max(lengths), max(sizes)
        ids = torch.zeros(n, Q, dtype=torch.long, device=dev)
        pos = torch.zeros(n, Q, dtype=torch.long, device=dev)
        mask = torch.zeros(n, 1, Q, L + Q, dtype=torch.bool, device=dev)
        steps = torch.arange(Q, device=dev)
        # padding rows see themselves (sequence b's row i is written at column lengths[b] + i)
        mask[:, 0, steps, torch.tensor(lengths, device=dev)[:, None] + steps] = True
        for b, ((_, op), c, q) in enumerate(zip(batch, lengths, sizes)):
            ids[b, :q] = torch.tensor(op.rows.tokens, device=dev)
            pos[b, :q] = torch.tensor(op.rows.pos, device=dev)
            mask[b, 0, :q] = False
            mask[b, 0, :q, : c + q] = decode_mask(c, op.rows, self.clean_causal, self.within_block_causal, dev)[0, 0]
        kv = self._blank_cache()
        if L:
            self._seat(kv, batch[0][0] if slab is None else slab, lengths, Q)
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
        drafts = False
        for b, (_, op) in enumerate(batch):
            rows = op.rows.drafting()
            drafts = drafts or any(rows)
            drafting[b, : len(op.rows.stream)] = torch.tensor(rows, device=dev)
        model = self._model_for(drafts)
        if self.compiled is not None and L and not self.hybrid:  # a decode step (compiled_step.py)
            model = self._compiled_for(model, drafting if drafts else None)
        with draft_rows(self.model, drafting):
            out = model(input_ids=ids, position_ids=pos, attention_mask=masks, past_key_values=kv, use_cache=True)
        for b, (cache, op) in enumerate(batch):
            if L:  # every sequence of a forward without a prompt has a cache: its rows were written in its room
                cache.keep(lengths[b] + op.keep)
            elif n == 1:  # a prompt: the layer's tensor is its new rows, kept as a view
                cache.keys = [kv.layers[i].keys[0, :, : op.keep] for i in self.attn_layers]
                cache.values = [kv.layers[i].values[0, :, : op.keep] for i in self.attn_layers]
            else:
                cache.keys = [kv.layers[i].keys[b, :, : op.keep].clone() for i in self.attn_layers]
                cache.values = [kv.layers[i].values[b, :, : op.keep].clone() for i in self.attn_layers]
        if seats is not None and seats != sorted(seats):  # back to the caller's order
            return out.logits[torch.tensor(seats, device=dev)]
        return out.logits

    def compile_decode(self) -> None:
        """Run decode forwards compiled from now on (`compiled_step.py`); a clear error where it cannot be here."""
        if (why := compile_works()) is not None:
            raise RuntimeError(f"cannot compile the decode step: {why}; serve without --compile")
        self.compiled = CompiledModels()

    def _compiled_for(self, model, drafting: torch.Tensor | None):
        """The compiled forward of a decode step on `model`. Where rows draft (`drafting`) on a served draft
        adapter, its drafting twin's (`DraftingTwin`, gated by a tensor the graph reads), or the eager model where
        the twin cannot take the rows; a model without a draft adapter drafts with its own weights."""
        if drafting is None or draft_gate(self.model) is None:
            return self.compiled(model)
        if self._drafter is None:
            if not self.serving_only or not is_served(self.model):
                return model
            self._drafter = DraftingTwin(self.model)
        return self.compiled(self._drafter.module) if self._drafter.set_rows(drafting) else model

    def _model_for(self, drafts: bool):
        """The model to run a forward on: a served draft-adapter model's base modules (`base_twin`) where no row
        drafts, the model itself otherwise. Only where the engine serves: a model that also trains (rollouts)
        may be sharded or checkpointed, and its module tree is not for copying."""
        if drafts or not self.serving_only or draft_gate(self.model) is None:
            return self.model
        if self._twin is None:
            self._twin = base_twin(self.model)
            if self.hybrid:
                patch_for_decode(self._twin)
        return self._twin

    def _seat(self, kv, room, lengths: list[int], rows: int) -> None:
        """Give every attention layer of the forward's cache (`kv`) the sequences' keys/values in buffers with
        room for `rows` new rows after each, which the model's update then writes in place (`written_in_place`):
        `room` is a batch of one's own cache (its buffers, grown if need be), or a batch's rows of the slab
        (`BatchSlab.seat`: keys' then values' buffers per attention layer)."""
        layer_type = written_in_place()
        total = max(lengths) + rows
        if isinstance(room, SequenceCache):
            keys, values = room.reserve(total)
            keys, values = [k[None] for k in keys], [v[None] for v in values]
        else:
            keys, values = room[: len(room) // 2], room[len(room) // 2 :]
        where = offsets_index(lengths, rows, self.device)
        for j, i in enumerate(self.attn_layers):
            kv.layers[i] = layer_type(keys[j][:, :, :total], values[j][:, :, :total], max(lengths), where)


@functools.cache
def written_in_place() -> type:
    """The attention cache layer of a decode forward (a subclass of transformers' `DynamicLayer`, made on
    first use: bdcore imports no transformers internals at import time): it holds buffers [batch, heads,
    total, d] whose first `length` tokens (the longest cache's) hold the cached ones, and `update` writes the
    forward's new rows in place, where `DynamicLayer` concatenates (a copy of the whole cache per layer per
    forward): after `length` tokens, or where `where` (`kv_slab.offsets_index`) puts each sequence's, right
    after its own cache. The attention reads the first `length` + new rows tokens of every row."""
    from transformers.cache_utils import DynamicLayer

    class WrittenInPlace(DynamicLayer):
        def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int, where=None):
            super().__init__()
            self._room, self._length, self._where = (keys, values), length, where
            self.dtype, self.device = keys.dtype, keys.device
            self.keys, self.values = keys[:, :, :length], values[:, :, :length]
            self.is_initialized = True

        def update(self, key_states, value_states, *args, **kwargs):
            end = self._length + key_states.shape[-2]
            keys, values = self._room
            if self._where is None:
                keys[:, :, self._length : end] = key_states
                values[:, :, self._length : end] = value_states
            else:
                batch, tokens = self._where
                keys[batch, :, tokens] = key_states.transpose(1, 2)
                values[batch, :, tokens] = value_states.transpose(1, 2)
            self.keys, self.values = keys[:, :, :end], values[:, :, :end]
            return self.keys, self.values

    return WrittenInPlace


def _blank_layer(layer):
    """A copy of an unfilled cache layer: its fields are None, numbers, flags and dicts of them (the linear
    attention layers' per-state flags), so copying each field one level deep shares nothing."""
    blank = object.__new__(type(layer))
    blank.__dict__.update({k: copy.copy(v) for k, v in vars(layer).items()})
    return blank
