"""How much self-spec drafts each step: a layout chosen from the measured forward cost and acceptance.

Self-spec is lossless for any sequence of layouts (every emitted token is the AR head's, greedy or by
rejection sampling), so the only thing a layout changes is speed. A step's layout (`bdcore.decode.layout`)
says how many of the drafts in hand it verifies, how long the canvases that draft the next step are, and
after which clean rows they sit: after the last only (linear: a rejection leaves no drafts, so the next step
is a cold step), after every one (all canvases: whatever prefix is accepted, its drafts are ready), or after
every row from the `first_canvas`-th on (a rejection before it costs a cold step). `drafts = canvas = 0` is
a plain causal step.

`SpeculationPolicy.choose` picks, for every sequence of a forward at once, the layout that maximises the
expected tokens emitted per second of the whole forward: acceptance from `DraftAcceptance` (what the
request has observed, pulled towards the engine's pooled estimate and the checkpoint's prior), cost from
`bdcore.decode.policy.cost.ForwardCost` (forward seconds by the longest row list and the sequences in it).

Drafts come from two sources with different acceptance. A canvas after the last clean row, or a cold
step's canvas after the pending token, drafts past a token the model believed in ("fresh"). A canvas after
row k < drafts, used when draft k+1 was rejected, drafts past the AR head's correction of that draft,
which it never saw and had implicitly guessed otherwise ("stale"): on the demo checkpoint the cycle
model rated all canvases 1.3x linear in tokens per forward with one acceptance for both, and the engine
measured 1.09x. The two are estimated apart (`bdcore.decode.policy.acceptance`), and a cycle is a two-state chain
over them.

A layout may also verify a draft tree (`Layout.tree`, `bdcore.decode.tree`): several candidates per
position in one forward, for greedy requests. Its figures come from `bdcore.decode.policy.tree_policy`, and it is
one more option beside the layouts above: chosen only where the same rule rates it faster than each of them.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field

from bdcore.decode.layout import Layout
from bdcore.decode.policy.acceptance import DraftRates
from bdcore.decode.policy.tree_policy import TreeWalk, tree_shapes, tree_walk
from bdcore.decode.policy.tuning import BATCH_MARGIN
from bdcore.decode.tree import TreeShape


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
    """A_j = a_1 ... a_j (A_0 = 1) of one draft source, and the sums A_0 + ... + A_j; the rates themselves
    and the side candidates' (`DraftRates.alternatives`), for trees."""

    acc: list[float]
    sums: list[float]
    rates: list[float]
    alternatives: list[tuple[float, ...]]
    walks: dict = field(default_factory=dict, compare=False)  # tree shape -> TreeWalk, made when first asked

    def walk(self, shape: TreeShape) -> TreeWalk:
        """The walk of `shape` over every depth of these rates; shapes that differ only in chain depths at
        their end (one family shape cut to several depths) share it."""
        widths = shape.widths
        while widths and widths[-1] == 1:
            widths = widths[:-1]
        key = (widths, shape.spine)
        if key not in self.walks:
            self.walks[key] = tree_walk(widths, shape.spine, self.rates, self.alternatives)
        return self.walks[key]

    @classmethod
    def of(cls, rates: list[float], alternatives: list[tuple[float, ...]] = ()) -> _Chain:
        acc, sums = [1.0], [1.0]
        for a in rates:
            acc.append(acc[-1] * a)
            sums.append(sums[-1] + acc[-1])
        return cls(acc, sums, list(rates), list(alternatives))


def cycle(layout: Layout, rates: DraftRates | list[float]) -> Cycle:
    """Expected tokens and forwards of one verify step of `layout` used step after step. Its drafts are
    fresh or stale (`DraftRates`); a step whose rejection falls before `first_canvas` adds a cold step
    (one token, fresh drafts), one that ends with every draft accepted drafts fresh ones, any other drafts
    stale ones. The chance of each source is the chain's stationary one."""
    return _cycle(layout, *_chains(rates))


def _chains(rates: DraftRates | list[float]) -> tuple[_Chain, _Chain]:
    if isinstance(rates, list):
        rates = DraftRates.same(rates)
    return _Chain.of(rates.fresh, rates.alternatives), _Chain.of(rates.stale, rates.alternatives)


def _cycle(layout: Layout, fresh: _Chain, stale: _Chain) -> Cycle:
    if layout.canvas == 0:
        return Cycle(1.0, 1.0, layout.rows, 1, 0.0)
    tokens, p_cold = _tokens_and_cold(layout, fresh, stale)
    return Cycle(tokens + p_cold, 1.0 + p_cold, layout.rows, 1 + layout.canvas, p_cold)


def _outcome(layout: Layout, source: _Chain) -> tuple[float, float, float]:
    """A verify step of `layout` with drafts of one source: (expected tokens, P(cold step next), P(stale drafts
    next)). A chain of n drafts with canvases from clean row m on emits 1 + A_1 + ... + A_n tokens, is
    followed by a cold step when a draft before m is rejected (1 - A_m) and drafts stale ones when one at or
    after m is (A_m - A_n). No objects: the batch policy evaluates every option of every sequence a step."""
    n, m = layout.drafts, layout.first_canvas
    if layout.tree is not None:
        return source.walk(layout.tree).outcome(n, m)
    acc = source.acc
    return source.sums[n], 1.0 - acc[m], acc[m] - acc[n]


def _tokens_and_cold(layout: Layout, fresh: _Chain, stale: _Chain) -> tuple[float, float]:
    """A verify step of n > 0 drafts: its expected tokens and chance of a cold step after it, at the chain's
    stationary mix of fresh and stale drafts (a step's next drafts are stale with the chances `_outcome`
    gives, fresh otherwise, a cold step's included)."""
    tokens_f, cold_f, to_stale_f = _outcome(layout, fresh)
    tokens_s, cold_s, to_stale_s = _outcome(layout, stale)
    denominator = 1.0 - to_stale_s + to_stale_f
    p = to_stale_f / denominator if denominator > 0 else 0.0  # stationary P(drafts in hand are stale)
    return (1 - p) * tokens_f + p * tokens_s, (1 - p) * cold_f + p * cold_s


def layouts(max_drafts: int, canvases: str, fixed: int | None, trees: str | TreeShape = "off") -> list[Layout]:
    """The layouts a policy may pick: `fixed` drafts (None: 0 = causal .. max_drafts) and canvases after
    the last row, after every row, or ("auto") after every row from any first one on. `trees` (greedy
    requests): "auto" adds the draft trees of `tree.SHAPES` with canvases after the last spine row
    or every one; a shape replaces every chain by that tree, with the chains' canvases."""
    counts = [fixed] if fixed is not None else range(max_drafts + 1)
    out = []
    for n in counts:
        if n == 0:
            out.append(Layout(0, 0, 0))
            continue
        firsts = {"last": [n], "all": [0], "auto": range(n + 1)}[canvases]
        shapes = tree_shapes(n, trees)
        if trees in ("off", "auto") or not shapes:
            out += [Layout(n, n, m) for m in firsts]
        tree_firsts = [m for m in firsts if m in (0, n)] if trees == "auto" else firsts
        out += [Layout(n, n, m, tree=shape) for shape in shapes for m in tree_firsts]
    return out


class SpeculationPolicy:
    """Chooses every self-spec sequence's layout for the next forward of a batch (see the module doc).

    Alone in its forward, a sequence takes the layout whose cycle emits the most tokens per second:
    cycle tokens / (cost(verify rows) + p_cold * cost(cold rows)). In a batch every sequence's rows are
    padded to the longest, so the forward costs cost(longest, batch): for each candidate longest row
    count Q, each sequence takes its best tokens per forward within Q rows, and the Q with the most tokens
    per second for the batch wins."""

    def __init__(self, cost, overhead: float = 0.0):
        self.cost = cost
        self.overhead = overhead  # seconds a step spends outside its forward (the driver measures it)
        self._rankings: dict[int, tuple[list[Layout], list]] = {}  # id(options) -> (options, ranked)
        self._memos: dict[tuple, tuple] = {}  # (what, id(options)) -> (options, rates, value): `_memo`

    def choose(
        self, rates: list[DraftRates | list[float]], options: list[list[Layout]], others: int = 0, other_rows: int = 1
    ) -> list[Layout]:
        """Layouts for sequences with per-draft acceptance `rates[i]` (a plain list: fresh and stale drafts
        alike) choosing among `options[i]`, sharing
        the forward with `others` sequences whose rows are fixed (the longest has `other_rows`), each of
        which emits one token a forward as far as this choice can tell."""
        if len(rates) == 1 and others == 0:
            cycles = self._memo(
                ("cycles", id(options[0])), options[0], rates[0], lambda o, c: [_cycle(x, *c) for x in o]
            )

            def speed(c: Cycle) -> float:
                seconds = self.cost(c.verify_rows) + c.p_cold * self.cost(c.cold_rows) + c.forwards * self.overhead
                return c.tokens / seconds

            return [options[0][max(range(len(cycles)), key=lambda i: speed(cycles[i]))]]
        fits = [
            self._memo(("fit", id(opts)), opts, r, lambda o, c: _BestWithin(self._ranked(o), c))
            for r, opts in zip(rates, options)
        ]
        floor = other_rows if others else 1
        # A cap between two rows at which some sequence's best changes picks what the lower one picks
        caps = sorted({rows for f in fits for rows in f.changes if rows >= floor} | {floor})
        batch = len(rates) + others
        best, best_speed = None, -1.0
        for i, cap in enumerate(caps):  # each sequence's best within `cap` rows is a table lookup: runs every step
            picks = [f.within(cap) for f in fits]
            tokens = sum(tpf for _, tpf, _ in picks) + others
            speed = tokens / (self.cost(max([floor] + [rows for _, _, rows in picks]), batch) + self.overhead)
            if i:  # rows past the fewest must pay by a margin (BATCH_MARGIN)
                speed /= 1 + BATCH_MARGIN
            if speed > best_speed:
                best, best_speed = picks, speed
        return [layout for layout, _, _ in best]

    def _memo(self, key: tuple, options: list[Layout], rates: DraftRates | list[float], make):
        """`make(options, chains)` for these options and rates, kept while both stay the same: a request's
        rates change only when one of its verify steps is observed, and evaluating every layout of every
        sequence again each step was about 5% of a batched decode step on a CPU."""
        if isinstance(rates, list):
            rates = DraftRates.same(rates)
        stamp = (tuple(rates.fresh), tuple(rates.stale), tuple(map(tuple, rates.alternatives)))
        hit = self._memos.get(key)
        if hit is not None and hit[0] is options and hit[1] == stamp:
            return hit[2]
        if len(self._memos) > 1024:
            self._memos.clear()
        value = make(options, _chains(rates))
        self._memos[key] = (options, stamp, value)
        return value

    def _ranked(self, options: list[Layout]) -> list[tuple[int, int, int, Layout]]:
        """`options` as (rows, index, drafts, layout) sorted by rows then index, kept while the
        list lives: a decoder's options are one list for its whole request."""
        hit = self._rankings.get(id(options))
        if hit is not None and hit[0] is options:
            return hit[1]
        if len(self._rankings) > 256:
            self._rankings.clear()
        ranked = sorted((o.rows, i, o.drafts if o.canvas else 0, o) for i, o in enumerate(options))
        self._rankings[id(options)] = (options, ranked)
        return ranked


class _BestWithin:
    """One sequence's options sorted by rows, with the layout of most tokens per forward among those of at
    most each row count (ties: the earlier option), so `within(cap)` is a bisection."""

    def __init__(self, ranked: list[tuple[int, int, int, Layout]], chains: tuple[_Chain, _Chain]):
        fresh, stale = chains
        self.rows = [rows for rows, _, _, _ in ranked]
        self.best: list[tuple[Layout, float, int]] = []
        self.changes: list[int] = []  # the row counts at which the best changes
        top_tpf, top_i, top = -1.0, 0, None
        for rows, i, n, o in ranked:
            if n:
                tokens, p_cold = _tokens_and_cold(o, fresh, stale)
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
