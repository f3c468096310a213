"""Tool-call parsing (Hermes / Qwen format) and the streaming hold-back."""

import json

from inference.server.tool_calls import content_before_tool_call, parse_tool_calls


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


def test_arguments_must_be_an_object_and_only_calls_leave_the_content():
    from inference.server.tool_calls import forced_prefix

    text = (
        '<tool_call>{"name": "a", "arguments": [1]}</tool_call>'  # arguments not an object: text
        '<tool_call>{"name": "b", "arguments": "not json"}</tool_call>'  # string that is no JSON: text
        '<tool_call>{"name": "c", "arguments": "{\\"k\\": \\"é\\"}"}</tool_call>'  # JSON object as a string: call
    )
    content, calls = parse_tool_calls(text)
    assert [c["function"]["name"] for c in calls] == ["c"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"k": "é"}
    assert content.startswith('<tool_call>{"name": "a"') and '"b"' in content and '"c"' not in content
    assert forced_prefix("auto") == forced_prefix("none") == ""
    assert forced_prefix("required") == "<tool_call>\n"
    named = forced_prefix("function", "get_weather")
    assert named == '<tool_call>\n{"name": "get_weather", "arguments": '
    assert parse_tool_calls(named + '{"city": "Oslo"}}\n</tool_call>')[1][0]["function"]["name"] == "get_weather"


def test_messages_are_normalised_for_chat_templates():
    import pytest

    from inference.server.protocol import APIError, template_messages, tool_request

    body = [
        {"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "user", "content": "hi", "name": None},
        {
            "role": "assistant",
            "content": None,
            "refusal": None,
            "tool_calls": [{"id": "1", "function": {"name": "f", "arguments": '{"x": 1}'}}],
        },
        {"role": "assistant", "content": "ok", "tool_calls": None},
        {"role": "tool", "tool_call_id": "1", "content": "r"},
    ]
    out = template_messages(body)
    assert out[0] == {"role": "system", "content": "a\nb"}
    assert out[1] == {"role": "user", "content": "hi"}
    assert out[2] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}],
    }
    assert "tool_calls" not in out[3] and out[4]["tool_call_id"] == "1"
    assert body[2]["tool_calls"][0]["function"]["arguments"] == '{"x": 1}'  # the request is not modified
    with pytest.raises(APIError):
        template_messages([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert tool_request({}).choice == "none" and not tool_request({}).parse
    assert tool_request({"tools": tools}).choice == "auto" and tool_request({"tools": tools}).parse
    req = tool_request({"tools": tools, "tool_choice": {"type": "function", "function": {"name": "f"}}})
    assert (req.choice, req.name, req.parallel) == ("function", "f", True)
    assert not tool_request({"tools": tools, "tool_choice": "none"}).parse
    assert not tool_request({"tools": tools, "parallel_tool_calls": False}).parallel
