"""Block noise (docs/design.md section 2): one rate per block, complementary views, reproducible draws.

Views come in complementary pairs: view 2p+1 masks each token of a block with the block's rate g,
view 2p+2 masks exactly the other tokens (effective rate 1 - g), so together they cover every
response token once. With an odd number of views the last one draws on its own (rate g).
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def noise_seed(seed: int, rank: int, step: int, micro_step: int = 0) -> int:
    """A well-mixed 63-bit seed: distinct for every (seed, rank, step, micro_step), the same on replay."""
    h = 0
    for part in (seed, rank, step, micro_step):
        h = _splitmix64(h ^ (part & _MASK64))
    return h & ((1 << 63) - 1)


def noise_generator(seed: int, rank: int, step: int, micro_step: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(noise_seed(seed, rank, step, micro_step))


def draw_masks(
    view: torch.Tensor,
    block: torch.Tensor,
    slot: torch.Tensor,
    *,
    num_views: int,
    num_blocks: int,
    num_slots: int,
    min_rate: float,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask flags and effective rates for noised tokens.

    view:  [N] view number (1..num_views) of each noised token
    block: [N] block id (0..num_blocks-1), shared by the token's copies in every view
    slot:  [N] slot id (0..num_slots-1): the same response token (or filler) in every view
    Returns (masked [N] bool, rate [N] float: the probability with which this token's view masks it).
    """
    num_draws = (num_views + 1) // 2
    u = torch.rand(num_draws, num_blocks, generator=generator, dtype=torch.float64)
    g = (1.0 - min_rate) * u + min_rate
    r = torch.rand(num_draws, num_slots, generator=generator, dtype=torch.float64)

    draw = (view - 1) // 2
    second_of_pair = (view - 1) % 2 == 1
    g_tok = g[draw, block]
    hit = r[draw, slot] < g_tok
    masked = torch.where(second_of_pair, ~hit, hit)
    rate = torch.where(second_of_pair, 1.0 - g_tok, g_tok)
    return masked, rate.float()
