"""The server's /metrics, on prometheus_client.

Each `ServerMetrics` owns a `CollectorRegistry`: several apps share a test process, and the library's global
registry would mix their counts. Requests are counted as they finish (`record`); every model forward is
timed by the engine's driver, which calls `observe_forward` (`watch`); the scheduler's batch sizes and the
self-spec cost model are read when /metrics is scraped (`_Live`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

# Whole requests: from a short completion on a small model to a long answer on a big one.
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120)
# Tokens drafted by a forward / drafts accepted by a verify step (0: a causal step / all rejected).
DRAFT_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
# A forward's rows (batch x longest row list): one decode token up to a batch of long prefills.
ROW_BUCKETS = tuple(2**i for i in range(13))  # 1 .. 4096
# One forward: a tiny model's decode step on a CPU up to a long prefill on a big model.
FORWARD_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._lock = threading.Lock()  # the running totals behind tokens_per_forward
        self._generated = self._forwards = 0
        self._declare_request_metrics()
        self._declare_forward_metrics()
        self._live = _Live()
        self.registry.register(self._live)

    def _declare_request_metrics(self) -> None:
        # prometheus_client appends `_total` to a counter's name: these expose bdstack_requests_total etc.
        self.requests = self._counter(
            "bdstack_requests",
            "Requests by endpoint, decode mode and HTTP status (499: client left).",
            "endpoint",
            "mode",
            "status",
        )
        self.prompt_tokens = self._counter("bdstack_prompt_tokens", "Prompt tokens of served requests.")
        self.generated_tokens = self._counter("bdstack_generated_tokens", "Tokens produced by the model.")
        self.forwards = self._counter("bdstack_forwards", "Model forwards that produced them (prefill included).")
        self.tokens_per_forward = Gauge(
            "bdstack_tokens_per_forward", "generated_tokens_total / forwards_total.", registry=self.registry
        )
        self.latency = self._histogram(
            "bdstack_request_latency_seconds", "Latency of finished requests.", LATENCY_BUCKETS
        )
        self.steps = self._counter(
            "bdstack_self_spec_steps", "Self-spec steps by number of drafts accepted.", "accepted"
        )
        self.accepted = self._histogram(
            "bdstack_self_spec_accepted_drafts", "Self-spec verify steps by number of drafts accepted.", DRAFT_BUCKETS
        )
        self.drafted = self._histogram(
            "bdstack_self_spec_draft_len",
            "Forwards of self-spec requests by tokens they drafted (0: a plain causal step).",
            DRAFT_BUCKETS,
        )

    def _declare_forward_metrics(self) -> None:
        rows = "Model forwards by rows (batch x longest row list); kind: prefill when a prompt is in it."
        self.forward_rows = self._histogram("bdstack_forward_rows", rows, ROW_BUCKETS, "kind")
        seconds = "Wall time of model forwards; kind: prefill when a prompt is in it."
        self.forward_seconds = self._histogram("bdstack_forward_seconds", seconds, FORWARD_BUCKETS, "kind")

    def _counter(self, name: str, text: str, *labels: str) -> Counter:
        return Counter(name, text, labels, registry=self.registry)

    def _histogram(self, name: str, text: str, buckets, *labels: str) -> Histogram:
        return Histogram(name, text, labels, buckets=buckets, registry=self.registry)

    def watch(self, driver, batch_sizes: Mapping[int, int]) -> None:
        """Time every forward of the engine's `driver`, and read the scheduler's `batch_sizes` (forwards by
        number of requests in them) and the driver's self-spec cost model at every scrape."""
        driver.observers.append(self.observe_forward)
        self._live.driver, self._live.batch_sizes = driver, batch_sizes

    def observe_forward(self, rows: int, seconds: float, decoding: bool) -> None:
        kind = "decode" if decoding else "prefill"
        self.forward_rows.labels(kind).observe(rows)
        self.forward_seconds.labels(kind).observe(seconds)

    def record(self, endpoint: str, mode: str, status: int, *, prompt_tokens=0, stats=None, latency=None) -> None:
        """One request's outcome; `stats` (a DecodeStats) and `latency` when it was served."""
        self.requests.labels(endpoint, mode, str(status)).inc()
        self.prompt_tokens.inc(prompt_tokens)
        if stats is not None:
            self._record_stats(stats)
        if latency is not None:
            self.latency.observe(latency)

    def _record_stats(self, stats) -> None:
        self.generated_tokens.inc(stats.generated)
        self.forwards.inc(stats.forwards)
        for accepted, steps in stats.accepted.items():
            self.steps.labels(str(accepted)).inc(steps)
        _observe_counts(self.accepted, stats.accepted)
        _observe_counts(self.drafted, stats.drafted)
        with self._lock:  # both totals move together, or a scrape could see a ratio no request produced
            self._generated += stats.generated
            self._forwards += stats.forwards
            self.tokens_per_forward.set(self._generated / self._forwards if self._forwards else 0.0)

    def render(self) -> bytes:
        """The Prometheus text format (content type `prometheus_client.CONTENT_TYPE_LATEST`)."""
        return generate_latest(self.registry)


def _observe_counts(histogram: Histogram, counts: Mapping[int, int]) -> None:
    """A {value: times} tally into `histogram` (a histogram takes one observation at a time)."""
    for value, times in counts.items():
        for _ in range(times):
            histogram.observe(value)


class _Live(Collector):
    """What other parts of the server keep, read at scrape time: the scheduler's batch sizes and, while the
    engine has a self-spec policy, its forward cost model at each row count it measured."""

    def __init__(self) -> None:
        self.driver = None
        self.batch_sizes: Mapping[int, int] = {}

    def collect(self) -> Iterator[Metric]:
        # dict() copies in one step under the GIL: the scheduler and the driver update these between forwards
        batched = CounterMetricFamily(
            "bdstack_batched_forwards", "Batched forwards by number of requests in them.", labels=["requests"]
        )
        for requests, n in sorted(dict(self.batch_sizes).items()):
            batched.add_metric([str(requests)], n)
        yield batched
        speculation = getattr(self.driver, "speculation", None)
        if speculation is not None:
            cost = GaugeMetricFamily(
                "bdstack_forward_cost_seconds",
                "The self-spec policy's cost model: seconds of a decode forward by its requests and longest rows.",
                labels=["requests", "rows"],
            )
            for requests, curve in speculation.cost.points.items():
                for rows, seconds in curve.items():
                    cost.add_metric([str(requests), str(rows)], seconds)
            yield cost
