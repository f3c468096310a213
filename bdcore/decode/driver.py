"""The decode loop over decoders that share a runner: admit, forward, take, retire.

`DecodeLoop` is the one loop every caller drives decoders with: the engine (one request), the batched
scheduler, the trainer's rollouts and self-distillation. It admits decoders up to a batch size, runs one
`DecodeDriver.step` over them and retires the finished (or failed) ones. A step is the decoders' next
forwards as one runner call (`DecodeDriver.forward`), then each decoder takes its logits.

Where the engine's self-spec policy state is given (`bdcore.decode.policy.state.Speculation`: self-spec with
`--draft-len auto` or `--self-spec-canvases auto`), the driver asks it to plan every attached decoder's layout
before the forward and tells it what happened: the forward's wall time (forwards without a prompt in them: a
prompt's forward is not a decode step) and, after the take, what the verify steps accepted.
"""

from __future__ import annotations

import threading
import time
from typing import Generic, TypeVar

import torch

from bdcore.decode.modes import Decoder, SelfSpecDecoder
from bdcore.decode.policy.state import Speculation


def _auto(d: Decoder) -> bool:
    """Whether the policy picks `d`'s layouts (a self-spec decoder it was attached to)."""
    return isinstance(d, SelfSpecDecoder) and d.policy is not None


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
        if self.speculation is not None and decoding:  # the gap: the step's time outside the forward
            gap = start - self._last_decode_end if self._last_decode_end is not None else None
            self.speculation.timed(longest, len(batch), seconds, gap)
        self._last_decode_end = end if decoding else None
        for observe in self.observers:
            observe(rows, seconds, decoding)
        return logits

    def taken(self, decoders: list[Decoder]) -> None:
        """After the decoders took their logits: pool their acceptance."""
        if self.speculation is not None:
            self.speculation.observe([d for d in decoders if _auto(d)])

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


__all__ = ["DecodeDriver", "DecodeLoop"]
