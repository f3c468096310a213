"""One self-spec request's policy state: the one object a decoder whose layouts the policy picks holds.

The decoder runs the layout it is given and reports each verify here (`verified`); the engine's `Speculation`
reads the request's acceptance and options to plan a step and pools what the request observed after it.
"""

from __future__ import annotations

from bdcore.decode.config import AUTO, AutoDraft
from bdcore.decode.layout import Layout
from bdcore.decode.policy.acceptance import DraftAcceptance, DraftRates
from bdcore.decode.policy.speculation import layouts
from bdcore.decode.policy.tuning import REQUEST_STRENGTH


class RequestPolicy:
    """What a request left to the policy, the layouts it may take, its acceptance estimate (started from the
    engine's pooled one) and what its last verify observed, until the engine pools it."""

    def __init__(self, auto: AutoDraft, *, greedy: bool, pooled: DraftAcceptance):
        self.auto = auto
        trees = auto.trees if greedy else "off"  # sampled requests verify chains (rejection sampling)
        self.options: list[Layout] = layouts(auto.max_drafts, auto.canvases, auto.fixed_drafts, trees)
        # the policy rates trees from each drafted slot's top candidates, so the decoder keeps them
        self.keeps_candidates = any(o.tree is not None for o in self.options)
        self.chains = [o for o in self.options if o.tree is None]  # one list a request (the policy caches by it)
        self.estimate = DraftAcceptance.starting_from(pooled, auto.max_drafts, strength=REQUEST_STRENGTH)
        self._verify: tuple[int, int, bool] | None = None  # (drafts verified, accepted, were they stale)
        self._alternative: tuple[int, int] | None = None  # (slot whose argmax was rejected, AR token's rank)

    def rates(self) -> DraftRates:
        return self.estimate.rates(self.auto.max_drafts)

    def options_for(self, rates: DraftRates, *, probing: bool) -> list[Layout]:
        """The layouts this request may take in the coming step, given its `rates`."""
        opts = self.options
        if self.keeps_candidates and self.auto.trees == AUTO and not any(any(slot) for slot in rates.alternatives):
            opts = self.chains  # no side candidate seen right yet: a tree cannot rate above its chain
        if probing:  # a probe drafts (a causal step would re-measure nothing)
            opts = [o for o in opts if o.drafts > 0] or opts
        return opts

    def verified(self, verified: int, accepted: int, stale: bool, alternative: tuple[int, int] | None) -> None:
        """A verify step's argmax chain accepted `accepted` of `verified` drafts (`stale`: drafted after a
        rejection); `alternative`: where it stopped short, the rejected slot and the AR token's rank among its
        candidates."""
        self.estimate.observe(verified, accepted, stale)
        self._verify, self._alternative = (verified, accepted, stale), alternative
        if alternative is not None:
            self.estimate.alternatives.observe(*alternative)

    def observed(self) -> tuple[tuple[int, int, bool] | None, tuple[int, int] | None]:
        """What this step's verify observed (None: no verify), handed over once: the engine pools it after the
        step, so the next step starts with nothing observed."""
        got = self._verify, self._alternative
        self._verify = self._alternative = None
        return got
