"""What a canvas's undecided slots hold when a decoder or the drafting metric builds one.

A checkpoint trained with `--canvas_fill mask` (the default) saw `<|mask|>` there; one trained with
`--canvas_fill noise` saw uniform random ids from [0, vocab_size), drawn anew for every slot (the draft
input of SGLang's UNO speculative decoding, docs/design.md 8.21). Noise is drawn from a generator of the
fill's own, seeded, so a decode or a metric run is the same every time it is repeated; self-spec output
never depends on it (drafts are verified), only how many drafts are accepted.
"""

from __future__ import annotations

import torch


class CanvasFill:
    """`fill(n)`: the ids of n undecided slots."""

    def __init__(self, mask_id: int, *, noise_vocab: int | None = None, seed: int = 0):
        if noise_vocab is not None and noise_vocab < 1:
            raise ValueError(f"noise_vocab {noise_vocab}: noise is drawn from [0, noise_vocab), give the vocab size")
        self.mask_id = mask_id
        self.noise_vocab = noise_vocab
        self._generator = torch.Generator().manual_seed(seed) if noise_vocab is not None else None

    @classmethod
    def for_checkpoint(cls, caps, *, seed: int = 0) -> CanvasFill:
        """The fill a checkpoint was trained with (`caps`: its `bdcore.capabilities.Capabilities`)."""
        if caps.canvas_fill == "mask":
            return cls(caps.mask_id)
        if caps.vocab_size is None:
            raise ValueError("a noise-filled checkpoint's canvases need the model's vocab_size: read its config")
        return cls(caps.mask_id, noise_vocab=caps.vocab_size, seed=seed)

    def __call__(self, n: int) -> list[int]:
        if self.noise_vocab is None:
            return [self.mask_id] * n
        return torch.randint(0, self.noise_vocab, (n,), generator=self._generator).tolist()
