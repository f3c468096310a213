"""Per-request and pooled estimates of how often self-spec's drafts are right (the policy's acceptance).

`AcceptanceEstimate`: P(draft j accepted | drafts 1..j-1 were), from observed verify steps and a prior.
`DraftAcceptance` keeps two of them, for fresh drafts and for stale ones (drafted after a rejected draft;
see `bdcore.decode.policy.speculation`), and the `AlternativeEstimate` of draft trees: when slot j's argmax draft
is rejected, how often the AR token is among the slot's next candidates. `prior_from_quality` turns a
checkpoint's drafting-metric figures (`draft_quality.json`) into a prior.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

DRAFT_QUALITY_NAME = "draft_quality.json"  # in a checkpoint: the trainer's last drafting-metric figures
WIDEST = 4  # candidates per slot an alternative estimate counts (bdcore.decode.tree.CANDIDATES)


@dataclass
class AcceptanceEstimate:
    """P(draft j accepted | drafts 1..j-1 were), j = 1.., from observed verify steps and a prior.

    `prior[j-1]` is the prior rate of draft j (the last value repeats for later drafts), worth `strength`
    observations; a rate estimate is (accepted + strength * prior) / (attempted + strength)."""

    prior: list[float]
    strength: float = 4.0
    attempted: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)

    def observe(self, verified: int, accepted: int) -> None:
        """A verify step of `verified` drafts accepted the first `accepted`: drafts 1..accepted+1 (at most
        `verified`) were tried, 1..accepted passed."""
        tried = min(accepted + 1, verified)
        if len(self.attempted) < tried:
            grow = tried - len(self.attempted)
            self.attempted += [0] * grow
            self.accepted += [0] * grow
        for j in range(tried):
            self.attempted[j] += 1
            self.accepted[j] += j < accepted

    def prior_rate(self, j: int) -> float:
        return self.prior[min(j, len(self.prior) - 1)] if self.prior else 0.5

    def rates(self, n: int, prior: list[float] | None = None) -> list[float]:
        """Draft j's estimate shrinks towards its own prior value where the prior gives one, and beyond the
        prior's end towards the estimate of draft j-1. A policy that drafts k tokens never observes draft
        k+1, so a fixed prior there (0.5 without a draft_quality.json) would keep it from ever drafting
        longer; given j-1 drafts accepted, draft j is at least about as likely as draft j-1 was, and
        drafting it once corrects the guess. `prior`: use these values instead of `self.prior`."""
        prior = self.prior if prior is None else prior
        out = []
        for j in range(n):
            tried = self.attempted[j] if j < len(self.attempted) else 0
            took = self.accepted[j] if j < len(self.accepted) else 0
            if j < len(prior):
                base = prior[j]
            else:
                base = out[j - 1] if j else 0.5
            out.append((took + self.strength * base) / (tried + self.strength))
        return out


@dataclass
class AlternativeEstimate:
    """Per slot j = 1..: of the verify steps that accepted drafts 1..j-1 and rejected slot j's argmax draft,
    the share whose AR token was among slot j's top w candidates, w = 1..WIDEST (w = 1: none, by
    definition). What a draft tree's side branches add: `bdcore.decode.policy.tree_policy`.

    Shrunk towards `prior` (per slot, a tuple indexed by w - 1; the last slot's repeats) with `strength`
    observations, and past the prior's end towards the slot before, as `AcceptanceEstimate`. Every verify
    that rejects a draft whose candidates were kept observes its slot, linear or tree, so trees can be judged
    before one is ever verified."""

    prior: list[tuple[float, ...]]
    strength: float = 4.0
    tried: list[int] = field(default_factory=list)
    within: list[list[int]] = field(default_factory=list)  # per slot, per w - 1: AR token of rank < w

    def observe(self, slot: int, rank: int) -> None:
        """Slot `slot` (1-based) rejected its argmax; the AR token's rank among its candidates (>= WIDEST:
        not among them)."""
        while len(self.tried) < slot:
            self.tried.append(0)
            self.within.append([0] * WIDEST)
        self.tried[slot - 1] += 1
        for w in range(1, WIDEST + 1):
            self.within[slot - 1][w - 1] += rank < w

    def rates(self, n: int) -> list[tuple[float, ...]]:
        out: list[tuple[float, ...]] = []
        for j in range(n):
            if j < len(self.prior):
                base = self.prior[j]
            else:
                base = out[j - 1] if j else self.prior[-1] if self.prior else (0.0,) * WIDEST
            tried = self.tried[j] if j < len(self.tried) else 0
            hits = self.within[j] if j < len(self.within) else [0] * WIDEST
            out.append(tuple((h + self.strength * b) / (tried + self.strength) for h, b in zip(hits, base)))
        return out

    def halve_above(self, cap: int) -> None:
        if self.tried and self.tried[0] > cap:
            self.tried = [k // 2 for k in self.tried]
            self.within = [[k // 2 for k in row] for row in self.within]


@dataclass(frozen=True)
class DraftRates:
    """Per-draft acceptance of fresh drafts and of stale ones (drafted after a rejected draft)."""

    fresh: list[float]
    stale: list[float]
    # Per slot, P(AR token among the top w candidates | the argmax was rejected), by w - 1 (AlternativeEstimate);
    # empty: nothing known, so no tree gains over its chain.
    alternatives: list[tuple[float, ...]] = field(default_factory=list)

    @classmethod
    def same(cls, rates: list[float]) -> DraftRates:
        return cls(list(rates), list(rates))


@dataclass
class DraftAcceptance:
    """A request's (or the engine's pooled) `AcceptanceEstimate`s of fresh and stale drafts. The stale
    estimate's prior, where it has none of its own, is the fresh estimate: until stale drafts are
    observed the two sources are assumed alike."""

    fresh: AcceptanceEstimate
    stale: AcceptanceEstimate
    alternatives: AlternativeEstimate = field(default_factory=lambda: AlternativeEstimate([]))

    @classmethod
    def from_prior(cls, prior: list[float], strength: float) -> DraftAcceptance:
        """The engine's pool. Alternatives start at none: a tree is chosen only once side candidates were
        seen to be right (linear verifies observe them too), never on a guess."""
        none = AlternativeEstimate([(0.0,) * WIDEST], strength)
        return cls(AcceptanceEstimate(list(prior), strength), AcceptanceEstimate([], strength), none)

    @classmethod
    def starting_from(cls, pooled: DraftAcceptance, n: int, strength: float) -> DraftAcceptance:
        """A new request's estimate: the pooled rates as its priors."""
        r = pooled.rates(n)
        alternatives = AlternativeEstimate(r.alternatives, strength)
        return cls(AcceptanceEstimate(r.fresh, strength), AcceptanceEstimate(r.stale, strength), alternatives)

    def observe(self, verified: int, accepted: int, stale: bool) -> None:
        (self.stale if stale else self.fresh).observe(verified, accepted)

    def rates(self, n: int) -> DraftRates:
        fresh = self.fresh.rates(n)
        return DraftRates(fresh, self.stale.rates(n, prior=self.stale.prior or fresh), self.alternatives.rates(n))

    def halve_above(self, cap: int) -> None:
        """Keep at most about `cap` observations of draft 1 per source, so the estimate follows drift."""
        for e in (self.fresh, self.stale):
            if e.attempted and e.attempted[0] > cap:
                e.attempted = [k // 2 for k in e.attempted]
                e.accepted = [k // 2 for k in e.accepted]
        self.alternatives.halve_above(cap)


def prior_from_quality(first_accept: float, mean_accepted: float, draft_len: int) -> list[float]:
    """Per-draft acceptance rates from two drafting-metric figures (`bdcore.decode.policy.draft_quality`): draft
    1 at `first_accept`, the later ones at the constant rate a with first_accept * (1 + a + ... + a^(N-2))
    = mean_accepted (solved by bisection), kept within [0.02, 0.98]."""
    a1 = min(max(first_accept, 0.02), 0.98)
    n = max(draft_len - 1, 1)

    def mean(a: float) -> float:
        return a1 * sum(a**i for i in range(n))

    lo, hi = 0.0, 0.98
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mean(mid) < mean_accepted else (lo, mid)
    return [a1, min(max(lo, 0.02), 0.98)]


def read_draft_prior(checkpoint: str | os.PathLike) -> list[float] | None:
    """The per-draft acceptance prior a checkpoint's `draft_quality.json` implies, if it has one."""
    path = Path(checkpoint) / DRAFT_QUALITY_NAME
    if not path.is_file():
        return None
    try:
        q = json.loads(path.read_text())
        return prior_from_quality(float(q["draft_first_accept"]), float(q["draft_mean_accepted"]), int(q["draft_len"]))
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: unreadable drafting figures ({e}); delete it or write it again") from e
