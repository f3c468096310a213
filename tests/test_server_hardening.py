"""The server under bad input and load: strict OpenAI-shaped 4xx, opaque 5xx that /metrics counts, a
request-size limit, client chat templates off unless allowed and stopped past their time limit, prompt
preparation off the event loop, cancellation of abandoned non-streaming requests, connections closed that
send no request head in time, and the API key on every path but /health."""

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import pytest

from tests.conftest import REPO, serve_app
from tests.tiny import tiny_checkpoint

pytestmark = pytest.mark.e2e  # a whole program, server or long sweep: `pytest -m 'not e2e'` skips it

KEY = "k3y"
MSG = [{"role": "user", "content": "Copy: abc"}]
LIMIT = 16_000


@contextlib.contextmanager
def running(ckpt, **kw):
    from bdcore.loading import load_checkpoint
    from inference.native.engine import DecodeConfig
    from inference.server import create_app

    loaded = load_checkpoint(ckpt)
    app = create_app(loaded, DecodeConfig(mode="causal"), model_name="tiny", default_max_tokens=8, **kw)
    with serve_app(app) as url:
        yield url, app, loaded


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), bd_size=4)


@pytest.fixture(scope="module")
def server(ckpt):
    with running(ckpt, api_key=KEY, max_request_bytes=LIMIT) as srv:
        yield srv


@pytest.fixture(scope="module")
def open_server(ckpt):
    with running(ckpt, allow_client_chat_template=True, chat_template_timeout=1.0) as srv:
        yield srv


def call(url, path, body=None, *, method=None, data=None, key=KEY, timeout=30):
    """(status, text); `data` may be bytes or an iterable of bytes (sent chunked, with no length)."""
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    if data is None and body is not None:
        data = json.dumps(body).encode()
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    try:
        conn.request(method or ("GET" if data is None else "POST"), path, body=data, headers=headers)
        r = conn.getresponse()
        return r.status, r.read().decode()
    finally:
        conn.close()


def error_of(text) -> dict:
    err = json.loads(text)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["type"]
    return err


def metric(url, endpoint, status) -> float:
    _, text = call(url, "/metrics")
    key = f'bdstack_requests_total{{endpoint="{endpoint}",'
    return sum(
        float(line.split()[-1]) for line in text.splitlines() if line.startswith(key) and f'status="{status}"' in line
    )


def assert_serving(url):
    status, text = call(url, "/v1/chat/completions", {"messages": MSG, "max_tokens": 2})
    assert status == 200, text


CHAT, COMPLETION = "/v1/chat/completions", "/v1/completions"
M = json.dumps(MSG)


@pytest.mark.parametrize(
    "path,data,param",
    [
        (CHAT, f'{{"messages": {M}, "temperature": NaN}}', "temperature"),
        (CHAT, f'{{"messages": {M}, "top_p": NaN}}', "top_p"),
        (CHAT, f'{{"messages": {M}, "temperature": 1{"0" * 400}}}', "temperature"),
        (CHAT, f'{{"messages": {M}, "seed": {2**64}}}', "seed"),
        (CHAT, f'{{"messages": {M}, "seed": {2**64}, "stream": true}}', "seed"),
        (CHAT, f'{{"messages": {M}, "stream": true, "stream_options": "yes"}}', "stream_options"),
        (CHAT, f'{{"messages": {M}, "stream": true, "stream_options": {{"include_usage": "yes"}}}}', "stream_options"),
        (CHAT, f'{{"messages": {M}, "stream": "false"}}', "stream"),
        (CHAT, f'{{"messages": {M}, "model": 5}}', "model"),
        (CHAT, f'{{"messages": {M}, "mode": 3}}', "mode"),
        (CHAT, f'{{"messages": {M}, "frobnicate": 1}}', "frobnicate"),
        (CHAT, f'{{"messages": {M}, "presence_penalty": 0.5}}', "presence_penalty"),
        (CHAT, f'{{"messages": {M}, "max_tokens": 1{"0" * 5000}}}', None),  # past Python's int-parsing limit
        (CHAT, "[" * 5000 + "]" * 5000, None),  # nested past the parser's recursion limit
        (COMPLETION, '{"prompt": "ab", "echo": true}', "echo"),
        (COMPLETION, '{"prompt": "ab", "suffix": "x"}', "suffix"),
        (COMPLETION, '{"prompt": "ab", "best_of": 2}', "best_of"),
        (COMPLETION, '{"prompt": "ab", "stream": 1}', "stream"),
    ],
)
def test_bad_input_is_400_in_openai_shape(server, path, data, param):
    status, text = call(server[0], path, data=data.encode())
    assert status == 400, text
    err = error_of(text)
    assert err["type"] == "invalid_request_error" and "Error:" not in err["message"]
    if param:
        assert err["param"] == param
    assert_serving(server[0])


@pytest.mark.parametrize(
    "path,data,where,param",
    [
        (COMPLETION, r'{"prompt": "\ud800", "max_tokens": 4}', "prompt", "prompt"),
        (COMPLETION, r'{"prompt": ["ok", "a\udfffb"], "max_tokens": 4}', "prompt[1]", "prompt"),
        (CHAT, r'{"messages": [{"role": "user", "content": "x\ud83d"}]}', "messages[0].content", "messages"),
        (
            CHAT,
            r'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]}',
            "messages[0].content[0].text",
            "messages",
        ),
    ],
)
def test_a_lone_surrogate_is_400_naming_the_field(server, path, data, where, param):
    """JSON may spell a UTF-16 half (\\ud800) that no UTF-8 text holds; tokenizers raise on it."""
    status, text = call(server[0], path, data=data.encode())
    assert status == 400, text
    err = error_of(text)
    assert err["param"] == param and where in err["message"] and "surrogate" in err["message"], err
    for raw in (b'{"prompt": "\xed\xa0\x80"}', '{"prompt": "\udc80"}'.encode("utf-16-be", "surrogatepass")):
        status, text = call(server[0], COMPLETION, data=raw)  # a surrogate encoded, as UTF-8 or UTF-16 bytes
        assert status == 400 and "not valid JSON" in error_of(text)["message"], text  # JSON is UTF-8
    ok = r'{"prompt": "\ud83d\ude00", "max_tokens": 2}'  # a pair is one character: served
    assert call(server[0], COMPLETION, data=ok.encode())[0] == 200
    assert_serving(server[0])


@pytest.mark.parametrize(
    "path,extra",
    [
        (CHAT, {"seed": 2**64 - 1, "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}}),
        (CHAT, {"user": "u", "metadata": {"run": "x"}, "store": False, "stream": False, "stream_options": None}),
        (COMPLETION, {"echo": False, "best_of": 1, "suffix": None, "logprobs": None}),
    ],
)
def test_defaults_of_unsupported_fields_are_accepted(server, path, extra):
    body = {"messages": MSG} if path == CHAT else {"prompt": "ab"}
    status, text = call(server[0], path, {**body, "max_tokens": 2, **extra})
    assert status == 200, text


def test_internal_errors_are_opaque_and_counted(server, monkeypatch):
    url, app, _ = server

    def broken(*_a, **_k):
        raise RuntimeError("secret-detail at /srv/model")

    monkeypatch.setattr(app.state.scheduler, "generate", broken)
    before = metric(url, "chat", 500)
    status, text = call(url, CHAT, {"messages": MSG, "max_tokens": 2})
    assert status == 500 and error_of(text) == {
        "message": "internal error",
        "type": "server_error",
        "param": None,
        "code": None,
    }
    status, text = call(url, CHAT, {"messages": MSG, "max_tokens": 2, "stream": True})
    assert status == 200 and '"internal error"' in text and "secret" not in text
    assert metric(url, "chat", 500) == before + 2


def test_request_size_limit(server):
    url = server[0]
    big = {"messages": MSG, "max_tokens": 2, "user": "x" * LIMIT}
    status, text = call(url, CHAT, big)
    assert status == 413 and error_of(text)["code"] == "request_too_large"
    data = json.dumps(big).encode()
    status, text = call(url, CHAT, data=(data[i : i + 1000] for i in range(0, len(data), 1000)))  # chunked
    assert status == 413 and error_of(text)["code"] == "request_too_large"
    status, text = call(url, CHAT, {**big, "user": "x" * (LIMIT - 200)})
    assert status == 200, text


def test_client_chat_templates_are_refused_by_default(server):
    body = {"messages": MSG, "max_tokens": 2}
    status, text = call(server[0], CHAT, {**body, "chat_template_kwargs": {"chat_template": "Z"}})
    assert status == 400 and error_of(text)["param"] == "chat_template_kwargs"
    assert "--allow-client-chat-template" in error_of(text)["message"]
    status, text = call(server[0], CHAT, {**body, "chat_template": "Z"})
    assert status == 400 and error_of(text)["param"] == "chat_template"


def test_client_chat_templates_with_the_flag(open_server):
    body = {"messages": MSG, "max_tokens": 2}
    status, text = call(open_server[0], CHAT, {**body, "chat_template_kwargs": {"chat_template": "Z"}})
    assert status == 200 and json.loads(text)["usage"]["prompt_tokens"] == 1
    status, text = call(open_server[0], CHAT, {**body, "chat_template": "ZZ"})
    assert status == 200 and json.loads(text)["usage"]["prompt_tokens"] == 2


RUNAWAY = "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}"  # issue 54's
SILENT = RUNAWAY.replace("x", "")  # as long, writing nothing


def test_a_runaway_client_template_is_stopped_at_its_time_limit(open_server):
    """Issue 54: two nested 100,000 loops rendered for hours after the client left. Now a 400 naming the
    template and the limit, /health answers meanwhile, and no core burns after; one writing more than the
    context holds is stopped as it writes; a template the server also has renders as its own does."""
    url = open_server[0]
    with ThreadPoolExecutor(1) as pool:
        t0 = time.perf_counter()
        pending = pool.submit(call, url, CHAT, {"messages": MSG, "chat_template": SILENT}, timeout=15)
        time.sleep(0.3)
        assert call(url, "/health", key=None, timeout=2)[0] == 200 and time.perf_counter() - t0 < 1.0
        status, text = pending.result()
    seconds, cpu = time.perf_counter() - t0, time.process_time()
    assert status == 400 and seconds < 4, (status, seconds, text)
    err = error_of(text)
    assert err["param"] == "chat_template" and err["code"] == "chat_template_timeout", err
    assert "chat template" in err["message"] and "1 s" in err["message"], err
    assert "--chat-template-timeout" in err["message"], err
    time.sleep(1.0)
    assert time.process_time() - cpu < 0.3, "the process kept computing after the refusal"
    t0 = time.perf_counter()  # writing: stopped once past what the context holds, long before the time limit
    status, text = call(url, CHAT, {"messages": MSG, "chat_template": RUNAWAY})
    assert status == 400 and time.perf_counter() - t0 < 0.5, text
    assert error_of(text)["param"] == "chat_template" and "wrote more than" in text, text
    own = open_server[2].tokenizer.chat_template
    body = {"messages": MSG, "max_tokens": 4, "temperature": 0}
    replies = [json.loads(call(url, CHAT, {**body, **extra})[1]) for extra in ({}, {"chat_template": own})]
    assert replies[0]["usage"] == replies[1]["usage"]
    assert replies[0]["choices"][0]["message"] == replies[1]["choices"][0]["message"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answers(url) -> bool:
    try:
        return call(url, "/health", key=None, timeout=1)[0] == 200
    except OSError:  # not listening yet
        return False


def test_serve_py_stops_on_sigterm_while_a_client_template_runs(ckpt):
    """serve.py's --chat-template-timeout and --header-timeout reach the server, and SIGTERM stops it while a
    runaway template renders (uvicorn lets requests in flight finish first: that one never did)."""
    port = _free_port()
    flags = ["--allow-client-chat-template", "--chat-template-timeout", "1", "--header-timeout", "1"]
    cmd = [sys.executable, "inference/serve.py", str(ckpt), "--mode", "causal", "--port", str(port), *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while not _answers(url):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read().decode()[-3000:]
            time.sleep(0.1)
        with socket.create_connection(("127.0.0.1", port)) as sock:  # sends nothing: closed after 1 s
            sock.settimeout(10)
            t0 = time.perf_counter()
            assert sock.recv(1) == b"" and time.perf_counter() - t0 < 3
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(call, url, CHAT, {"messages": MSG, "chat_template": SILENT}, timeout=15)
            time.sleep(0.5)
            t0 = time.perf_counter()
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=15)  # the server's own exit (interpreter teardown) takes about 2 s of it
            print(f"SIGTERM to exit: {time.perf_counter() - t0:.2f} s")
            assert pending.result()[0] == 400  # the request in flight was answered before the server went
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_health_answers_while_a_prompt_is_being_prepared(server, monkeypatch, kind):
    """A slow template render or tokenization (held here on an event) must not block the event loop."""
    url, _, loaded = server
    tok = loaded.tokenizer
    entered, release = threading.Event(), threading.Event()
    if kind == "chat":
        real = tok.apply_chat_template

        def slow(*a, **k):
            entered.set()
            release.wait(30)
            return real(*a, **k)

        monkeypatch.setattr(tok, "apply_chat_template", slow)
        path, body = CHAT, {"messages": MSG, "max_tokens": 2}
    else:
        real_call = type(tok).__call__

        def slow_call(self, text, *a, **k):
            if isinstance(text, str) and text.startswith("SLOW"):
                entered.set()
                release.wait(30)
            return real_call(self, text, *a, **k)

        monkeypatch.setattr(type(tok), "__call__", slow_call)
        path, body = COMPLETION, {"prompt": "SLOW ab", "max_tokens": 2}
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(call, url, path, body)
        try:
            assert entered.wait(10)
            t0 = time.perf_counter()
            assert call(url, "/health", key=None, timeout=5)[0] == 200
            assert call(url, "/v1/models", timeout=5)[0] == 200
            assert time.perf_counter() - t0 < 3
        finally:
            release.set()
        assert pending.result()[0] == 200


def test_abandoned_non_streaming_request_is_cancelled(server):
    url, _, loaded = server
    forwards = []
    hook = loaded.model.register_forward_hook(lambda *_: forwards.append(1))
    try:
        before = metric(url, "chat", 499)
        u = urlsplit(url)
        body = json.dumps({"messages": MSG, "max_tokens": 800}).encode()  # this prompt runs the full 800
        head = (
            f"POST {CHAT} HTTP/1.1\r\nHost: {u.hostname}\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        sock = socket.create_connection((u.hostname, u.port))
        sock.sendall(head.encode() + body)
        deadline = time.monotonic() + 30
        while len(forwards) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        sock.close()
        deadline = time.monotonic() + 10
        while metric(url, "chat", 499) == before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert metric(url, "chat", 499) == before + 1, "the abandoned request was not cancelled"
        stopped = len(forwards)
        time.sleep(0.3)
        assert len(forwards) == stopped < 800
    finally:
        hook.remove()
    assert_serving(url)


def test_a_client_gone_mid_body_is_a_disconnect_not_an_error(server, caplog):
    """Counted as a client that went away (499), logged in one line, with no 500 and no traceback."""
    url = server[0]
    u = urlsplit(url)
    before = {status: metric(url, "chat", status) for status in (499, 500)}
    head = (
        f"POST {CHAT} HTTP/1.1\r\nHost: {u.hostname}\r\nAuthorization: Bearer {KEY}\r\n"
        "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
    )
    with caplog.at_level("INFO", logger="bdstack.server"):
        with socket.create_connection((u.hostname, u.port)) as sock:
            sock.sendall(head.encode() + b'{"messages": [')  # then gone, 986 bytes short
        deadline = time.monotonic() + 10
        while metric(url, "chat", 499) == before[499] and time.monotonic() < deadline:
            time.sleep(0.05)
    assert metric(url, "chat", 499) == before[499] + 1 and metric(url, "chat", 500) == before[500]
    mine = [r for r in caplog.records if r.name == "bdstack.server"]
    assert mine and all(r.levelname == "INFO" and not r.exc_info for r in mine), [r.getMessage() for r in mine]
    assert_serving(url)


@contextlib.contextmanager
def header_timed(app, seconds):
    """`app` served as serve.py serves it (run.uvicorn_config), with a header timeout of `seconds`."""
    import uvicorn

    from inference.server.run import uvicorn_config

    port = _free_port()
    srv = uvicorn.Server(uvicorn_config(app, host="127.0.0.1", port=port, header_timeout=seconds, log_level="error"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    while not srv.started:
        time.sleep(0.02)
    try:
        yield port
    finally:
        srv.should_exit = True
        thread.join(timeout=10)


def test_a_connection_without_a_whole_request_head_is_closed_in_time(server):
    """Issue 54: a client that connected and sent nothing, or part of a request head, was held for 65 s and
    more. Now closed the header timeout after connecting or after its last reply, however it dribbles; a
    keep-alive connection, a slow body and a stream longer than the timeout are untouched."""
    url, app, loaded = server
    head = f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
    with header_timed(app, 0.5) as port:

        def closed_after(parts, pause=0.0) -> float:
            with socket.create_connection(("127.0.0.1", port)) as sock:
                sock.settimeout(5)
                t0 = time.perf_counter()
                with contextlib.suppress(OSError):  # a write after the close
                    for part in parts:
                        sock.sendall(part)
                        time.sleep(pause)
                    assert sock.recv(1) == b""
                return time.perf_counter() - t0

        assert 0.4 < closed_after([]) < 1.5
        assert closed_after([head.encode()]) < 1.5
        assert closed_after([bytes([c]) for c in head.encode()], pause=0.1) < 1.5  # a byte per 0.1 s
        body = json.dumps({"messages": MSG, "max_tokens": 12, "stream": True}).encode()
        hook = loaded.model.register_forward_hook(lambda *_: time.sleep(0.1))  # a reply of over a second
        try:
            with socket.create_connection(("127.0.0.1", port)) as sock:
                sock.settimeout(10)
                sock.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body[:10])
                time.sleep(0.8)  # a slow body: its head came whole
                sock.sendall(body[10:])
                reply = b""
                while not reply.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"):
                    reply += sock.recv(65536)
                time.sleep(0.3)  # keep-alive: the next request may come on the same connection
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                health = b""
                while not health.endswith(b"}"):  # the JSON body's end
                    health += sock.recv(65536)
                assert health.startswith(b"HTTP/1.1 200")
                t0 = time.perf_counter()
                sock.sendall(b"GET /hea")  # part of a head after a reply: closed in its turn
                assert sock.recv(1) == b"" and time.perf_counter() - t0 < 1.5
        finally:
            hook.remove()
        assert b"HTTP/1.1 200" in reply and reply.count(b"data: {") > 3


def test_unknown_paths_and_methods_answer_in_openai_shape(server):
    status, text = call(server[0], "/v1/nope")
    assert status == 404 and "/v1/nope" in error_of(text)["message"]
    status, text = call(server[0], CHAT, method="GET")
    assert status == 405 and error_of(text)["type"] == "invalid_request_error"


@pytest.mark.parametrize("path", ["/metrics", "/docs", "/openapi.json", "/v1/models"])
def test_api_key_guards_every_path_but_health(server, path):
    status, text = call(server[0], path, key=None)
    assert status == 401 and error_of(text)["code"] == "invalid_api_key"
    assert call(server[0], path, key="wrong")[0] == 401
    assert call(server[0], path)[0] == 200
    assert call(server[0], "/health", key=None)[0] == 200


def test_a_request_whose_settings_the_model_cannot_hold_is_400(tmp_path):
    """All-canvases self-spec over a 40-token block is 1600 rows a forward, more than the tiny model's 1024
    positions: a request choosing it is refused by name, before any forward (it used to be decoded)."""
    body = {"model": "tiny", "messages": MSG, "max_tokens": 4, "mode": "self-spec"}
    with running(tiny_checkpoint(tmp_path / "bd40", bd_size=40)) as (url, _app, _loaded):
        status, text = call(url, "/v1/chat/completions", {**body, "self_spec_canvases": "all"}, key=None)
        assert status == 400, text
        error = json.loads(text)["error"]
        assert error["param"] == "self_spec_canvases" and "1600 rows a forward" in error["message"], error
        status, text = call(url, "/v1/chat/completions", {**body, "self_spec_canvases": "last"}, key=None)
        assert status == 200, text
