"""/metrics on prometheus_client, parsed as Prometheus parses it: the old series keep their names and labels,
and the counts and histograms agree exactly with what the served requests report in their usage.

Every test reads the difference between a scrape before and one after its own requests, served one at a
time, so the tests do not depend on each other's order on the shared server."""

import json
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import native_server
from tests.tiny import tiny_checkpoint

pytestmark = pytest.mark.e2e  # a whole program, server or long sweep: `pytest -m 'not e2e'` skips it

DRAFT_LEN = 4  # the server's self-spec default: the checkpoint's bd_size
MSG = [{"role": "user", "content": "Copy: abc"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with native_server(tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), bd_size=DRAFT_LEN)) as srv:
        yield srv


def get(url, path):
    with urllib.request.urlopen(url + path, timeout=60) as r:
        return r.status, r.headers["Content-Type"], r.read().decode()


def post(url, body) -> str:
    req = urllib.request.Request(
        url + "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return r.read().decode()


def chat(url, mode, **extra) -> dict:
    """One request's usage."""
    return json.loads(post(url, {"model": "tiny", "messages": MSG, "max_tokens": 10, "mode": mode, **extra}))["usage"]


def streamed_chat(url, mode) -> dict:
    """One streamed request's usage (its last chunk before [DONE])."""
    body = {"model": "tiny", "messages": MSG, "max_tokens": 10, "mode": mode, "stream": True}
    body["stream_options"] = {"include_usage": True}
    events = [line[6:] for line in post(url, body).splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return json.loads(events[-2])["usage"]


def families(url) -> dict:
    status, content_type, text = get(url, "/metrics")
    assert status == 200 and content_type == CONTENT_TYPE_LATEST
    return {f.name: f for f in text_string_to_metric_families(text)}


class Scrape:
    """One /metrics body (or the difference of two): sample values by (sample name, labels)."""

    def __init__(self, values: dict):
        self.values = values

    @classmethod
    def of(cls, url) -> "Scrape":
        fams = families(url).values()
        return cls({(s.name, frozenset(s.labels.items())): s.value for f in fams for s in f.samples})

    def __call__(self, name, **labels) -> float:
        return self.values.get((name, frozenset((k, str(v)) for k, v in labels.items())), 0.0)

    def __sub__(self, before: "Scrape") -> "Scrape":
        return Scrape({k: v - before.values.get(k, 0.0) for k, v in self.values.items()})

    def buckets(self, name, **labels) -> list[tuple[float, float]]:
        """(le, cumulative count) of a histogram, by le."""
        out = [
            (float(dict(key)["le"]), v)
            for (n, key), v in self.values.items()
            if n == name + "_bucket" and {k: v for k, v in key if k != "le"} == labels
        ]
        return sorted(out)

    def by_label(self, name, label) -> dict[str, float]:
        return {dict(key)[label]: v for (n, key), v in self.values.items() if n == name}


# (family as prometheus_client's parser names it, sample name as exposed)
OLD = [
    ("bdstack_requests", "bdstack_requests_total"),
    ("bdstack_prompt_tokens", "bdstack_prompt_tokens_total"),
    ("bdstack_generated_tokens", "bdstack_generated_tokens_total"),
    ("bdstack_forwards", "bdstack_forwards_total"),
    ("bdstack_tokens_per_forward", "bdstack_tokens_per_forward"),
    ("bdstack_request_latency_seconds", "bdstack_request_latency_seconds_sum"),
    ("bdstack_request_latency_seconds", "bdstack_request_latency_seconds_count"),
    ("bdstack_self_spec_steps", "bdstack_self_spec_steps_total"),
    ("bdstack_batched_forwards", "bdstack_batched_forwards_total"),
]


def refused(url, body) -> int:
    try:
        post(url, body)
    except urllib.error.HTTPError as e:
        return e.code
    raise AssertionError("served")


def test_old_series_keep_their_names_and_labels(server):
    url = server[0]
    chat(url, "causal")
    chat(url, "self-spec")
    assert refused(url, {"model": "other", "messages": MSG}) == 404
    fams = families(url)
    labels = {name: {frozenset(s.labels) for s in fams[family].samples if s.name == name} for family, name in OLD}
    assert labels == {
        "bdstack_requests_total": {frozenset({"endpoint", "mode", "status"})},
        "bdstack_prompt_tokens_total": {frozenset()},
        "bdstack_generated_tokens_total": {frozenset()},
        "bdstack_forwards_total": {frozenset()},
        "bdstack_tokens_per_forward": {frozenset()},
        "bdstack_request_latency_seconds_sum": {frozenset()},
        "bdstack_request_latency_seconds_count": {frozenset()},
        "bdstack_self_spec_steps_total": {frozenset({"accepted"})},
        "bdstack_batched_forwards_total": {frozenset({"requests"})},
    }
    assert fams["bdstack_tokens_per_forward"].type == "gauge"
    assert fams["bdstack_request_latency_seconds"].type == "histogram"
    now = Scrape.of(url)
    assert now("bdstack_requests_total", endpoint="chat", mode="-", status=404) >= 1
    assert now("bdstack_tokens_per_forward") == pytest.approx(
        now("bdstack_generated_tokens_total") / now("bdstack_forwards_total")
    )


def test_requests_and_their_latency_histogram(server):
    url, n = server[0], 3
    before, t0 = Scrape.of(url), time.perf_counter()
    usages = [chat(url, "causal") for _ in range(n)]
    wall = time.perf_counter() - t0
    d = Scrape.of(url) - before
    assert d("bdstack_requests_total", endpoint="chat", mode="causal", status=200) == n
    assert d("bdstack_prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    assert d("bdstack_generated_tokens_total") == sum(u["completion_tokens"] for u in usages)
    assert d("bdstack_request_latency_seconds_count") == n
    assert 0 < d("bdstack_request_latency_seconds_sum") <= wall
    counts = [c for _, c in d.buckets("bdstack_request_latency_seconds")]
    assert counts == sorted(counts) and counts[-1] == n, "cumulative buckets, +Inf holding every request"
    total = Scrape.of(url)
    served = sum(
        v for (name, key), v in total.values.items() if name == "bdstack_requests_total" and ("status", "200") in key
    )
    assert total("bdstack_request_latency_seconds_count") == served, "every served request has its latency"


@pytest.mark.parametrize("mode", ["causal", "diffusion", "self-spec"])
def test_every_forward_is_in_the_forward_histograms(server, mode):
    url = server[0]
    before = Scrape.of(url)
    usages = [chat(url, mode) for _ in range(2)]
    d = Scrape.of(url) - before
    forwards = sum(u["forwards"] for u in usages)
    assert d("bdstack_forwards_total") == forwards
    for name in ("bdstack_forward_rows", "bdstack_forward_seconds"):
        assert d(name + "_count", kind="prefill") == len(usages), "one forward a request carries its prompt"
        assert d(name + "_count", kind="prefill") + d(name + "_count", kind="decode") == forwards
        for kind in ("prefill", "decode"):
            counts = [c for _, c in d.buckets(name, kind=kind)]
            assert counts == sorted(counts) and counts[-1] == d(name + "_count", kind=kind)
    assert d("bdstack_forward_seconds_sum", kind="decode") > 0
    if mode != "self-spec":
        assert d("bdstack_self_spec_draft_len_count") == d("bdstack_self_spec_accepted_drafts_count") == 0
    if mode == "causal":  # the prefill's rows are the prompt, every later forward one token
        assert d("bdstack_forward_rows_sum", kind="prefill") == sum(u["prompt_tokens"] for u in usages)
        assert d("bdstack_forward_rows_sum", kind="decode") == forwards - len(usages)


@pytest.mark.parametrize("stream", [False, True])
def test_self_spec_draft_len_and_accepted_histograms(server, stream):
    url = server[0]
    before = Scrape.of(url)
    usage = (streamed_chat if stream else chat)(url, "self-spec")
    d = Scrape.of(url) - before
    # draft_len N, one canvas after the last clean row: every forward, the prefill too, drafts N - 1
    assert d("bdstack_self_spec_draft_len_count") == usage["forwards"]
    assert d("bdstack_self_spec_draft_len_sum") == (DRAFT_LEN - 1) * usage["forwards"]
    assert dict(d.buckets("bdstack_self_spec_draft_len"))[DRAFT_LEN - 2] == 0, "so each forward drafted N - 1"
    # every forward after the prefill is a step that accepted some drafts (a cold step: none)
    steps = {int(k): v for k, v in d.by_label("bdstack_self_spec_steps_total", "accepted").items() if v}
    assert sum(steps.values()) == d("bdstack_self_spec_accepted_drafts_count") == usage["forwards"] - 1
    assert d("bdstack_self_spec_accepted_drafts_sum") == sum(k * v for k, v in steps.items())
    # the reply's usage says the same cycles: the field's acceptance length counts the verifier's token
    assert usage["verify_steps"] == sum(steps.values())
    assert usage["accepted_drafts"] == sum(k * v for k, v in steps.items())
    assert usage["acceptance_length"] == round(1 + usage["accepted_drafts"] / usage["verify_steps"], 4)
    for le, cumulative in d.buckets("bdstack_self_spec_accepted_drafts"):
        assert cumulative == sum(v for k, v in steps.items() if k <= le)


def test_forward_cost_gauge_shows_the_speculation_policy(server):
    """The server measures the cost model when it starts (on the thread that decodes), not at a request's
    first `auto`: a request thread's forwards would slow the whole process (session 47)."""
    url, driver = server[0], server[1].state.engine.driver
    assert driver.speculation is not None, "measured at start-up"
    chat(url, "self-spec", self_spec_canvases="auto")  # decodes on the cost model
    fam = families(url)["bdstack_forward_cost_seconds"]
    assert fam.type == "gauge"
    got: dict[int, dict[int, float]] = {}
    for sample in fam.samples:
        got.setdefault(int(sample.labels["requests"]), {})[int(sample.labels["rows"])] = sample.value
    assert got == driver.speculation.cost.points and 8 in got  # every measured batch size's curve
