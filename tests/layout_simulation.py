"""An independent simulation of self-spec's decoding process under one layout used at every step: what the
policy's cycle figures (bdcore/decode/policy/speculation.py, tree_policy.py) must agree with."""

from __future__ import annotations

import random

from bdcore.decode.layout import Layout
from bdcore.decode.tree import cut


def simulated_speed(layout: Layout, rates, cost, steps=20000, seed=0, stale_rates=None, alternatives=None) -> float:
    """Tokens per second of a layout used at every step, by simulation: at each depth the AR token is the
    draft (the argmax) with probability rates[j], cold steps when no canvas followed the accepted path;
    drafts from a canvas after a rejected draft are accepted with `stale_rates` (default: `rates`). Draft
    trees (tests/test_tree_policy.py): a rejected argmax's AR token is among the top w candidates with
    `alternatives[j][w - 1]` (None: never); a spine's side candidates are leaves; a path off the spine
    leaves no drafts."""
    rng = random.Random(seed)
    shape = cut(layout.tree, layout.drafts) if layout.tree is not None else None
    widths = shape.widths if shape is not None else (1,) * layout.drafts
    tokens = seconds = 0.0
    warm = stale = False
    for _ in range(steps):
        if layout.canvas == 0:
            tokens, seconds = tokens + 1, seconds + cost(1)
            continue
        if not warm:
            tokens, seconds, warm, stale = tokens + 1, seconds + cost(1 + layout.canvas), True, False
            continue
        now = stale_rates if stale and stale_rates is not None else rates
        k, on = 0, True
        while k < layout.drafts and not (shape is not None and shape.spine and not on):
            rank = 0 if rng.random() < now[k] else 4  # 4: not among the candidates
            if rank and alternatives is not None:
                u = rng.random()
                rank = next((w - 1 for w in (2, 3, 4) if u < alternatives[k][w - 1]), 4)
            if rank >= widths[k]:
                break
            k, on = k + 1, on and rank == 0
        tokens, seconds = tokens + k + 1, seconds + cost(layout.rows)
        warm, stale = on and k >= layout.first_canvas, k < layout.drafts
    return tokens / seconds
