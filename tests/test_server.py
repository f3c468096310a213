"""The OpenAI-compatible server end to end through the `openai` client: modes, streaming, errors,
concurrency, disconnects, metrics."""

import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from openai import OpenAI

from tests.conftest import native_server
from tests.tiny import tiny_checkpoint

pytestmark = pytest.mark.e2e  # a whole program, server or long sweep: `pytest -m 'not e2e'` skips it

MODES = ("causal", "diffusion", "self-spec")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with native_server(tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), bd_size=4), api_key="sekret") as srv:
        yield srv


@pytest.fixture
def client(server):
    return OpenAI(base_url=server[0] + "/v1", api_key="sekret", max_retries=0)


def raw(url, path, body=None, key="sekret", data=None):
    req = urllib.request.Request(
        url + path,
        data=data if data is not None else (json.dumps(body).encode() if body is not None else None),
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


MSG = [{"role": "user", "content": "Copy: abc"}]


def test_health_and_models(server, client):
    assert json.loads(raw(server[0], "/health")[1])["status"] == "ok"
    assert [m.id for m in client.models.list().data] == ["tiny"]


def counted_forwards(server):
    """A forward hook on the served model: its calls, counted apart from the engine's own stats."""
    calls = []
    return calls, server[1].state.engine.loaded.model.register_forward_hook(lambda *_: calls.append(1))


@pytest.mark.parametrize("mode", MODES)
def test_chat_in_every_mode_reports_tokens_per_forward(server, client, mode):
    calls, hook = counted_forwards(server)
    try:
        r = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=12, extra_body={"mode": mode})
    finally:
        hook.remove()
    u = r.usage.model_extra
    assert r.choices[0].finish_reason in ("stop", "length")
    assert u["forwards"] == len(calls) >= 1
    assert u["tokens_per_forward"] == pytest.approx(r.usage.completion_tokens / len(calls), abs=1e-4)
    # draft-verify cycles only where drafts are verified: every self-spec forward after the prefill
    assert u.get("verify_steps", 0) == (len(calls) - 1 if mode == "self-spec" else 0)
    if mode == "causal":  # this prompt runs to max_tokens; causal is one forward per token, prefill included
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 12 == len(calls)


DRAFT_VERIFY_FIELDS = {"verify_steps", "accepted_drafts", "acceptance_length"}


@pytest.mark.parametrize("mode", MODES)
def test_only_self_spec_replies_carry_draft_verify_figures(server, client, monkeypatch, mode):
    """`verify_steps`, `accepted_drafts` and `acceptance_length` are self-spec's: a causal or diffusion reply,
    whole or streamed, carries none of them (not even zeros); a self-spec reply carries its own request's, by
    hand from the acceptance histogram of the generation the scheduler returned, its verify steps every
    forward after the prefill."""
    scheduler = server[1].state.scheduler
    generate, gens = scheduler.generate, []
    monkeypatch.setattr(scheduler, "generate", lambda *a, **kw: gens.append(generate(*a, **kw)) or gens[-1])
    calls, hook = counted_forwards(server)
    try:
        whole, chunks = whole_and_streamed(client, mode, 12)
    finally:
        hook.remove()
    replies = [r.usage.model_extra | {"completion_tokens": r.usage.completion_tokens} for r in (whole, chunks[-1])]
    assert len(gens) == 2 and sum(u["forwards"] for u in replies) == len(calls)
    for u, gen in zip(replies, gens):
        assert u["forwards"] == gen.stats.forwards
        if mode != "self-spec":
            assert not DRAFT_VERIFY_FIELDS & u.keys(), f"a {mode} reply carries self-spec's figures: {u}"
            continue
        steps = sum(gen.stats.accepted.values())
        accepted = sum(k * n for k, n in gen.stats.accepted.items())
        assert steps == u["forwards"] - 1 > 0
        assert (u["verify_steps"], u["accepted_drafts"]) == (steps, accepted)
        assert u["acceptance_length"] == pytest.approx(1 + accepted / steps, abs=1e-4)
        # each forward emits one token and the drafts it accepted (the last forward's may be cut at max_tokens)
        assert u["completion_tokens"] <= u["forwards"] + accepted


def test_causal_counts_the_end_of_turn_token(server, client):
    """A reply that ends at end-of-turn: its text's tokens plus the end-of-turn token, one forward each."""
    calls, hook = counted_forwards(server)
    try:
        r = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Copy: 0"}],
            max_tokens=50,
            extra_body={"mode": "causal"},
        )
    finally:
        hook.remove()
    tokenizer = server[1].state.engine.loaded.tokenizer
    text_tokens = len(tokenizer(r.choices[0].message.content, add_special_tokens=False)["input_ids"])
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == text_tokens + 1 == len(calls) == r.usage.model_extra["forwards"]


def test_self_spec_equals_causal_through_the_server(client):
    a = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=16, extra_body={"mode": "causal"})
    b = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=16)
    c = client.chat.completions.create(
        model="tiny", messages=MSG, max_tokens=16, extra_body={"self_spec_canvases": "all"}
    )
    assert a.choices[0].message.content == b.choices[0].message.content == c.choices[0].message.content
    assert c.usage.model_extra["forwards"] <= c.usage.completion_tokens
    with pytest.raises(openai.BadRequestError, match="self_spec_canvases"):
        client.chat.completions.create(
            model="tiny", messages=MSG, max_tokens=4, extra_body={"self_spec_canvases": "some"}
        )


def whole_and_streamed(client, mode: str, max_tokens: int):
    """One chat request's whole reply, and its chunks streamed with usage."""
    ask = dict(model="tiny", messages=MSG, max_tokens=max_tokens, extra_body={"mode": mode})
    whole = client.chat.completions.create(**ask)
    return whole, list(client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}))


@pytest.mark.parametrize("mode", MODES)
def test_streaming_matches_non_streaming(client, mode):
    full, chunks = whole_and_streamed(client, mode, 14)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_completions_endpoint_and_stop_strings(client):
    r = client.completions.create(model="tiny", prompt="<|im_start|>user\nhi<|im_end|>\n", max_tokens=10)
    assert isinstance(r.choices[0].text, str) and r.usage.model_extra["tokens_per_forward"] > 0
    full = client.completions.create(model="tiny", prompt="ab", max_tokens=10, extra_body={"mode": "causal"})
    text = full.choices[0].text
    if len(text) >= 3:
        cut = client.completions.create(
            model="tiny", prompt="ab", max_tokens=10, stop=[text[2:4]], extra_body={"mode": "causal"}
        )
        assert cut.choices[0].text == text[: text.find(text[2:4])] and cut.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    "path,body,data,status,code",
    [
        ("/v1/chat/completions", None, b"{not json", 400, None),
        ("/v1/chat/completions", {"model": "other", "messages": MSG}, None, 404, "model_not_found"),
        ("/v1/chat/completions", {"messages": MSG, "temperature": -1}, None, 400, None),
        ("/v1/chat/completions", {"messages": MSG, "max_tokens": 10**6}, None, 400, "context_length_exceeded"),
        ("/v1/chat/completions", {"messages": "hi"}, None, 400, None),
        ("/v1/chat/completions", {"messages": MSG, "mode": "nope"}, None, 400, None),
        ("/v1/chat/completions", {"messages": MSG, "n": 2}, None, 400, None),
        ("/v1/completions", {"prompt": ""}, None, 400, None),
    ],
)
def test_errors_have_openai_shape_and_server_keeps_serving(server, client, path, body, data, status, code):
    got, text = raw(server[0], path, body, data=data)
    assert got == status
    err = json.loads(text)["error"]
    assert err["message"] and err["type"]
    if code:
        assert err["code"] == code
    assert client.chat.completions.create(model="tiny", messages=MSG, max_tokens=3).choices


def test_api_key_is_required(server):
    status, text = raw(server[0], "/v1/models", key="wrong")
    assert status == 401 and json.loads(text)["error"]["code"] == "invalid_api_key"


def test_concurrent_requests_are_correct(client):
    def ask(i):
        return (
            client.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": f"Copy: {i}"}],
                max_tokens=10,
                extra_body={"mode": MODES[i % 3]},
            )
            .choices[0]
            .message.content
        )

    sequential = [ask(i) for i in range(6)]
    with ThreadPoolExecutor(4) as pool:
        parallel = list(pool.map(ask, range(6)))
    assert parallel == sequential


def test_client_disconnect_mid_stream_then_serving_goes_on(server, client):
    stream = client.chat.completions.create(
        model="tiny", messages=MSG, max_tokens=200, stream=True, extra_body={"mode": "causal"}
    )
    next(iter(stream))
    stream.close()
    r = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=4)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_metrics_report_running_totals(server, client):
    client.chat.completions.create(model="tiny", messages=MSG, max_tokens=5, extra_body={"mode": "causal"})
    assert raw(server[0], "/v1/chat/completions", {"model": "other", "messages": MSG})[0] == 404
    status, text = raw(server[0], "/metrics")
    assert status == 200
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line and line[0] != "#"}
    assert values["bdstack_generated_tokens_total"] > 0 and values["bdstack_forwards_total"] > 0
    assert values["bdstack_tokens_per_forward"] == pytest.approx(
        values["bdstack_generated_tokens_total"] / values["bdstack_forwards_total"]
    )
    assert any(k.startswith("bdstack_requests_total") and 'status="404"' in k for k in values)
    assert any(k.startswith("bdstack_self_spec_steps_total") for k in values)
    batched = sum(v for k, v in values.items() if k.startswith("bdstack_batched_forwards_total"))
    assert batched >= values["bdstack_forwards_total"] / 8, "every forward went through the scheduler's batches"


def test_chat_cli_one_shot_streaming_and_not(server, capsys):
    from inference import chat

    base = server[0] + "/v1"
    assert chat.main([f"--base-url={base}", "--api-key=sekret", "--max-tokens=6", "Copy: ab"]) == 0
    streamed = capsys.readouterr().out
    assert (
        chat.main(
            [f"--base-url={base}", "--api-key=sekret", "--max-tokens=6", "--no-stream", "--mode=causal", "Copy: ab"]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert streamed.strip() == out.splitlines()[0].strip()
    assert "tokens/forward" in out


def test_requests_with_tools_are_served(client):
    tools = [
        {
            "type": "function",
            "function": {"name": "get_time", "description": "now", "parameters": {"type": "object", "properties": {}}},
        }
    ]
    r = client.chat.completions.create(model="tiny", messages=MSG, tools=tools, max_tokens=6)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    chunks = list(client.chat.completions.create(model="tiny", messages=MSG, tools=tools, max_tokens=6, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (
        r.choices[0].message.content or ""
    )


def test_concurrent_requests_fill_the_batch_beyond_the_default_thread_pool(server, client):
    """Every in-flight request waits in a thread: with asyncio's default pool (cores + 4 threads: 6 on a
    2-core machine) 8 concurrent requests could never share one forward under --max-batch 8."""
    scheduler = server[1].state.scheduler
    assert scheduler.max_batch == 8
    scheduler.batch_sizes.clear()

    def ask(_):
        r = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=60, extra_body={"mode": "causal"})
        return r.choices[0].finish_reason

    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(ask, range(8))) == ["length"] * 8
    assert max(scheduler.batch_sizes) == 8, scheduler.batch_sizes
