"""The engine's self-spec policy state: the forward cost, the acceptance pooled over every request, the probes.

The driver asks it to plan each forward's self-spec layouts (`plan`) and tells it what happened: the forward's
time (`timed`) and, after the decoders took their logits, what their verify steps accepted (`observe`). A new
request's decoder gets its own `RequestPolicy` from it (`attach`), started from the pooled acceptance.
"""

from __future__ import annotations

from bdcore.decode.config import AutoDraft
from bdcore.decode.policy.acceptance import DraftAcceptance
from bdcore.decode.policy.cost import ForwardCost
from bdcore.decode.policy.request import RequestPolicy
from bdcore.decode.policy.speculation import SpeculationPolicy
from bdcore.decode.policy.tuning import (
    DEFAULT_PRIOR,
    IDLE_FORWARDS,
    LIVE_WEIGHT,
    MAX_PROBE_EVERY,
    POOL_CAP,
    POOL_STRENGTH,
    PROBE_EVERY,
    PROBE_STEPS,
)


class Speculation:
    """The engine's self-spec policy state: the forward cost by rows and batch, the acceptance pooled over every
    request (each new request starts from it), and the layout choice.

    A decoder it plans for is any object with `seq` (its request), `layout` (set here) and `policy` (its
    `RequestPolicy`, set by `attach`): the self-spec decoder of `bdcore.decode.modes`, which this package does
    not import."""

    def __init__(self, cost: ForwardCost, *, prior: list[float] | None = None):
        self.cost = cost
        self.pooled = DraftAcceptance.from_prior(prior or DEFAULT_PRIOR, strength=POOL_STRENGTH)
        self.policy = SpeculationPolicy(cost)
        self.overhead = 0.0  # seconds a decode step spends outside its forward (moving average)
        self.causal_run = 0  # planned steps in a row in which no request drafted
        self.probe_steps = 0  # steps left of a probe (drafting forced)
        self.probe_every = PROBE_EVERY  # causal steps before the next probe (doubles while probes find nothing)
        self._probed = False  # a probe just ended: the next plan says whether it found drafting worth it

    def timed(self, rows: int, batch: int, seconds: float, gap: float | None) -> None:
        """A decode forward of `batch` sequences, the longest `rows` rows, took `seconds`; `gap`: the seconds
        since the last decode forward ended (None: there was none just before)."""
        self.cost.observe(rows, seconds, batch)
        if gap is not None:
            self.observe_overhead(gap)

    def observe_overhead(self, seconds: float) -> None:
        """Time a decode step spends outside its forward (taking logits, scheduling, a server's streaming):
        the same for any layout, so it favours fewer, fuller forwards. A gap longer than a few forwards is an
        idle wait, not overhead."""
        if 0 <= seconds <= IDLE_FORWARDS * self.cost(1):
            self.overhead += LIVE_WEIGHT * (seconds - self.overhead)

    def attach(self, decoder, auto: AutoDraft) -> None:
        """Leave `decoder`'s layouts to this policy, within `auto`."""
        decoder.policy = RequestPolicy(auto, greedy=decoder.seq.params.greedy, pooled=self.pooled)

    def plan(self, auto: list, fixed_rows: list[int]) -> None:
        """Set the layout of every attached self-spec decoder in `auto` for the coming forward, which also
        carries forwards of `fixed_rows` rows (the batch's other decoders)."""
        if not auto:
            return
        other_rows = max(fixed_rows, default=1)
        if self.causal_run >= self.probe_every:  # re-measure acceptance now and then, or causal is forever:
            self.probe_steps = PROBE_STEPS  # a step that drafts, then one that verifies those drafts
        probing = self.probe_steps > 0
        rates = [d.policy.rates() for d in auto]
        options = [d.policy.options_for(r, probing=probing) for d, r in zip(auto, rates)]
        self.probe_steps = max(self.probe_steps - 1, 0)
        self.policy.overhead = self.overhead
        for d, layout in zip(auto, self.policy.choose(rates, options, others=len(fixed_rows), other_rows=other_rows)):
            d.layout = layout
        # Counted over the engine, not per request: requests shorter than PROBE_EVERY steps would never probe.
        drafted = any(d.layout.canvas for d in auto)
        self.causal_run = 0 if drafted else self.causal_run + 1
        # A probe costs a drafting step and a verify step at the price of their rows, and where causal steps
        # are the faster (8 requests in flight on a CPU) it buys nothing: probe half as often after each probe
        # the policy does not follow, at the base rate again once it drafts of its own accord.
        if not probing and drafted:
            self.probe_every = PROBE_EVERY
        elif not probing and self._probed:
            self.probe_every = min(2 * self.probe_every, MAX_PROBE_EVERY)
        self._probed = probing and self.probe_steps == 0

    def observe(self, auto: list) -> None:
        """Pool what this step's verify steps of the attached decoders `auto` accepted."""
        for d in auto:
            verify, alternative = d.policy.observed()
            if verify is not None:
                self.pooled.observe(*verify)
                if alternative is not None:
                    self.pooled.alternatives.observe(*alternative)
        self.pooled.halve_above(POOL_CAP)
