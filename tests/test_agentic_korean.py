"""Korean through the native server end to end, on a byte-level tokenizer that splits every Hangul syllable
over byte tokens: Korean system, user and tool descriptions reach the prompt whole; a reply with Korean
text and a call with Korean arguments comes back parsed, whole and streamed; the logprob token strings
concatenate to the reply; past calls (Hangul kept, as FunctionChat-Bench sends them, or \\uXXXX-escaped,
as Ko-AgentBench does) are rendered as Korean objects. The replies are scripted token by token through
the engine's real text output: a random model would not write Korean."""

import json

import pytest
from openai import OpenAI

from benchmark.agentic.probe_korean import KO_ASK, KO_SYSTEM, KO_TOOLS, ko_call
from tests import real_tokenizers
from tests.conftest import native_server
from tests.test_agentic_probe import HERMES_TEMPLATE
from tests.test_logprob_text import post, scripted
from tests.tiny import tiny_checkpoint

pytestmark = pytest.mark.e2e

TEXT = "치과 예약을 3월 11일에 추가할게요."
ARGS = {"title": "치과 예약", "date": "2025-03-11"}
CALL_REPLY = TEXT + "\n<tool_call>\n" + json.dumps({"name": "add_schedule", "arguments": ARGS}, ensure_ascii=False)
CALL_REPLY += "\n</tool_call>"
ASK = {"messages": [KO_SYSTEM, KO_ASK], "tools": KO_TOOLS, "temperature": 0.1, "max_tokens": 512}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A tiny checkpoint with a byte-level BPE trained on English only, and the Hermes tool template."""
    directory = tmp_path_factory.mktemp("korean")
    tok = real_tokenizers.byte_level()
    tok.chat_template = HERMES_TEMPLATE
    tiny_checkpoint(directory, tokenizer=tok)
    cfg = json.loads((directory / "config.json").read_text())
    cfg["max_position_embeddings"] = 16384  # three tokens a syllable: the tool schemas are long
    (directory / "config.json").write_text(json.dumps(cfg))
    with native_server(directory, mode="causal", max_tokens=512) as srv:  # FunctionChat sends no max_tokens
        yield srv


@pytest.fixture
def reply(server, monkeypatch):
    """Script the next replies; returns the decoded prompts the server built."""
    loaded = server[1].state.engine.loaded
    prompts = []

    def install(text: str):
        ids = loaded.tokenizer(text, add_special_tokens=False)["input_ids"]
        assert any("\ufffd" in loaded.tokenizer.decode([t]) for t in ids)  # Hangul split over byte tokens
        emit = scripted(loaded, ids)

        def generate(prompt_ids, *args, **kwargs):
            prompts.append(loaded.tokenizer.decode(prompt_ids))
            return emit(prompt_ids, *args, **kwargs)

        monkeypatch.setattr(server[1].state.scheduler, "generate", generate)
        return prompts

    return install


def test_korean_call_comes_back_parsed_with_logprobs_that_tile_the_reply(server, reply):
    prompts = reply(CALL_REPLY)
    r = post(server[0], "/v1/chat/completions", {**ASK, "logprobs": True})["choices"][0]
    assert r["finish_reason"] == "tool_calls" and r["message"]["content"] == TEXT
    (call,) = r["message"]["tool_calls"]
    assert call["function"]["name"] == "add_schedule" and json.loads(call["function"]["arguments"]) == ARGS
    assert "치과 예약" in call["function"]["arguments"]  # Hangul as itself, not \uXXXX
    tokens = r["logprobs"]["content"]
    assert "".join(t["token"] for t in tokens) == CALL_REPLY  # the whole reply: content, then the call
    assert b"".join(bytes(t["bytes"]) for t in tokens) == CALL_REPLY.encode()
    assert "\ufffd" not in "".join(t["token"] for t in tokens)
    # the prompt holds the Korean system text, question and tool descriptions whole
    for text in (KO_SYSTEM["content"], KO_ASK["content"], "캘린더에 새 일정을 추가한다.", '"한식"'):
        assert text in prompts[0], text


def test_korean_call_streamed(server, reply):
    reply(CALL_REPLY)
    chunks = post(server[0], "/v1/chat/completions", {**ASK, "logprobs": True, "stream": True})
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    deltas = [c["delta"].get("content") or "" for c in choices]
    assert "".join(deltas) == TEXT and not any("\ufffd" in d for d in deltas)
    calls = [tc for c in choices for tc in c["delta"].get("tool_calls") or []]
    assert [tc["function"]["name"] for tc in calls] == ["add_schedule"]
    assert json.loads(calls[0]["function"]["arguments"]) == ARGS
    assert choices[-1]["finish_reason"] == "tool_calls"
    tokens = [t["token"] for c in choices if c.get("logprobs") for t in c["logprobs"]["content"]]
    assert "".join(tokens) == CALL_REPLY


def test_korean_answer_after_tool_results_of_both_harnesses(server, reply):
    """A FunctionChat-Bench dialog turn (call id reused, tool message with `name`) and a Ko-AgentBench one
    (arguments and results escaped by json.dumps): the answer's logprobs concatenate to its content."""
    answer = "강남역 근처 한식집 세 곳과 엔화 환율을 정리했어요."
    prompts = reply(answer)
    history = [
        KO_SYSTEM,
        KO_ASK,
        {"role": "assistant", "content": None, "tool_calls": [ko_call("random_id", "add_schedule", ARGS)]},
        {"role": "tool", "tool_call_id": "random_id", "name": "add_schedule", "content": "{'ok': True}"},
        {"role": "user", "content": "강남역 한식집이랑 엔화 환율도 알려 줘."},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                ko_call("c1", "search_restaurant", {"region": "강남역", "cuisine": "한식"}, ascii_only=True),
                ko_call("c2", "exchange_rate", {"base": "KRW", "target": "JPY"}, ascii_only=True),
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": json.dumps({"이름": ["한정식 다온"]})},
        {"role": "tool", "tool_call_id": "c2", "content": json.dumps({"rate": 0.103})},
    ]
    body = {**ASK, "messages": history, "tool_choice": "auto", "logprobs": True}
    r = post(server[0], "/v1/chat/completions", body)["choices"][0]
    assert r["finish_reason"] == "stop" and r["message"]["content"] == answer
    assert "".join(t["token"] for t in r["logprobs"]["content"]) == answer
    chunks = [c["choices"][0] for c in post(server[0], "/v1/chat/completions", {**body, "stream": True})]
    assert "".join(c["delta"].get("content") or "" for c in chunks if c) == answer
    # past calls rendered as objects with Hangul, whichever way their arguments were escaped
    assert '"arguments": {"title": "치과 예약", "date": "2025-03-11"}' in prompts[0]
    assert '"arguments": {"region": "강남역", "cuisine": "한식"}' in prompts[0]
    assert prompts[0].count("<tool_response>") == 3


def test_functionchat_reads_the_call_back_through_the_openai_sdk(server, reply):
    """FunctionChat-Bench's `inhouse` route: create(model, temperature, messages, tools, timeout=30), then
    model_dump()["choices"][0]["message"], then json.loads of the first call's arguments."""
    reply(CALL_REPLY)
    client = OpenAI(base_url=server[0] + "/v1", api_key="inhouse", max_retries=0)
    assert [m.id for m in client.models.list()] == ["tiny"]
    response = client.chat.completions.create(
        model="tiny", temperature=0.1, messages=ASK["messages"], tools=KO_TOOLS, timeout=30
    )
    message = response.model_dump()["choices"][0]["message"]
    assert message["content"] == TEXT
    function = message["tool_calls"][0]["function"]
    assert function["name"] == "add_schedule" and json.loads(function["arguments"]) == ARGS
