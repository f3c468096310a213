"""/v1/completions takes a prompt as OpenAI and vLLM do: a string, a list of token ids, or a list of either
(one choice per prompt, by index); ids are checked against the vocabulary and `<|mask|>`, and every bad
shape is a 400 in OpenAI's shape that names the problem."""

import json
import urllib.error
import urllib.request

import pytest

from tests.conftest import native_server
from tests.tiny import tiny_checkpoint

pytestmark = pytest.mark.e2e  # a whole program, server or long sweep: `pytest -m 'not e2e'` skips it


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with native_server(tiny_checkpoint(tmp_path_factory.mktemp("ckpt")), mode="causal", max_tokens=6) as srv:
        yield srv


def post(url, body):
    req = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            text = r.read().decode()
            status = r.status
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
    if body.get("stream"):
        return status, [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    return status, json.loads(text)


def ids_of(server, text):
    return server[1].state.engine.loaded.tokenizer(text, add_special_tokens=False)["input_ids"]


def test_a_prompt_of_token_ids_is_served_like_its_text(server):
    url = server[0]
    _, by_text = post(url, {"prompt": "Copy: abc", "logprobs": 1})
    status, by_ids = post(url, {"prompt": ids_of(server, "Copy: abc"), "logprobs": 1})
    assert status == 200, by_ids
    assert by_ids["choices"][0]["text"] == by_text["choices"][0]["text"]
    assert by_ids["choices"][0]["logprobs"] == by_text["choices"][0]["logprobs"]
    assert by_ids["usage"]["prompt_tokens"] == by_text["usage"]["prompt_tokens"] == len(ids_of(server, "Copy: abc"))
    status, chunks = post(url, {"prompt": ids_of(server, "Copy: abc"), "stream": True})
    assert (
        status == 200
        and "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == (by_text["choices"][0]["text"])
    )


@pytest.mark.parametrize("as_ids", [True, False], ids=["token-id lists", "strings"])
def test_a_list_of_prompts_gets_one_choice_each(server, as_ids):
    url, texts = server[0], ["Copy: abc", "Copy: 0", "Hi"]
    alone = [post(url, {"prompt": t, "logprobs": 0})[1] for t in texts]
    prompt = [ids_of(server, t) for t in texts] if as_ids else texts
    status, reply = post(url, {"prompt": prompt, "logprobs": 0})
    assert status == 200, reply
    assert [c["index"] for c in reply["choices"]] == [0, 1, 2]
    for choice, one in zip(reply["choices"], alone):  # batched forwards: log-probabilities equal to rounding
        one = one["choices"][0]
        assert (choice["text"], choice["finish_reason"]) == (one["text"], one["finish_reason"])
        got, want = choice["logprobs"], one["logprobs"]
        assert (got["tokens"], got["text_offset"]) == (want["tokens"], want["text_offset"])
        assert got["token_logprobs"] == pytest.approx(want["token_logprobs"], abs=1e-5)
    for key in ("prompt_tokens", "completion_tokens", "total_tokens", "forwards"):
        assert reply["usage"][key] == sum(one["usage"][key] for one in alone), key


def test_bad_prompts_are_refused_with_the_reason(server):
    url, loaded = server[0], server[1].state.engine.loaded
    n, mask = len(loaded.tokenizer), loaded.mask_id
    cases = [
        ([1, n], f"prompt[1] is {n}"),
        ([-1], "prompt[0] is -1"),
        ([1, mask], "<|mask|>"),
        ([[1, 2], [3, mask]], "prompt[1][1]"),
        ([True, 2], "token ids"),
        ([1.0, 2], "token ids"),
        ([], "non-empty"),
        ([[]], "prompt[0] is empty"),
        (["a", ""], "prompt[1] is empty"),
        (["a", 1], "token ids"),
        ([[[1]]], "token ids"),
        ({"text": "a"}, "string"),
        ([[1]] * 129, "at most 128 prompts"),
    ]
    for prompt, says in cases:
        status, reply = post(url, {"prompt": prompt})
        err = reply["error"]
        assert status == 400 and err["param"] == "prompt" and err["type"] == "invalid_request_error", (prompt, reply)
        assert says in err["message"], (prompt, err["message"])
    status, reply = post(url, {"prompt": [[1, 2], [3]], "stream": True})
    assert status == 400 and "stream" in reply["error"]["message"] and "one prompt" in reply["error"]["message"]
    assert post(url, {"prompt": [5] * 1000, "max_tokens": 2})[0] == 200


@pytest.mark.parametrize(
    "body",
    [{"prompt": [5] * 1024}, {"prompt": "a" * 1030}, {"prompt": ["a", [5] * 1000], "max_tokens": 100}],
    ids=["ids", "text", "with the reply"],
)
def test_a_prompt_too_long_for_the_context_is_named_prompt(server, body):
    status, reply = post(server[0], body)
    err = reply["error"]
    assert status == 400 and err["code"] == "context_length_exceeded", reply
    assert err["param"] == "prompt" and "prompt" in err["message"] and "messages" not in err["message"], err


def test_prompts_are_bounded_before_any_is_tokenised(server, monkeypatch):
    """A request of many long prompts costs no tokenising when one is too long by its length, and no more
    than the first too long in tokens (128 prompts of 25.8k characters took 8.5 s to refuse)."""
    url, state = server[0], server[1].state.server
    tok_type, calls = type(state.loaded.tokenizer), []
    real = tok_type.__call__
    monkeypatch.setattr(
        tok_type, "__call__", lambda self, text, *a, **k: calls.append(text) or real(self, text, *a, **k)
    )
    too_long = "a" * (state.max_context * state.chars_per_token)
    status, reply = post(url, {"prompt": ["ab"] * 127 + [too_long]})
    assert status == 400 and reply["error"]["code"] == "context_length_exceeded", reply
    assert calls == []
    monkeypatch.setattr(state, "chars_per_token", None)  # past the bound's reach: refused by the token count
    status, reply = post(url, {"prompt": ["a" * (state.max_context + 10)] * 8})
    assert status == 400 and reply["error"]["code"] == "context_length_exceeded", reply
    assert len(calls) == 1


def post_chat(url, content):
    req = urllib.request.Request(
        url + "/v1/chat/completions",
        json.dumps({"messages": [{"role": "user", "content": content}]}).encode(),
        {"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_text_that_spells_the_mask_token_is_refused_like_its_id(server):
    """One rule on every route (docs/design.md 8.20): no prompt holds <|mask|>, sent as an id or spelled."""
    url, mask = server[0], server[1].state.engine.loaded.mask_id
    cases = [
        ({"prompt": "Copy: <|mask|>"}, "prompt", "prompt spells <|mask|>"),
        ({"prompt": ["Hi", "a<|mask|>b"]}, "prompt", "prompt[1] spells <|mask|>"),
        ({"prompt": [5, mask]}, "prompt", "prompt[1] is the <|mask|> token"),
        ({"prompt": [[5], [6, 7, mask]]}, "prompt", "prompt[1][2] is the <|mask|> token"),
    ]
    for body, param, says in cases:
        status, reply = post(url, body)
        assert status == 400 and reply["error"]["param"] == param and says in reply["error"]["message"], reply
    status, reply = post_chat(url, "Copy: <|mask|>")
    assert status == 400 and reply["error"]["param"] == "messages" and "<|mask|>" in reply["error"]["message"]
    assert post(url, {"prompt": "Copy: <|mask", "max_tokens": 2})[0] == 200  # not the token's spelling
