"""Tool calls in the Hermes / Qwen format: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

Qwen2.5/Qwen3/Qwen3.5 and many fine-tunes emit this when `tools` are in the chat template. The parser
turns each block into an OpenAI `tool_calls` entry and leaves the rest of the text as content. A block
counts as a call only when it is a JSON object with a string `name` and object `arguments` (or a JSON
string that decodes to one), so every `arguments` handed to a client is a JSON object's text.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from inference.server.protocol import ToolRequest

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*(?:" + re.escape(CLOSE) + r"|$)", re.DOTALL)


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """Return (content without the tool-call blocks, or None if empty; OpenAI tool_calls)."""
    calls, spans = [], []
    for m in _BLOCK.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except json.JSONDecodeError:
            continue  # not a call: leave the text as it is
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                continue
        if not isinstance(args, dict):
            continue
        spans.append(m.span())
        calls.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)},
            }
        )
    if not calls:
        return text, []
    kept, at = [], 0
    for start, end in spans:  # only the blocks that were calls leave the content
        kept.append(text[at:start])
        at = end
    content = "".join([*kept, text[at:]]).strip()
    return (content or None), calls


def split_calls(text: str, tools: ToolRequest) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a finished reply; no calls unless the request's tools allow them, and
    one at most when it turned parallel calls off."""
    if not tools.parse:
        return text, []
    content, calls = parse_tool_calls(text)
    return content, (calls if tools.parallel else calls[:1])


def content_before_tool_call(text: str) -> str:
    """The part of a growing reply that is surely content (streaming holds back a possible call)."""
    at = text.find(OPEN)
    if at >= 0:
        return text[:at]
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):  # a partial "<tool_c" at the end
        if text.endswith(OPEN[:n]):
            return text[:-n]
    return text


def forced_prefix(choice: str, name: str | None = None) -> str:
    """Text the reply is made to start with so that it opens a call: `tool_choice` "required" opens a
    `<tool_call>` block, a named function also fixes its name (as chat templates render past calls).
    The model writes the rest; the prefix is part of the prompt, and is put back before parsing."""
    if choice == "required":
        return OPEN + "\n"
    if choice == "function":
        return OPEN + "\n" + '{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": '
    return ""
