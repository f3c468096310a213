"""Tiny random models and samples for tests: the models and checkpoints come from benchmark/tiny.py."""

from __future__ import annotations

import random

from benchmark.tiny import (  # noqa: F401 (re-exported for the tests)
    EOT_ID,
    FILLER_ID,
    MASK_ID,
    VOCAB,
    tiny_checkpoint,
    tiny_config,
    tiny_hybrid_config,
    tiny_hybrid_model,
    tiny_model,
)
from train.rows import Sample


def random_sample(rng: random.Random, *, turns: int = 1, max_prompt: int = 9, max_resp: int = 13) -> Sample:
    """Prompt / response turns of random ids; every response ends with the end-of-turn token."""
    ids: list[int] = []
    spans = []
    for _ in range(turns):
        ids += [rng.randrange(0, 90) for _ in range(rng.randint(1, max_prompt))]
        start = len(ids)
        ids += [rng.randrange(0, 90) for _ in range(rng.randint(0, max_resp - 1))] + [EOT_ID]
        spans.append((start, len(ids)))
    return Sample(ids, spans)
