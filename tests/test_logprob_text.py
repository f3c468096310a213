"""The token strings and `text_offset` of `logprobs` with real-style tokenizers: the strings concatenate to
the reply's text, offsets are characters of it, a SentencePiece token keeps its leading space, and a
character split over byte tokens goes whole to the token that completes it (whole and streamed, chat and
completions). Streamed content never shows the U+FFFD of a character still incomplete."""

import json
import urllib.request

import pytest

from bdcore.decode.sequence import DecodeStats, TokenLogprob
from inference.native.engine import TextOutput
from inference.server.token_text import TokenText
from tests import real_tokenizers
from tests.conftest import native_server
from tests.tiny import tiny_checkpoint

TOKENIZERS = {"byte-level": real_tokenizers.byte_level, "sentencepiece": real_tokenizers.sentencepiece}
ANSWER = "Hello world, café 한 the end"  # é and 한 are in no merge: they split over byte tokens


@pytest.fixture(scope="module", params=list(TOKENIZERS))
def tok(request):
    return TOKENIZERS[request.param]()


def entries(ids):
    return [TokenLogprob(t, -0.5) for t in ids]


def check_pieces(strings, offsets, text):
    assert "".join(strings) == text
    assert offsets == [len("".join(strings[:i])) for i in range(len(strings))]  # characters, not bytes
    assert all(text[o : o + len(s)] == s for s, o in zip(strings, offsets))
    assert "\ufffd" not in "".join(strings)


def test_pieces_tile_the_text_and_keep_spaces_and_whole_characters(tok):
    ids = tok(ANSWER, add_special_tokens=False)["input_ids"]
    alone = [tok.decode([t]) for t in ids]
    assert "".join(alone) != ANSWER  # what each token decoded alone gives: the defect this pins
    text = TokenText(tok)
    text.add(entries(ids))
    pieces = text.take(final=True)
    strings, offsets = [p.text for p in pieces], [p.offset for p in pieces]
    check_pieces(strings, offsets, ANSWER)
    assert " world" in strings or " world," in strings  # the space of "▁world" / "Ġworld" kept
    assert "é" in strings and "한" in strings  # whole, on the token that completes each
    assert offsets[strings.index(" the")] == ANSWER.index(" the")  # after two multi-byte characters


def test_streamed_pieces_equal_the_whole_ones(tok):
    ids = tok(ANSWER, add_special_tokens=False)["input_ids"]
    whole = TokenText(tok)
    whole.add(entries(ids))
    want = [(p.text, p.offset) for p in whole.take(final=True)]
    for step in (1, 2, 3):
        text, got = TokenText(tok), []
        for i in range(0, len(ids), step):
            text.add(entries(ids[i : i + step]))
            got += [(p.text, p.offset) for p in text.take(final=False)]
        got += [(p.text, p.offset) for p in text.take(final=True)]
        assert got == want, step


def test_completion_top_logprobs_keep_alternatives_whose_strings_collide(tok):
    """Byte tokens that are no character alone all read U+FFFD: completions' `top_logprobs` (a dict by
    token string) keeps each as its own entry, as chat's list does (137 of 166 positions had fewer)."""
    from inference.server.responses import answer_logprobs

    ids = tok("Hi there", add_special_tokens=False)["input_ids"]
    halves = [i for i in range(len(tok)) if tok.decode([i]) == "\ufffd"][:4]
    assert len(halves) == 4
    top = tuple((t, -1.0 - k) for k, t in enumerate([ids[1], *halves]))
    answer = [*entries(ids[:1]), TokenLogprob(ids[1], -1.0, top), *entries(ids[2:])]
    chat = answer_logprobs("chat", answer, tok)["content"][1]["top_logprobs"]
    comp = answer_logprobs("completion", answer, tok)
    got = comp["top_logprobs"][1]
    assert len(got) == len(chat) == 5 and list(got.values()) == [e["logprob"] for e in chat]
    assert comp["tokens"][1] in got and got[comp["tokens"][1]] == -1.0  # the chosen token keeps its string
    assert sorted(k for k in got if k.startswith("token_id:")) == sorted(f"token_id:{t}" for t in halves[1:])


@pytest.fixture(scope="module")
def server(tok, tmp_path_factory):
    with native_server(tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), tokenizer=tok), mode="causal") as srv:
        yield srv


def scripted(loaded, answer: list[int]):
    """The scheduler's `generate`, emitting `answer` token by token through the engine's real text output
    (a random model would rarely split a character); the stop token follows."""

    def generate(prompt_ids, params, decode=None, *, on_text=None, cancel=None, on_logprobs=None):
        out = TextOutput(loaded.tokenizer, params, loaded.stop_ids, DecodeStats(), on_text, cancel, on_logprobs)
        for i, t in enumerate([*answer, loaded.tokenizer.eos_token_id]):
            alt = answer[i - 1] if i else answer[1]
            top = ((t, -0.25), (alt, -2.0))[: params.logprobs or 0]
            if out.push([t], None if params.logprobs is None else [TokenLogprob(t, -0.25, top)]):
                break
        return out.generation()

    return generate


def post(url, path, body):
    req = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        text = r.read().decode()
    if not body.get("stream"):
        return json.loads(text)
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


MSG = [{"role": "user", "content": "Copy: abc"}]


@pytest.mark.e2e
def test_server_logprobs_concatenate_to_the_content(server, tok, monkeypatch):
    url, app = server
    ids = tok(ANSWER, add_special_tokens=False)["input_ids"]
    monkeypatch.setattr(app.state.scheduler, "generate", scripted(app.state.engine.loaded, ids))
    chat = {"messages": MSG, "logprobs": True, "top_logprobs": 2, "max_tokens": 64}
    r = post(url, "/v1/chat/completions", chat)["choices"][0]
    content = r["logprobs"]["content"]
    assert r["message"]["content"] == ANSWER and "".join(c["token"] for c in content) == ANSWER
    assert b"".join(bytes(c["bytes"]) for c in content) == ANSWER.encode()
    assert [c["top_logprobs"][0]["token"] for c in content] == [c["token"] for c in content]
    chunks = [c["choices"][0] for c in post(url, "/v1/chat/completions", {**chat, "stream": True}) if c["choices"]]
    assert "".join(c["delta"].get("content") or "" for c in chunks) == ANSWER
    streamed = [e for c in chunks if c.get("logprobs") for e in c["logprobs"]["content"]]
    assert streamed == content

    comp = {"prompt": "Copy: abc", "logprobs": 1, "max_tokens": 64}
    r = post(url, "/v1/completions", comp)["choices"][0]
    lp = r["logprobs"]
    assert r["text"] == ANSWER
    check_pieces(lp["tokens"], lp["text_offset"], ANSWER)
    assert lp["text_offset"][lp["tokens"].index(" the")] == ANSWER.index(" the")
    chunks = [c["choices"][0] for c in post(url, "/v1/completions", {**comp, "stream": True})]
    assert "".join(c["text"] for c in chunks) == ANSWER
    parts = [c["logprobs"] for c in chunks if c.get("logprobs")]
    assert [t for p in parts for t in p["tokens"]] == lp["tokens"]
    assert [o for p in parts for o in p["text_offset"]] == lp["text_offset"], "offsets run on across chunks"


@pytest.mark.e2e
def test_sampled_replies_of_a_random_model_keep_the_invariant(server):
    """Whatever the model writes (here: random byte tokens, some never forming a character). A stream is
    checked against its own content: a byte-fallback decoder turns an earlier valid byte of a run into
    U+FFFD once a later byte makes the run invalid, and text already streamed cannot be taken back."""
    url, _ = server
    for seed in range(3):
        body = {"prompt": "Copy: abc", "logprobs": 0, "temperature": 1.0, "seed": seed, "max_tokens": 24}
        lp = post(url, "/v1/completions", body)["choices"][0]
        assert "".join(lp["logprobs"]["tokens"]) == lp["text"]
        assert lp["logprobs"]["text_offset"] == [
            len("".join(lp["logprobs"]["tokens"][:i])) for i in range(len(lp["logprobs"]["tokens"]))
        ]
        chunks = [c["choices"][0] for c in post(url, "/v1/completions", {**body, "stream": True})]
        tokens = [t for c in chunks if c.get("logprobs") for t in c["logprobs"]["tokens"]]
        assert "".join(tokens) == "".join(c["text"] for c in chunks) and len(tokens) == len(lp["logprobs"]["tokens"])
