"""The self-spec policy's tuning constants, written once: how often it probes, what a batch's extra rows must
buy, how strongly its acceptance estimates hold their priors, how fast its cost and overhead follow live timings.

The calibration's shapes (rows, batch sizes, context) are the measurement itself, part of its cache key: they
stay in `cost.py`.
"""

from __future__ import annotations

# Probing: a policy that went causal never observes drafts again, so after PROBE_EVERY causal steps in a row
# (over the engine) it drafts and verifies once to re-measure acceptance. Where causal steps stay the faster, each
# probe it does not follow doubles the gap, up to MAX_PROBE_EVERY.
PROBE_EVERY = 32
MAX_PROBE_EVERY = 512
PROBE_STEPS = 2  # a probe: a step that drafts, then one that verifies those drafts

# In a batch, rows past the fewest any sequence needs must buy this much more speed than the fewest. At 4-8
# requests on a CPU the estimated tokens of a batch's drafting forwards ran ~6% above what they emitted, and
# requests that draft finish apart and so prefill apart (a prompt alone costs more than in a batch of prompts):
# without the margin `auto` chose drafting the model rated ~5-10% faster and ran 10-20% slower than causal.
BATCH_MARGIN = 0.1

# Acceptance: estimates shrink towards a prior worth this many observations.
DEFAULT_PRIOR = (0.5,)  # per-draft acceptance of a checkpoint without drafting figures (draft_quality.json)
POOL_STRENGTH = 8.0  # the engine's pooled estimate: the checkpoint's prior
REQUEST_STRENGTH = 4.0  # a new request's estimate: the pooled rates
POOL_CAP = 4096  # observations of draft 1 (per draft source) pooled before old ones are halved away (drift)

# Live timings: the weight of a new one in its moving average (a forward's cost by rows, a step's overhead), so
# one noisy timing moves the figure by this share of its error, not all of it.
LIVE_WEIGHT = 0.2
IDLE_FORWARDS = 4  # a gap outside the forward longer than this many one-row forwards is an idle wait, not overhead
