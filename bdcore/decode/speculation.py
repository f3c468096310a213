"""How much self-spec drafts each step: a layout chosen from the measured forward cost and acceptance.

Self-spec is lossless for any sequence of layouts (every emitted token is the AR head's, greedy or by
rejection sampling), so the only thing a layout changes is speed. A step's layout (`Layout`) says how many
of the drafts in hand it verifies, how long the canvases that draft the next step are, and after which
clean rows they sit: after the last only (linear: a rejection leaves no drafts, so the next step is a cold
step), after every one (all canvases: whatever prefix is accepted, its drafts are ready), or after every
row from the `first_canvas`-th on (a rejection before it costs a cold step). `drafts = canvas = 0` is a
plain causal step.

`SpeculationPolicy.choose` picks, for every sequence of a forward at once, the layout that maximises the
expected tokens emitted per second of the whole forward: acceptance from `DraftAcceptance` (what the
request has observed, pulled towards the engine's pooled estimate and the checkpoint's prior), cost from
`bdcore.decode.cost.RowCost` (forward seconds by rows in the forward, batch padding included).

Drafts come from two sources with different acceptance. A canvas after the last clean row, or a cold
step's canvas after the pending token, drafts past a token the model believed in ("fresh"). A canvas after
row k < drafts, used when draft k+1 was rejected, drafts past the AR head's correction of that draft,
which it never saw and had implicitly guessed otherwise ("stale"): on the demo checkpoint the cycle
model rated all canvases 1.3x linear in tokens per forward with one acceptance for both, and the engine
measured 1.09x. The two are estimated apart, and a cycle is a two-state chain over them.
"""

from __future__ import annotations

import json
import os
from bisect import bisect_right
from dataclasses import dataclass, field
from pathlib import Path

CANVAS_CHOICES = ("last", "all", "auto")
DRAFT_QUALITY_NAME = "draft_quality.json"  # in a checkpoint: the trainer's last drafting-metric figures
PROBE_EVERY = 32  # causal steps before a request drafts again to re-measure its acceptance


@dataclass(frozen=True)
class AutoDraft:
    """What a self-spec request leaves to the policy: its longest draft and its canvas choice."""

    max_drafts: int  # N - 1
    canvases: str  # "last" | "all" | "auto"
    fixed_drafts: int | None  # None: the draft length is chosen too


@dataclass(frozen=True)
class Layout:
    """One self-spec step: verify `drafts` drafts (clean rows [pending, d1..d_drafts]), and draft the next
    step with canvases of `canvas` masks after the clean rows `first_canvas`..`drafts`.

    `seeded`: a drafting forward of its own instead, for a backend whose forwards are all causal or all
    bidirectional (SGLang): one canvas [pending, MASK x canvas] at the pending token's position, the pending
    token its visible slot 0 as a diffusion block's seed, drafts the `canvas` tokens after it; it verifies
    and emits nothing, and keeps nothing cached. No policy picks it."""

    drafts: int
    canvas: int
    first_canvas: int = 0
    seeded: bool = False

    @property
    def rows(self) -> int:
        if self.seeded:
            return 1 + self.canvas
        return 1 + self.drafts + (self.drafts + 1 - self.first_canvas) * self.canvas if self.canvas else 1 + self.drafts

    def canvas_rows(self) -> range:
        """The clean rows (0 = the pending token) a canvas follows."""
        return range(self.first_canvas, self.drafts + 1) if self.canvas else range(0)


def fixed_layout(draft_len: int, canvases: str) -> Layout:
    """Today's fixed settings: N - 1 drafts a step, canvases of N - 1 after the last row or after every row."""
    n = draft_len - 1
    return Layout(n, n, n if canvases == "last" else 0)


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


@dataclass(frozen=True)
class DraftRates:
    """Per-draft acceptance of fresh drafts and of stale ones (drafted after a rejected draft)."""

    fresh: list[float]
    stale: list[float]

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

    @classmethod
    def from_prior(cls, prior: list[float], strength: float) -> DraftAcceptance:
        return cls(AcceptanceEstimate(list(prior), strength), AcceptanceEstimate([], strength))

    @classmethod
    def starting_from(cls, pooled: DraftAcceptance, n: int, strength: float) -> DraftAcceptance:
        """A new request's estimate: the pooled rates as its priors."""
        r = pooled.rates(n)
        return cls(AcceptanceEstimate(r.fresh, strength), AcceptanceEstimate(r.stale, strength))

    def observe(self, verified: int, accepted: int, stale: bool) -> None:
        (self.stale if stale else self.fresh).observe(verified, accepted)

    def rates(self, n: int) -> DraftRates:
        fresh = self.fresh.rates(n)
        return DraftRates(fresh, self.stale.rates(n, prior=self.stale.prior or fresh))

    def halve_above(self, cap: int) -> None:
        """Keep at most about `cap` observations of draft 1 per source, so the estimate follows drift."""
        for e in (self.fresh, self.stale):
            if e.attempted and e.attempted[0] > cap:
                e.attempted = [k // 2 for k in e.attempted]
                e.accepted = [k // 2 for k in e.accepted]


def prior_from_quality(first_accept: float, mean_accepted: float, draft_len: int) -> list[float]:
    """Per-draft acceptance rates from two drafting-metric figures (`bdcore.decode.draft_quality`): draft
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


@dataclass(frozen=True)
class Cycle:
    """A layout used step after step: tokens emitted and forwards taken per verify step (a rejection
    before the first canvas adds a cold step), and the rows of each forward."""

    tokens: float
    forwards: float
    verify_rows: int
    cold_rows: int  # a cold step's forward: [pending] + one canvas
    p_cold: float  # chance a verify step leaves no drafts

    @property
    def tokens_per_forward(self) -> float:
        return self.tokens / self.forwards


@dataclass(frozen=True)
class _Chain:
    """A_j = a_1 ... a_j (A_0 = 1) of one draft source, and the sums A_0 + ... + A_j."""

    acc: list[float]
    sums: list[float]

    @classmethod
    def of(cls, rates: list[float]) -> _Chain:
        acc, sums = [1.0], [1.0]
        for a in rates:
            acc.append(acc[-1] * a)
            sums.append(sums[-1] + acc[-1])
        return cls(acc, sums)


def cycle(layout: Layout, rates: DraftRates | list[float]) -> Cycle:
    """Expected tokens and forwards of one verify step of `layout` used step after step. Its drafts are
    fresh or stale (`DraftRates`); a step whose rejection falls before `first_canvas` adds a cold step
    (one token, fresh drafts), one that ends with every draft accepted drafts fresh ones, any other drafts
    stale ones. The chance of each source is the chain's stationary one."""
    return _cycle(layout, *_chains(rates))


def _chains(rates: DraftRates | list[float]) -> tuple[_Chain, _Chain]:
    if isinstance(rates, list):
        rates = DraftRates.same(rates)
    return _Chain.of(rates.fresh), _Chain.of(rates.stale)


def _cycle(layout: Layout, fresh: _Chain, stale: _Chain) -> Cycle:
    if layout.canvas == 0:
        return Cycle(1.0, 1.0, layout.rows, 1, 0.0)
    tokens, p_cold = _tokens_and_cold(layout.drafts, layout.first_canvas, fresh, stale)
    return Cycle(tokens + p_cold, 1.0 + p_cold, layout.rows, 1 + layout.canvas, p_cold)


def _tokens_and_cold(n: int, m: int, fresh: _Chain, stale: _Chain) -> tuple[float, float]:
    """A verify step of n > 0 drafts with canvases from clean row m on: its expected tokens and chance of a
    cold step after it, at the chain's stationary mix of fresh and stale drafts. From one source, a step
    emits 1 + A_1 + ... + A_n tokens, is followed by a cold step when a draft before m is rejected
    (1 - A_m) and drafts stale ones when one at or after m is (A_m - A_n). No objects: the batch policy
    evaluates every option of every sequence a step."""
    fa, sa = fresh.acc, stale.acc
    to_stale_f, to_stale_s = fa[m] - fa[n], sa[m] - sa[n]
    denominator = 1.0 - to_stale_s + to_stale_f
    p = to_stale_f / denominator if denominator > 0 else 0.0  # stationary P(drafts in hand are stale)
    return (1 - p) * fresh.sums[n] + p * stale.sums[n], (1 - p) * (1.0 - fa[m]) + p * (1.0 - sa[m])


def layouts(max_drafts: int, canvases: str, fixed: int | None) -> list[Layout]:
    """The layouts a policy may pick: `fixed` drafts (None: 0 = causal .. max_drafts) and canvases after
    the last row, after every row, or ("auto") after every row from any first one on."""
    counts = [fixed] if fixed is not None else range(max_drafts + 1)
    out = []
    for n in counts:
        if n == 0:
            out.append(Layout(0, 0, 0))
            continue
        firsts = {"last": [n], "all": [0], "auto": range(n + 1)}[canvases]
        out += [Layout(n, n, m) for m in firsts]
    return out


class SpeculationPolicy:
    """Chooses every self-spec sequence's layout for the next forward of a batch (see the module doc).

    Alone in its forward, a sequence takes the layout whose cycle emits the most tokens per second:
    cycle tokens / (cost(verify rows) + p_cold * cost(cold rows)). In a batch every sequence's rows are
    padded to the longest, so the forward costs cost(batch * longest): for each candidate longest row
    count Q, each sequence takes its best tokens per forward within Q rows, and the Q with the most tokens
    per second for the batch wins."""

    def __init__(self, cost, overhead: float = 0.0):
        self.cost = cost
        self.overhead = overhead  # seconds a step spends outside its forward (the driver measures it)
        self._rankings: dict[int, tuple[list[Layout], list]] = {}  # id(options) -> (options, ranked)

    def choose(
        self, rates: list[DraftRates | list[float]], options: list[list[Layout]], others: int = 0, other_rows: int = 1
    ) -> list[Layout]:
        """Layouts for sequences with per-draft acceptance `rates[i]` (a plain list: fresh and stale drafts
        alike) choosing among `options[i]`, sharing
        the forward with `others` sequences whose rows are fixed (the longest has `other_rows`), each of
        which emits one token a forward as far as this choice can tell."""
        if len(rates) == 1 and others == 0:
            chains = _chains(rates[0])

            def speed(o: Layout) -> float:
                c = _cycle(o, *chains)
                seconds = self.cost(c.verify_rows) + c.p_cold * self.cost(c.cold_rows) + c.forwards * self.overhead
                return c.tokens / seconds

            return [max(options[0], key=speed)]
        fits = [_BestWithin(self._ranked(opts), _chains(r)) for r, opts in zip(rates, options)]
        floor = other_rows if others else 1
        # A cap between two rows at which some sequence's best changes picks what the lower one picks
        caps = sorted({rows for f in fits for rows in f.changes if rows >= floor} | {floor})
        batch = len(rates) + others
        best, best_speed = None, -1.0
        for cap in caps:  # each sequence's best within `cap` rows is a table lookup: this runs every step
            picks = [f.within(cap) for f in fits]
            tokens = sum(tpf for _, tpf, _ in picks) + others
            speed = tokens / (self.cost(batch * max([floor] + [rows for _, _, rows in picks])) + self.overhead)
            if speed > best_speed:
                best, best_speed = picks, speed
        return [layout for layout, _, _ in best]

    def _ranked(self, options: list[Layout]) -> list[tuple[int, int, int, int, Layout]]:
        """`options` as (rows, index, drafts, first canvas, layout) sorted by rows then index, kept while the
        list lives: a decoder's options are one list for its whole request."""
        hit = self._rankings.get(id(options))
        if hit is not None and hit[0] is options:
            return hit[1]
        if len(self._rankings) > 256:
            self._rankings.clear()
        ranked = sorted((o.rows, i, o.drafts if o.canvas else 0, o.first_canvas, o) for i, o in enumerate(options))
        self._rankings[id(options)] = (options, ranked)
        return ranked


class _BestWithin:
    """One sequence's options sorted by rows, with the layout of most tokens per forward among those of at
    most each row count (ties: the earlier option), so `within(cap)` is a bisection."""

    def __init__(self, ranked: list[tuple[int, int, int, int, Layout]], chains: tuple[_Chain, _Chain]):
        fresh, stale = chains
        self.rows = [rows for rows, _, _, _, _ in ranked]
        self.best: list[tuple[Layout, float, int]] = []
        self.changes: list[int] = []  # the row counts at which the best changes
        top_tpf, top_i, top = -1.0, 0, None
        for rows, i, n, m, o in ranked:
            if n:
                tokens, p_cold = _tokens_and_cold(n, m, fresh, stale)
                tpf = (tokens + p_cold) / (1.0 + p_cold)
            else:
                tpf = 1.0
            if tpf > top_tpf or (tpf == top_tpf and i < top_i):
                top_tpf, top_i, top = tpf, i, (o, tpf, rows)
                self.changes.append(rows)
            self.best.append(top)

    def within(self, cap: int) -> tuple[Layout, float, int]:
        """(layout, tokens per forward, rows) of the best option of at most `cap` rows."""
        k = bisect_right(self.rows, cap)
        return self.best[max(k - 1, 0)]  # none fits: the first of the fewest rows
