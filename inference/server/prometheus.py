"""Running totals for /metrics, rendered in the Prometheus text format."""

from __future__ import annotations

import threading
from collections import Counter


class ServerMetrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: Counter = Counter()  # (endpoint, mode, status)
        self.prompt_tokens = self.generated_tokens = self.forwards = 0
        self.latency_sum = 0.0
        self.latency_count = 0
        self.accepted: Counter = Counter()  # self-spec: verify steps by number of drafts accepted

    def record(self, endpoint: str, mode: str, status: int, *, prompt_tokens=0, stats=None, latency=None) -> None:
        with self._lock:
            self.requests[(endpoint, mode, status)] += 1
            self.prompt_tokens += prompt_tokens
            if stats is not None:
                self.generated_tokens += stats.generated
                self.forwards += stats.forwards
                self.accepted.update(stats.accepted)
            if latency is not None:
                self.latency_sum += latency
                self.latency_count += 1

    def render(self, batch_sizes: Counter | None = None) -> str:
        """`batch_sizes`: the scheduler's batched forwards by number of requests in them."""
        with self._lock:
            lines = [
                "# HELP bdstack_requests_total Requests by endpoint, decode mode and HTTP status (499: client left).",
                "# TYPE bdstack_requests_total counter",
            ]
            for (ep, mode, status), n in sorted(self.requests.items()):
                lines.append(f'bdstack_requests_total{{endpoint="{ep}",mode="{mode}",status="{status}"}} {n}')
            tpf = self.generated_tokens / self.forwards if self.forwards else 0.0
            for name, kind, value, text in (
                ("prompt_tokens_total", "counter", self.prompt_tokens, "Prompt tokens of served requests."),
                ("generated_tokens_total", "counter", self.generated_tokens, "Tokens produced by the model."),
                ("forwards_total", "counter", self.forwards, "Model forwards that produced them (prefill included)."),
                ("tokens_per_forward", "gauge", tpf, "generated_tokens_total / forwards_total."),
                ("request_latency_seconds_sum", "counter", self.latency_sum, "Total latency of finished requests."),
                ("request_latency_seconds_count", "counter", self.latency_count, "Finished requests."),
            ):
                lines += [f"# HELP bdstack_{name} {text}", f"# TYPE bdstack_{name} {kind}", f"bdstack_{name} {value}"]
            lines += [
                "# HELP bdstack_self_spec_steps_total Self-spec steps by number of drafts accepted.",
                "# TYPE bdstack_self_spec_steps_total counter",
            ]
            lines += [f'bdstack_self_spec_steps_total{{accepted="{k}"}} {n}' for k, n in sorted(self.accepted.items())]
            lines += [
                "# HELP bdstack_batched_forwards_total Batched forwards by number of requests in them.",
                "# TYPE bdstack_batched_forwards_total counter",
            ]
            sizes = sorted((batch_sizes or {}).items())
            lines += [f'bdstack_batched_forwards_total{{requests="{k}"}} {n}' for k, n in sizes]
            return "\n".join(lines) + "\n"
