"""Tool calls in the Hermes / Qwen format: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

Qwen2.5/Qwen3/Qwen3.5 and many fine-tunes emit this when `tools` are in the chat template. The parser
turns each block into an OpenAI `tool_calls` entry and leaves the rest of the text as content.
"""

from __future__ import annotations

import json
import re
import uuid

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*(?:" + re.escape(CLOSE) + r"|$)", re.DOTALL)


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """Return (content without the tool-call blocks, or None if empty; OpenAI tool_calls)."""
    calls = []
    for m in _BLOCK.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except json.JSONDecodeError:
            continue  # not a call: leave the text as it is
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        calls.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": obj["name"], "arguments": args if isinstance(args, str) else json.dumps(args)},
            }
        )
    if not calls:
        return text, []
    content = _BLOCK.sub("", text).strip()
    return (content or None), calls


def content_before_tool_call(text: str) -> str:
    """The part of a growing reply that is surely content (streaming holds back a possible call)."""
    at = text.find(OPEN)
    if at >= 0:
        return text[:at]
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):  # a partial "<tool_c" at the end
        if text.endswith(OPEN[:n]):
            return text[:-n]
    return text
