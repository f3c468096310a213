"""The decode loop over decoders that share a runner: admit, forward, take, retire.

`DecodeLoop` is the one loop every caller drives decoders with: the engine (one request), the batched
scheduler, the trainer's rollouts and self-distillation. It admits decoders up to a batch size, runs one
`DecodeDriver.step` over them and retires the finished (or failed) ones. A step is the decoders' next
forwards as one runner call (`DecodeDriver.forward`), then each decoder takes its logits.

Where a `Speculation` is attached (self-spec with `--draft-len auto` or `--self-spec-canvases auto`), the
forward first sets every such decoder's layout from the measured cost and acceptance, then feeds the
forward's wall time back to the cost model (forwards without a prompt in them: a prompt's forward is not
a decode step); after the take, the step pools what the verify steps accepted.
"""

from __future__ import annotations

import threading
import time
from typing import Generic, TypeVar

import torch

from bdcore.decode.config import AUTO, AutoDraft
from bdcore.decode.layout import Layout
from bdcore.decode.modes import Decoder, SelfSpecDecoder
from bdcore.decode.policy.acceptance import DraftAcceptance
from bdcore.decode.policy.cost import ForwardCost
from bdcore.decode.policy.speculation import SpeculationPolicy, layouts
from bdcore.decode.policy.tuning import (
    DEFAULT_PRIOR,
    IDLE_FORWARDS,
    LIVE_WEIGHT,
    MAX_PROBE_EVERY,
    POOL_CAP,
    POOL_STRENGTH,
    PROBE_EVERY,
    PROBE_STEPS,
    REQUEST_STRENGTH,
)


class Speculation:
    """The engine's self-spec policy state: the forward cost by rows and batch, the acceptance pooled over every
    request (each new request starts from it), and the layout choice."""

    def __init__(self, cost: ForwardCost, *, prior: list[float] | None = None):
        self.cost = cost
        self.pooled = DraftAcceptance.from_prior(prior or DEFAULT_PRIOR, strength=POOL_STRENGTH)
        self.policy = SpeculationPolicy(cost)
        self.overhead = 0.0  # seconds a decode step spends outside its forward (moving average)
        self.causal_run = 0  # planned steps in a row in which no request drafted
        self.probe_steps = 0  # steps left of a probe (drafting forced)
        self.probe_every = PROBE_EVERY  # causal steps before the next probe (doubles while probes find nothing)
        self._probed = False  # a probe just ended: the next plan says whether it found drafting worth it

    def observe_overhead(self, seconds: float) -> None:
        """Time a decode step spends outside its forward (taking logits, scheduling, a server's streaming):
        the same for any layout, so it favours fewer, fuller forwards. A gap longer than a few forwards is an
        idle wait, not overhead."""
        if 0 <= seconds <= IDLE_FORWARDS * self.cost(1):
            self.overhead += LIVE_WEIGHT * (seconds - self.overhead)

    def attach(self, decoder: SelfSpecDecoder, auto: AutoDraft) -> None:
        """Leave `decoder`'s layouts to this policy, within `auto`."""
        decoder.auto = auto
        trees = auto.trees if decoder.seq.params.greedy else "off"  # sampled requests verify chains
        decoder.options = layouts(auto.max_drafts, auto.canvases, auto.fixed_drafts, trees)
        decoder.keep_candidates = any(o.tree is not None for o in decoder.options)
        decoder.chains = [o for o in decoder.options if o.tree is None]  # one list a request (the policy caches)
        decoder.estimate = DraftAcceptance.starting_from(self.pooled, auto.max_drafts, strength=REQUEST_STRENGTH)

    def plan(self, auto: list[SelfSpecDecoder], fixed_rows: list[int]) -> None:
        """Set the layout of every attached self-spec decoder in `auto` for the coming forward, which also
        carries forwards of `fixed_rows` rows (the batch's other decoders)."""
        if not auto:
            return
        other_rows = max(fixed_rows, default=1)
        if self.causal_run >= self.probe_every:  # re-measure acceptance now and then, or causal is forever:
            self.probe_steps = PROBE_STEPS  # a step that drafts, then one that verifies those drafts
        probing = self.probe_steps > 0
        options = []
        rates = [d.estimate.rates(d.auto.max_drafts) for d in auto]
        for d, r in zip(auto, rates):
            opts = d.options
            if d.keep_candidates and d.auto.trees == AUTO and not any(any(slot) for slot in r.alternatives):
                opts = d.chains  # no side candidate seen right yet: a tree cannot rate above its chain
            if self.probe_steps > 0:
                opts = [o for o in opts if o.drafts > 0] or opts
            options.append(opts)
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

    def observe(self, decoders: list[Decoder]) -> None:
        """Pool what this forward's verify steps accepted."""
        for d in decoders:
            if _auto(d) and d.last_verify is not None:
                self.pooled.observe(*d.last_verify)
                if d.last_alternative is not None:
                    self.pooled.alternatives.observe(*d.last_alternative)
        self.pooled.halve_above(POOL_CAP)


def _auto(d: Decoder) -> bool:
    return isinstance(d, SelfSpecDecoder) and d.auto is not None


class DecodeDriver:
    def __init__(self, runner, speculation: Speculation | None = None):
        self.runner, self.speculation = runner, speculation
        self.lock = threading.Lock()  # one forward at a time on the runner (a calibration takes it too)
        # Called after every forward with (rows: batch x longest row list, seconds, decoding: no prompt in it),
        # e.g. the server's /metrics histograms.
        self.observers: list = []
        self._last_decode_end: float | None = None  # when the last decode forward (no prompt in it) ended

    def forward(self, decoders: list[Decoder]) -> list[torch.Tensor]:
        """The logits of every decoder's next forward, run as one runner call."""
        with self.lock:
            return self._forward(decoders)

    def _forward(self, decoders: list[Decoder]) -> list[torch.Tensor]:
        fixed = {id(d): d.next_forward() for d in decoders if not _auto(d)}  # each forward built once
        if self.speculation is not None:
            auto = [d for d in decoders if _auto(d)]
            self.speculation.plan(auto, [len(f.rows.tokens) for f in fixed.values()])
        batch = [(d.seq.cache, fixed.get(id(d)) or d.next_forward()) for d in decoders]
        decoding = all(cache.length for cache, _ in batch)
        start = time.perf_counter()
        logits = self.runner.forward(batch)
        if self.speculation is None and not self.observers:
            return logits
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize(self.runner.device)
        end = time.perf_counter()
        seconds = end - start
        longest = max(len(op.rows.tokens) for _, op in batch)
        rows = len(batch) * longest
        if self.speculation is not None and decoding:
            self.speculation.cost.observe(longest, seconds, len(batch))
            if self._last_decode_end is not None:  # the step's time outside the forward, since the last one
                self.speculation.observe_overhead(start - self._last_decode_end)
        self._last_decode_end = end if decoding else None
        for observe in self.observers:
            observe(rows, seconds, decoding)
        return logits

    def taken(self, decoders: list[Decoder]) -> None:
        """After the decoders took their logits: pool their acceptance."""
        if self.speculation is not None:
            self.speculation.observe(decoders)

    def step(self, decoders: list[Decoder], *, catch: bool = False) -> list[BaseException | None]:
        """One decode step: the forward, each decoder takes its logits, the acceptance is pooled. `catch`:
        an exception in one decoder's take (a cancelled request, a bug) comes back in its place while the
        others go on; otherwise it propagates. A failed forward always raises."""
        logits = self.forward(decoders)
        errors: list[BaseException | None] = [None] * len(decoders)
        for i, (d, lg) in enumerate(zip(decoders, logits)):
            try:
                d.take(lg)
            except BaseException as e:  # noqa: BLE001 (handed to the request's own caller)
                if not catch:
                    raise
                errors[i] = e
        self.taken(decoders)
        return errors


Item = TypeVar("Item")


class DecodeLoop(Generic[Item]):
    """Decoders in flight on one driver, each with the caller's item (a request, a job): admit up to
    `max_batch`, step them together, retire the finished and the failed."""

    def __init__(self, driver: DecodeDriver, max_batch: int | None = None, *, catch: bool = False):
        self.driver, self.max_batch, self.catch = driver, max_batch, catch
        self.active: list[tuple[Item, Decoder]] = []

    @property
    def room(self) -> int:
        """How many more decoders the next step takes."""
        return (self.max_batch - len(self.active)) if self.max_batch is not None else 1 << 30

    def admit(self, item: Item, decoder: Decoder) -> None:
        self.active.append((item, decoder))

    def step(self) -> list[tuple[Item, BaseException | None]]:
        """One step over every active decoder; the items it retired, in admission order, each with the
        exception its decoder raised (with `catch`) or None: finished."""
        retired = [(item, None) for item, d in self.active if d.finished]  # nothing left to decode
        self.active = [(item, d) for item, d in self.active if not d.finished]
        if not self.active:
            return retired
        errors = self.driver.step([d for _, d in self.active], catch=self.catch)
        out = [((item, d), e) for (item, d), e in zip(self.active, errors)]
        retired += [(item, e) for (item, d), e in out if e is not None or d.finished]
        self.active = [(item, d) for (item, d), e in out if e is None and not d.finished]
        return retired

    def run(self) -> None:
        """Step until every admitted decoder is retired (errors propagate: no `catch`)."""
        while self.active:
            self.step()

    def drop_all(self) -> list[Item]:
        """Retire every active item without decoding (their forward failed)."""
        items = [item for item, _ in self.active]
        self.active = []
        return items


__all__ = ["AutoDraft", "DecodeDriver", "DecodeLoop", "Layout", "Speculation"]
