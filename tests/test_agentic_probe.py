"""Agentic harness compatibility: the probe against the native server (tiny random checkpoint with a
Hermes tool template), tool_choice / parallel_tool_calls / response_format / history normalisation, a
multi-turn tool-call round trip through the openai client, and the harness config generators."""

import json
import threading

import pytest
from openai import OpenAI

from benchmark.agentic import probe
from benchmark.agentic.probe_cases import ASK, SYSTEM, TOOLS
from inference.native.engine import Generation
from tests.conftest import native_server
from tests.tiny import tiny_checkpoint

pytestmark = pytest.mark.e2e  # a whole program, server or long sweep: `pytest -m 'not e2e'` skips it

# A ChatML template with Hermes tool calls, written for these tests (Qwen-style layout): tools in the
# system turn, past calls as <tool_call> blocks whose arguments are rendered with tojson, tool results
# as <tool_response> blocks in a user turn.
HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n<tools>\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>\n"
    'Call a function with <tool_call>\n{"name": <name>, "arguments": <object>}\n</tool_call><|im_end|>\n'
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' and loop.first %}"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- elif m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content }}"
    "{%- if m.tool_calls is defined %}{% for c in m.tool_calls %}<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\n</tool_call>'
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def hermes_checkpoint(directory):
    """The tiny random checkpoint with the Hermes template and a 4096-token context (tool schemas are
    long in a character-level tokenizer)."""
    from transformers import AutoTokenizer

    tiny_checkpoint(directory, bd_size=4)
    tok = AutoTokenizer.from_pretrained(directory)
    tok.chat_template = HERMES_TEMPLATE
    tok.save_pretrained(directory)
    cfg = json.loads((directory / "config.json").read_text())
    cfg["max_position_embeddings"] = 4096
    (directory / "config.json").write_text(json.dumps(cfg))
    return directory


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with native_server(hermes_checkpoint(tmp_path_factory.mktemp("hermes")), max_tokens=16) as srv:
        yield srv


class Scripted:
    """Stands in for the scheduler's generate: replies with the next scripted text (streamed piece by piece
    through on_text, as the engine does) and records the decoded prompts."""

    def __init__(self, tokenizer, replies):
        self.tok, self.replies, self.prompts = tokenizer, list(replies), []
        self.lock = threading.Lock()

    def __call__(self, prompt_ids, params, decode=None, *, on_text=None, cancel=None, on_logprobs=None):
        with self.lock:
            self.prompts.append(self.tok.decode(prompt_ids))
            text = self.replies.pop(0)
        if on_text is not None:
            for i in range(0, len(text), 5):
                on_text(text[i : i + 5])
        return Generation(self.tok.encode(text, add_special_tokens=False), text, "stop")


@pytest.fixture
def scripted(server, monkeypatch):
    state = server[1].state

    def install(*replies):
        fake = Scripted(state.engine.loaded.tokenizer, replies)
        monkeypatch.setattr(state.scheduler, "generate", fake)
        return fake

    return install


def test_probe_every_shape_is_accepted_by_the_native_server(server):
    results = probe.run_probe(server[0] + "/v1", "tiny", max_tokens=8)
    assert [r.case.name for r in results if not r.ok] == [], probe.table(results)
    assert len(results) == len(probe.cases(8)) >= 20


def test_probe_with_scripted_tool_calls_sees_openai_tool_calls(server, scripted):
    n = len(probe.cases(8))
    # every request gets a reply with two calls of its first tool; "required"/named replies continue the
    # forced prefix
    replies = []
    for c in probe.cases(8):
        name = c.body["tools"][0]["function"]["name"] if c.body.get("tools") else "get_weather"
        call = "<tool_call>\n" + json.dumps({"name": name, "arguments": {"city": "Paris"}}) + "\n</tool_call>"
        if c.check.get("name"):
            replies.append('{"city": "Paris"}}\n</tool_call>')
        elif c.check.get("forced"):
            replies.append(call[len("<tool_call>\n") :])
        elif c.path != "/models":
            replies.append(call + "\n" + call.replace("Paris", "Rome"))
    scripted(*replies)
    results = {r.case.name: r for r in probe.run_probe(server[0] + "/v1", "tiny", max_tokens=8, require_calls=True)}
    assert all(r.ok for r in results.values()), probe.table(list(results.values()))
    assert len(results) == n
    assert results["tools, tool_choice auto"].calls == 2
    assert results["stream with tools"].calls == 2
    assert results["tools, tool_choice none"].calls == 0  # text comes back as content
    assert results["parallel_tool_calls false"].calls == 1
    assert results["tools, tool_choice required"].calls == 1
    assert results["tools, tool_choice named"].calls == 1
    assert results["stream, tool_choice required"].calls == 1
    assert results["Korean system, user and tool schemas"].calls == 2
    assert results["history: call with no result, no content key"].calls == 2


def test_probe_reports_a_server_that_breaks_the_shape(server, scripted):
    # a reply whose arguments are not an object is not a call: it stays text, finish_reason "stop"
    scripted('<tool_call>{"name": "get_weather", "arguments": [1, 2]}</tool_call>')
    case = next(c for c in probe.cases(8) if c.name == "tools, tool_choice auto")
    r = probe.run_case(server[0] + "/v1", "tiny", case)
    assert r.ok and r.calls == 0
    # a wrong model name is a rejection, reported with the server's message
    r = probe.run_case(server[0] + "/v1", "other", case)
    assert not r.ok and "HTTP 404" in r.detail
    # nothing listening
    r = probe.run_case("http://127.0.0.1:9/v1", "tiny", case, timeout=5)
    assert not r.ok and "request failed" in r.detail


def test_probe_cli_prints_a_table_and_writes_json(server, tmp_path, capsys):
    out = tmp_path / "probe.json"
    rc = probe.main(["--base-url", server[0] + "/v1", "--model", "tiny", "--max-tokens", "4", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0 and "| case | used by | result |" in text and " failed" in text
    rows = json.loads(out.read_text())
    assert all(r["ok"] for r in rows) and {r["case"] for r in rows} >= {"models", "stream with tools"}


def test_multi_turn_tool_round_trip_through_the_openai_client(server, scripted):
    fake = scripted(
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
        "</tool_call>",
        "It is 18 degrees and clear in Paris.",
    )
    client = OpenAI(base_url=server[0] + "/v1", api_key="x", max_retries=0)
    messages = [SYSTEM, ASK]
    first = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, tool_choice="auto")
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {
        "city": "Paris",
        "unit": "celsius",
    }
    # the harness's next turn: the assistant message as the SDK returns it, then the tool's result
    messages += [
        choice.message.model_dump(exclude_none=False),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18}'},
    ]
    second = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS)
    assert second.choices[0].finish_reason == "stop"
    assert second.choices[0].message.content == "It is 18 degrees and clear in Paris."
    assert not second.choices[0].message.tool_calls
    prompt = fake.prompts[1]
    # the past call is rendered once, with its arguments as an object (not a JSON string re-encoded)
    assert '"arguments": {"city": "Paris", "unit": "celsius"}' in prompt
    assert '<tool_response>\n{"temperature": 18}\n</tool_response>' in prompt
    assert '"name": "search_flights"' in prompt  # the tools are in the system turn
    assert prompt.endswith("<|im_start|>assistant\n")


def test_tool_choice_forcing_none_and_validation(server, scripted):
    client = OpenAI(base_url=server[0] + "/v1", api_key="x", max_retries=0)
    fake = scripted('{"city": "Oslo"}}\n</tool_call>', "plain", '"search_flights", "arguments": {}}')
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model="tiny", messages=[ASK], tools=TOOLS, tool_choice=named)
    assert r.choices[0].message.tool_calls[0].function.name == "get_weather"
    assert fake.prompts[0].endswith('<tool_call>\n{"name": "get_weather", "arguments": ')
    r = client.chat.completions.create(model="tiny", messages=[ASK], tools=TOOLS, tool_choice="none")
    assert r.choices[0].message.content == "plain" and "<tools>" not in fake.prompts[1]
    r = client.chat.completions.create(model="tiny", messages=[ASK], tools=TOOLS, tool_choice="required")
    assert fake.prompts[2].endswith("<tool_call>\n")
    # the model's continuation did not complete a call: the text (forced prefix included) is content
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content.startswith("<tool_call>")
    bad = [
        {"tool_choice": "sometimes"},
        {"tool_choice": {"type": "function", "function": {"name": "nope"}}},
        {"tool_choice": "required", "tools": None},
        {"tools": [{"type": "function", "function": {"description": "no name"}}]},
        {"tools": {"type": "function"}},
        {"parallel_tool_calls": "yes"},
        {"logprobs": "yes"},
        {"top_logprobs": 2},  # needs logprobs: true
        {"response_format": {"type": "xml"}},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
    ]
    for extra in bad:
        body = {"model": "tiny", "messages": [ASK], "tools": TOOLS, **extra}
        if body["tools"] is None:
            del body["tools"]
        status, text = _post(server[0], body)
        assert status == 400 and json.loads(text)["error"]["message"], extra


def test_response_format_becomes_a_system_instruction(server, scripted):
    fake = scripted('{"answer": "4"}', '{"a": 1}')
    client = OpenAI(base_url=server[0] + "/v1", api_key="x", max_retries=0)
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}}
    r = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "system", "content": "Be exact."}, {"role": "user", "content": "2+2?"}],
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
    )
    assert json.loads(r.choices[0].message.content) == {"answer": "4"}
    assert fake.prompts[0].startswith("<|im_start|>system\nBe exact.\n\nReply with one valid JSON object")
    assert json.dumps(schema) in fake.prompts[0]
    client.chat.completions.create(model="tiny", messages=[ASK], response_format={"type": "json_object"})
    assert fake.prompts[1].startswith("<|im_start|>system\nReply with one valid JSON object")


def test_streamed_tool_call_keeps_surrounding_text(server, scripted):
    scripted('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\nDone.')
    client = OpenAI(base_url=server[0] + "/v1", api_key="x", max_retries=0)
    chunks = list(client.chat.completions.create(model="tiny", messages=[ASK], tools=TOOLS, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert text == "Checking.\n\nDone."  # the whole reply's content: the text around the call, stripped
    assert [tc.function.name for tc in calls] == ["get_weather"]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_context_overflow_uses_openai_wording_and_default_max_tokens_fits(server):
    long = [{"role": "user", "content": "x" * 5000}]
    status, text = _post(server[0], {"model": "tiny", "messages": long})
    err = json.loads(text)["error"]
    assert status == 400 and err["code"] == "context_length_exceeded"
    assert err["message"].startswith("This model's maximum context length is 4096 tokens")
    # no max_tokens given: the default shrinks to what is left of the context instead of failing
    near = [{"role": "user", "content": "x" * 4050}]
    status, text = _post(server[0], {"model": "tiny", "messages": near, "mode": "causal"})
    assert status == 200, text
    assert json.loads(text)["usage"]["total_tokens"] <= 4096


def _post(url, body):
    import urllib.error
    import urllib.request

    req = urllib.request.Request(
        url + "/v1/chat/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


# -- BFCL wrapper (the configs configure.py writes: tests/test_agentic_configure.py) -------------------


def test_bfcl_run_prints_its_entries_without_bfcl(capsys):
    from benchmark.agentic import bfcl_run

    assert (
        bfcl_run.main(["--base-url", "http://h:1/v1", "--served-model", "m", "--checkpoint", "/ck", "--print-config"])
        == 0
    )
    cfg = json.loads(capsys.readouterr().out)
    assert cfg["env"]["OPENAI_BASE_URL"] == cfg["env"]["REMOTE_OPENAI_BASE_URL"] == "http://h:1/v1"
    fc, qwen = cfg["models"]["bdstack-FC"], cfg["models"]["bdstack-qwen-FC"]
    assert fc["model_name"] == "m" and fc["is_fc_model"] and fc["underscore_to_dot"]
    assert fc["model_handler"].endswith("openai_completion.OpenAICompletionsHandler")
    assert qwen["model_name"] == "/ck" and qwen["model_handler"].endswith("qwen_fc.QwenFCHandler")


def test_bfcl_run_registers_models_and_hands_over_to_bfcl_cli(monkeypatch):
    """A stand-in bfcl_eval package (same module layout and names): the wrapper must add ModelConfig
    entries with the handler classes, set the client environment, and pass BFCL's arguments through."""
    import dataclasses
    import sys
    import types

    from benchmark.agentic import bfcl_run

    @dataclasses.dataclass
    class ModelConfig:
        model_name: str
        display_name: str
        url: str
        org: str
        license: str
        model_handler: type
        input_price: float | None = None
        output_price: float | None = None
        is_fc_model: bool = True
        underscore_to_dot: bool = False

    class OpenAICompletionsHandler: ...

    class QwenFCHandler: ...

    seen = {}
    mods = {
        "bfcl_eval": {},
        "bfcl_eval.constants": {},
        "bfcl_eval.constants.model_config": {"MODEL_CONFIG_MAPPING": {}, "ModelConfig": ModelConfig},
        "bfcl_eval.model_handler": {},
        "bfcl_eval.model_handler.api_inference": {},
        "bfcl_eval.model_handler.api_inference.openai_completion": {
            "OpenAICompletionsHandler": OpenAICompletionsHandler
        },
        "bfcl_eval.model_handler.local_inference": {},
        "bfcl_eval.model_handler.local_inference.qwen_fc": {"QwenFCHandler": QwenFCHandler},
        "bfcl_eval.__main__": {
            "cli": lambda args, prog_name: seen.update(args=args, env=dict(__import__("os").environ))
        },
    }
    for name, attrs in mods.items():
        mod = types.ModuleType(name)
        mod.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, mod)
    for key in ("OPENAI_BASE_URL", "OPENAI_API_KEY", "REMOTE_OPENAI_BASE_URL", "REMOTE_OPENAI_API_KEY"):
        monkeypatch.delenv(key, raising=False)
    bfcl_run.main(["--base-url", "http://h:2/v1", "--served-model", "m", "--checkpoint", "/ck",
                   "generate", "--model", "bdstack-FC", "--test-category", "simple_python"])  # fmt: skip
    table = mods["bfcl_eval.constants.model_config"]["MODEL_CONFIG_MAPPING"]
    assert table["bdstack-FC"].model_handler is OpenAICompletionsHandler and table["bdstack-FC"].model_name == "m"
    assert table["bdstack-qwen-FC"].model_handler is QwenFCHandler and table["bdstack-qwen-FC"].model_name == "/ck"
    assert seen["args"] == ["generate", "--model", "bdstack-FC", "--test-category", "simple_python"]
    assert seen["env"]["OPENAI_BASE_URL"] == "http://h:2/v1" and seen["env"]["REMOTE_OPENAI_API_KEY"] == "EMPTY"


@pytest.mark.parametrize("module", ["probe", "configure", "bfcl_run"])
def test_every_adapter_answers_help(module):
    import subprocess
    import sys

    from tests.conftest import REPO

    r = subprocess.run(
        [sys.executable, "-m", f"benchmark.agentic.{module}", "--help"], cwd=REPO, capture_output=True, text=True
    )
    assert r.returncode == 0 and "usage:" in r.stdout
