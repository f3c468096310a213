"""The round-robin router over two native replicas: alternation, streaming pass-through, a dead replica."""

import json
import urllib.request

import pytest
from openai import OpenAI

from benchmark.serving.router import create_router
from tests.conftest import native_server, serve_app
from tests.tiny import tiny_checkpoint

pytestmark = pytest.mark.e2e  # a whole program, server or long sweep: `pytest -m 'not e2e'` skips it


def _served(url):
    text = urllib.request.urlopen(url + "/metrics").read().decode()
    return sum(float(line.split()[1]) for line in text.splitlines() if line.startswith("bdstack_requests_total"))


def test_router_alternates_and_streams(tmp_path):
    ckpt = tiny_checkpoint(tmp_path / "ckpt", bd_size=4)
    with native_server(ckpt, mode="causal") as (a, _), native_server(ckpt, mode="causal") as (b, _):
        router = create_router([a, b])
        with serve_app(router) as url:
            client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
            msgs = [{"role": "user", "content": "Copy: xyz"}]
            outs = [
                client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8).choices[0].message.content
                for _ in range(4)
            ]
            assert len(set(outs)) == 1, "both replicas serve the same weights greedily"
            streamed = "".join(
                c.choices[0].delta.content or ""
                for c in client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, stream=True)
                if c.choices
            )
            assert streamed == outs[0]
            assert _served(a) == 3 and _served(b) == 2
            assert json.loads(urllib.request.urlopen(url + "/health").read())["status"] == "ok"
            assert [m.id for m in client.models.list().data] == ["tiny"]


def test_unreachable_replica_is_a_502_and_the_next_one_serves(tmp_path):
    ckpt = tiny_checkpoint(tmp_path / "ckpt", bd_size=4)
    with native_server(ckpt, mode="causal") as (a, _):
        with serve_app(create_router(["http://127.0.0.1:9", a])) as url:
            req = urllib.request.Request(
                url + "/v1/chat/completions",
                method="POST",
                data=json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}).encode(),
                headers={"Content-Type": "application/json"},
            )
            try:
                urllib.request.urlopen(req)
                raise AssertionError("expected a 502")
            except urllib.error.HTTPError as e:
                assert e.code == 502 and json.loads(e.read())["error"]["code"] == "bad_gateway"
            with urllib.request.urlopen(req) as r:
                assert json.loads(r.read())["choices"][0]["finish_reason"] in ("stop", "length")
