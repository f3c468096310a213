"""The request shapes the probe sends (`probe.py`): tools, tool histories and every case, each named
with the harnesses that send it (the Korean harnesses' cases are in probe_korean.py)."""

from __future__ import annotations

from benchmark.agentic.case import Case
from benchmark.agentic.probe_korean import korean_cases

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
FLIGHTS = {
    "type": "function",
    "function": {
        "name": "search_flights",
        "description": "Find flights between two airports.",
        "parameters": {
            "type": "object",
            "properties": {
                "origin": {"type": "string"},
                "destination": {"type": "string"},
                "passengers": {"type": "integer", "minimum": 1},
                "filters": {
                    "type": "object",
                    "properties": {"cabin": {"type": "string", "enum": ["economy", "business"]}},
                },
                "airlines": {"type": "array", "items": {"type": "string"}},
            },
            "required": ["origin", "destination"],
        },
    },
}
TOOLS = [WEATHER, FLIGHTS]
SYSTEM = {"role": "system", "content": "You are a helpful assistant. Use the tools when they help."}
ASK = {"role": "user", "content": "What is the weather in Paris?"}
CALL = {
    "id": "call_0",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
}
CALL2 = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
}


def cases(max_tokens: int) -> list[Case]:
    mt = {"max_tokens": max_tokens}
    tool_history = [
        SYSTEM,
        ASK,
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_0", "content": '{"temperature": 18, "sky": "clear"}'},
    ]
    return [
        Case("models", "BFCL (readiness), SDKs", {}, path="/models", method="GET"),
        Case("chat, system + user", "all", {"messages": [SYSTEM, ASK], **mt}),
        Case(
            "max_completion_tokens",
            "openai SDK >= 1.x clients",
            {"messages": [ASK], "max_completion_tokens": max_tokens},
        ),
        Case("stop sequences", "LiteLLM callers", {"messages": [ASK], "stop": ["\n\n", "Observation:"], **mt}),
        Case(
            "sampling: temperature, top_p, seed",
            "Terminus (temperature 0.7), tau2 (0.0)",
            {"messages": [ASK], "temperature": 0.7, "top_p": 0.95, "seed": 1, **mt},
        ),
        Case("tools, no tool_choice", "mini-swe-agent, BFCL FC", {"messages": [SYSTEM, ASK], "tools": TOOLS, **mt}),
        Case(
            "tools, tool_choice auto",
            "tau2-bench (agent and user)",
            {"messages": [SYSTEM, ASK], "tools": TOOLS, "tool_choice": "auto", **mt},
        ),
        Case(
            "tools, tool_choice none",
            "OpenAI API",
            {"messages": [SYSTEM, ASK], "tools": TOOLS, "tool_choice": "none", **mt},
            check={"no_calls": True},
        ),
        Case(
            "tools, tool_choice required",
            "OpenAI API",
            {"messages": [SYSTEM, ASK], "tools": TOOLS, "tool_choice": "required", **mt},
            check={"forced": True},
        ),
        Case(
            "tools, tool_choice named",
            "OpenAI API",
            {
                "messages": [SYSTEM, ASK],
                "tools": TOOLS,
                "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                **mt,
            },
            check={"forced": True, "name": "get_weather"},
        ),
        Case(
            "parallel_tool_calls true",
            "mini-swe-agent swebench.yaml",
            {"messages": [SYSTEM, ASK], "tools": TOOLS, "parallel_tool_calls": True, **mt},
        ),
        Case(
            "parallel_tool_calls false",
            "OpenAI API",
            {"messages": [SYSTEM, ASK], "tools": TOOLS, "parallel_tool_calls": False, **mt},
            check={"max_calls": 1},
        ),
        Case(
            "history: tool_calls + tool result",
            "tau2-bench, mini-swe-agent, BFCL FC",
            {"messages": tool_history, "tools": TOOLS, **mt},
        ),
        Case(
            "history: two calls, two results",
            "BFCL FC (parallel), mini-swe-agent",
            {
                "messages": [
                    SYSTEM,
                    {"role": "user", "content": "Weather in Paris and Rome?"},
                    {"role": "assistant", "content": "Checking both.", "tool_calls": [CALL, CALL2]},
                    {"role": "tool", "tool_call_id": "call_0", "content": "18 C"},
                    {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
                ],
                "tools": TOOLS,
                **mt,
            },
        ),
        Case(
            "history: tau2 shape (tool_calls null, call name)",
            "tau2-bench",
            {
                "messages": [
                    SYSTEM,
                    ASK,
                    {"role": "assistant", "content": None, "tool_calls": [{**CALL, "name": "get_weather"}]},
                    {"role": "tool", "tool_call_id": "call_0", "content": "18 C"},
                    {"role": "assistant", "content": "It is 18 C.", "tool_calls": None},
                    {"role": "user", "content": "Thanks. And tomorrow?"},
                ],
                "tools": TOOLS,
                "tool_choice": "auto",
                **mt,
            },
        ),
        Case(
            "history: SDK-dumped assistant message",
            "BFCL FC, mini-swe-agent",
            {
                "messages": [
                    ASK,
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [CALL],
                        "refusal": None,
                        "annotations": [],
                        "audio": None,
                        "function_call": None,
                    },
                    {"role": "tool", "tool_call_id": "call_0", "content": "18 C"},
                ],
                "tools": TOOLS,
                "store": False,
                **mt,
            },
        ),
        *korean_cases(max_tokens),
        Case(
            "content as text parts",
            "LiteLLM / multimodal-capable clients",
            {
                "messages": [
                    {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                    {"role": "user", "content": [{"type": "text", "text": "Say hi."}, {"type": "text", "text": "Go."}]},
                ],
                **mt,
            },
        ),
        Case("developer role", "openai SDK (newer models)", {"messages": [{**SYSTEM, "role": "developer"}, ASK], **mt}),
        Case(
            "response_format json_schema",
            "Terminus-1 (via LiteLLM)",
            {
                "messages": [ASK],
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "answer",
                        "schema": {"type": "object", "properties": {"answer": {"type": "string"}}},
                    },
                },
                **mt,
            },
        ),
        Case(
            "response_format json_object",
            "LiteLLM callers",
            {"messages": [ASK], "response_format": {"type": "json_object"}, **mt},
        ),
        Case(
            "extra fields (user, metadata, store)",
            "openai SDK, LiteLLM",
            {"messages": [ASK], "user": "probe", "metadata": {"run": "probe"}, "store": False, **mt},
        ),
        Case(
            "stream, include_usage",
            "LiteLLM streaming callers",
            {"messages": [SYSTEM, ASK], "stream": True, "stream_options": {"include_usage": True}, **mt},
        ),
        Case(
            "stream with tools",
            "streaming agents",
            {"messages": [SYSTEM, ASK], "tools": TOOLS, "stream": True, **mt},
        ),
        Case(
            "stream, tool_choice required",
            "streaming agents",
            {"messages": [SYSTEM, ASK], "tools": TOOLS, "tool_choice": "required", "stream": True, **mt},
            check={"forced": True},
        ),
        Case(
            "completions, raw prompt",
            "BFCL OSS handlers (prompt route)",
            {"prompt": "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n", "temperature": 0.001, **mt},
            path="/completions",
        ),
    ]
