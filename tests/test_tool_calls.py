"""Tool-call parsing (Hermes / Qwen format) and the streaming hold-back."""

import json

from inference.tool_calls import content_before_tool_call, parse_tool_calls


def test_parse_one_and_several_calls():
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content == "Let me check."
    assert calls[0]["type"] == "function" and calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    two = (
        '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n'
        '<tool_call>{"name": "b", "arguments": "{\\"x\\": 1}"}</tool_call>'
    )
    content, calls = parse_tool_calls(two)
    assert content is None and [c["function"]["name"] for c in calls] == ["a", "b"]
    assert calls[1]["function"]["arguments"] == '{"x": 1}' and calls[0]["id"] != calls[1]["id"]


def test_unterminated_and_malformed_blocks():
    _, calls = parse_tool_calls('<tool_call>{"name": "f", "arguments": {"q": 1}}')  # cut by max_tokens/stop
    assert calls and calls[0]["function"]["name"] == "f"
    text = "<tool_call>not json</tool_call> plain"
    assert parse_tool_calls(text) == (text, [])
    assert parse_tool_calls("no calls here") == ("no calls here", [])


def test_streaming_holds_back_a_possible_call():
    assert content_before_tool_call("Hello <tool_c") == "Hello "
    assert content_before_tool_call('Hi <tool_call>{"na') == "Hi "
    assert content_before_tool_call("plain text <b>") == "plain text <b>"
