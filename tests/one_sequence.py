"""Hand-driven forwards of one sequence on the decode runner, for tests that build rows themselves."""

from __future__ import annotations

import torch

from bdcore.decode.rows import Forward, Rows
from bdcore.decode.runner import ModelRunner
from bdcore.decode.sequence import SequenceCache


class OneSequence:
    """A runner and one sequence's cache: `forward(rows, keep)` -> logits, `crop_to(length)`."""

    def __init__(self, model, *, banned: int | None = None, clean_causal: bool = True, within_block_causal=False):
        self.runner = ModelRunner(
            model, banned=banned, clean_causal=clean_causal, within_block_causal=within_block_causal
        )
        self.cache = SequenceCache()

    def forward(self, rows: Rows, keep: int, *, rollback: bool = False) -> torch.Tensor:
        return self.runner.forward([(self.cache, Forward(rows, keep, rollback))])[0]

    def crop_to(self, length: int) -> None:
        self.cache.crop(length)

    @property
    def length(self) -> int:
        return self.cache.length
