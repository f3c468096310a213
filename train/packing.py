"""Samples -> rows -> per-rank micro-batches, deterministically and resumably.

- Packing is first-fit with carry-over: a sample goes into the first open row with room; when no
  open row has room and the window of open rows is full, the fullest row is closed and a new one
  opened. Every sample lands in exactly one row: nothing is dropped.
- The row order of epoch e is a permutation seeded by (seed, e). Epochs are concatenated into one
  endless stream of rows; global micro-batch k is the next `world * micro_batch_size` rows and rank r
  takes its slice, so every rank takes the same number of micro-steps and the only state to resume
  is the count of rows consumed.
"""

from __future__ import annotations

import random
from collections.abc import Sequence


def pack_first_fit(lengths: Sequence[int], capacity: int, *, window: int = 64) -> list[list[int]]:
    """Group sample indices into rows of total length <= capacity (each length must be <= capacity)."""
    rows: list[list[int]] = []
    open_rows: list[tuple[int, list[int]]] = []  # (used, indices)
    for i, n in enumerate(lengths):
        if n > capacity:
            raise ValueError(f"sample {i} has {n} tokens, more than the row capacity {capacity}")
        for j, (used, idx) in enumerate(open_rows):
            if used + n <= capacity:
                idx.append(i)
                open_rows[j] = (used + n, idx)
                break
        else:
            if len(open_rows) >= window:
                fullest = max(range(len(open_rows)), key=lambda j: open_rows[j][0])
                rows.append(open_rows.pop(fullest)[1])
            open_rows.append((n, [i]))
    rows.extend(idx for _, idx in open_rows)
    return rows


def bucket_length(n: int, buckets: Sequence[int] | None, multiple: int = 64) -> int:
    """The padded length of a micro-batch whose longest row has n tokens."""
    if buckets:
        for b in sorted(buckets):
            if b >= n:
                return b
    return -(-n // multiple) * multiple


class RowStream:
    """An endless, reproducible stream of rows; `position` (global rows consumed) is the resume state."""

    def __init__(self, num_rows: int, *, seed: int, world_size: int, rank: int, micro_batch_size: int):
        if num_rows <= 0:
            raise ValueError("no rows to train on")
        self.num_rows = num_rows
        self.seed = seed
        self.world_size = world_size
        self.rank = rank
        self.mbs = micro_batch_size
        self.position = 0
        self._perm_cache: dict[int, list[int]] = {}

    def _perm(self, epoch: int) -> list[int]:
        if epoch not in self._perm_cache:
            order = list(range(self.num_rows))
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
            self._perm_cache = {epoch: order}
        return self._perm_cache[epoch]

    def row_at(self, p: int) -> int:
        return self._perm(p // self.num_rows)[p % self.num_rows]

    @property
    def epoch(self) -> float:
        return self.position / self.num_rows

    def next_micro_batch(self) -> list[int]:
        """Row ids of this rank's share of the next global micro-batch."""
        start = self.position + self.rank * self.mbs
        ids = [self.row_at(p) for p in range(start, start + self.mbs)]
        self.position += self.world_size * self.mbs
        return ids
