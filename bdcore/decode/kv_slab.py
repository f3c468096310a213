"""Sequences that decode together keep their keys/values in one buffer per attention layer.

A batched forward reads every sequence's cache as one tensor [batch, kv_heads, tokens, d] per attention layer.
Gathering the caches into a padded tensor each step copied every cached token of every sequence at every
step: at 8 requests in flight about 10 ms of a 65 ms SmolLM2 step on a CPU (session 48: 1,300 copies and 550
fills a step). Here the sequences' caches *are* the rows of that tensor: each `SequenceCache.room` is a view
of its row, so a step with the same sequences as the last reads and writes in place, and only a change of
the batch (a request joins or leaves, or one outgrows the room) copies the caches, once, into a new slab.

A new slab is a new tensor, never an old one reused: a sequence left out of it keeps its row of the old slab
untouched (a forward of other caches in between, such as the cost model's calibration, cannot overwrite it).
"""

from __future__ import annotations

import weakref

import torch

from bdcore.decode.sequence import SequenceCache


class BatchSlab:
    """The buffers of the sequences of the last batched decode forward, in its batch order."""

    def __init__(self):
        self._members: list[weakref.ref] = []
        self._buffers: list[torch.Tensor] = []  # keys' then values' [batch, kv_heads, capacity, d] per layer

    def seat(self, caches: list[SequenceCache], total: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Buffers (keys', values') per attention layer holding the caches in rows 0.. in the order given, each
        with room for `total` tokens; every cache's `room` is a view of its row, its keys/values the first
        `length` tokens of it. Past a cache's tokens a row holds zeros or stale keys/values of finite values
        (never visible: the mask hides them, and a zero attention weight times a finite value is zero)."""
        buffers = self._buffers if self._holds(caches, total) else self._rebuild(caches, total)
        half = len(buffers) // 2
        return buffers[:half], buffers[half:]

    def _holds(self, caches: list[SequenceCache], total: int) -> bool:
        """Whether the current slab is these caches', in this order, with room for `total` tokens."""
        buffers = self._buffers
        if not buffers or buffers[0].shape[0] != len(caches) or buffers[0].shape[2] < total:
            return False
        # each cache's room a view of its row (a cache that left, or decoded alone past the room, has moved)
        return all(
            cache.in_room() and cache.room[0].data_ptr() == buffers[0][row].data_ptr()
            for row, cache in enumerate(caches)
        )

    def _rebuild(self, caches: list[SequenceCache], total: int) -> list[torch.Tensor]:
        """A new slab a quarter (at least 64 tokens) longer than asked, the caches copied in (the same growth
        rule as `SequenceCache.reserve`)."""
        capacity = total + max(total // 4, 64)
        buffers = []
        for which in ("keys", "values"):
            for layer in range(len(caches[0].keys)):
                like = getattr(caches[0], which)[layer]
                buffer = like.new_zeros(len(caches), like.shape[0], capacity, like.shape[2])
                for row, cache in enumerate(caches):
                    cached = getattr(cache, which)[layer]
                    buffer[row, :, : cached.shape[1]] = cached
                buffers.append(buffer)
        for row, cache in enumerate(caches):
            length = cache.length
            cache.room = [buffer[row] for buffer in buffers]
            cache.keep(length)
        self._buffers = buffers
        self._members = [weakref.ref(cache, self._member_gone) for cache in caches]
        return buffers

    def _member_gone(self, _ref) -> None:
        """Once every sequence of the slab is gone, so is the slab: an idle server holds no batch's memory."""
        if all(member() is None for member in self._members):
            self._buffers, self._members = [], []


def offsets_index(lengths: list[int], rows: int, device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Where a batched forward writes its `rows` new rows per sequence: sequence b's at its own cache length
    (batch index, token index), each [batch, rows]; None where every cache has the same length (a slice does)."""
    if len(set(lengths)) == 1:
        return None
    batch = torch.arange(len(lengths), device=device)[:, None].expand(len(lengths), rows)
    tokens = torch.tensor(lengths, device=device)[:, None] + torch.arange(rows, device=device)[None]
    return batch, tokens
