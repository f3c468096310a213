"""Sequences that decode together keep their keys/values in one buffer per attention layer.

A batched forward reads every sequence's cache as one tensor [batch, kv_heads, tokens, d] per attention layer.
Gathering the caches into a padded tensor each step copied every cached token of every sequence at every
step: at 8 requests in flight about a sixth of a small model's decode step on a CPU (over a thousand copies
a step). Here the sequences' caches *are* the rows of that tensor: each `SequenceCache.room` is a view
of its row, so a step with the same sequences as the last reads and writes in place.

When the batch changes, only what must move moves: a sequence that joins is copied into a free row (the
row of one that left), and one that sits past the batch's rows moves into such a row; the others stay where
they are, and the forward runs its sequences in row order. A whole new slab, every cache copied once, is
made only when the rows or their room run out (with `room_for`'s room, as `SequenceCache.reserve`).
Copying every cache at every join or leave cost ~12-24 ms on a 65 ms step at 8 requests; moving one costs
about 1 ms.

A sequence whose row is given to another, while it lives, first gets a copy of its cache of its own (the
cost model's calibration runs other caches between decode steps), so nothing a sequence holds is lost.
"""

from __future__ import annotations

import weakref

import torch

from bdcore.decode.sequence import SequenceCache, room_for


class BatchSlab:
    """The buffers of the sequences decoding together, one row per sequence."""

    def __init__(self):
        self._buffers: list[torch.Tensor] = []  # keys' then values' [rows, kv_heads, capacity, d] per layer
        self._members: list[weakref.ref | None] = []  # the cache in each row
        self.copies = 0  # caches copied in: rows moved, joins, and every cache of a new slab (tests read it)

    def seat(self, caches: list[SequenceCache], total: int) -> tuple[list[int], list[torch.Tensor]]:
        """Each cache's row (a permutation of 0..len(caches)-1) and the buffers (keys' then values' per
        attention layer) of those rows, with room for `total` tokens; every cache's `room` is a view of its
        row, its keys/values the first `length` tokens of it. Past a cache's tokens a row holds zeros or stale
        keys/values of finite values (never visible: the mask hides them, and a zero attention weight times a
        finite value is zero)."""
        n = len(caches)
        if not self._buffers or self._buffers[0].shape[0] < n or self._buffers[0].shape[2] < total:
            self._rebuild(caches, total)
        rows = [self._row_of(cache) for cache in caches]
        taken = {row for row in rows if row is not None and row < n}
        free = iter(sorted(set(range(n)) - taken))
        for i, (cache, row) in enumerate(zip(caches, rows)):
            if row is None or row >= n:
                rows[i] = next(free)
                self._move_in(cache, rows[i])
        return rows, [buffer[:n] for buffer in self._buffers]

    def _row_of(self, cache: SequenceCache) -> int | None:
        """The row whose view the cache's room is, or None."""
        if not cache.in_room():
            return None
        pointer = cache.room[0].data_ptr()
        for row, member in enumerate(self._members):
            if member is not None and member() is cache and self._buffers[0][row].data_ptr() == pointer:
                return row
        return None

    def _move_in(self, cache: SequenceCache, row: int) -> None:
        """Copy `cache` into `row` (from its own buffers or another row); the row's former sequence, if it
        lives and still holds the row, keeps a copy of its own first."""
        former = self._members[row]() if self._members[row] is not None else None
        if former is not None and former is not cache and self._row_of(former) == row:
            length = former.length
            former.room = [t[:, :length].clone() for t in (*former.keys, *former.values)]
            former.keep(length)
        length = cache.length
        cached = (*cache.keys, *cache.values)
        for buffer, t in zip(self._buffers, cached):
            buffer[row, :, :length] = t
        old = self._row_of(cache)
        if old is not None:
            self._members[old] = None
        cache.room = [buffer[row] for buffer in self._buffers]
        cache.keep(length)
        self._members[row] = weakref.ref(cache, self._member_gone)
        self.copies += 1

    def _member_gone(self, _ref) -> None:
        """Once every sequence of the slab is gone, so is the slab: an idle server (or a trainer between its
        rollouts) holds no batch's memory."""
        if all(member is None or member() is None for member in self._members):
            self._buffers, self._members = [], []

    def _rebuild(self, caches: list[SequenceCache], total: int) -> None:
        """A new slab of these caches' rows, `room_for(total)` tokens long, the caches copied in. Sequences of
        the old slab not among them keep its rows, which no one writes again."""
        capacity = room_for(total)
        self._buffers = [
            t.new_zeros(len(caches), t.shape[0], capacity, t.shape[2]) for t in (*caches[0].keys, *caches[0].values)
        ]
        self._members = [None] * len(caches)
        for row, cache in enumerate(caches):
            self._move_in(cache, row)


def offsets_index(lengths: list[int], rows: int, device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Where a batched forward writes its `rows` new rows per sequence: sequence b's at its own cache length
    (batch index, token index), each [batch, rows]; None where every cache has the same length (a slice does)."""
    if len(set(lengths)) == 1:
        return None
    batch = torch.arange(len(lengths), device=device)[:, None].expand(len(lengths), rows)
    tokens = torch.tensor(lengths, device=device)[:, None] + torch.arange(rows, device=device)[None]
    return batch, tokens
