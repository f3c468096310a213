"""The reply shapes of /v1/chat/completions and /v1/completions, whole or as stream chunks.

The two endpoints share one envelope (id, object, created, model, choices, usage); they differ only in
the object names and in how a choice carries its text (a chat `message` / `delta`, a completion `text`)."""

from __future__ import annotations

import time
import uuid

_OBJECTS = {"chat": ("chat.completion", "chat.completion.chunk"), "completion": ("text_completion", "text_completion")}
_ID_PREFIXES = {"chat": "chatcmpl", "completion": "cmpl"}


class ReplyBuilder:
    """The bodies of one reply; every chunk of a stream carries the same id and creation time."""

    def __init__(self, kind: str, model: str):
        self.kind, self.model = kind, model
        self.id, self.created = new_id(_ID_PREFIXES[kind]), now()
        self._whole, self._chunk = _OBJECTS[kind]

    def full(self, content: str | None, calls: list[dict], finish: str, usage: dict) -> dict:
        if self.kind == "chat":
            message = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = calls
            choice = {"index": 0, "message": message, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": content, "finish_reason": finish}
        return self._envelope(self._whole, [choice], usage=usage)

    def chunk(self, delta: dict, finish: str | None = None) -> dict:
        """`delta` in the chat form ({"role", "content", "tool_calls"}); completions carry its content."""
        if self.kind == "chat":
            choice = {"index": 0, "delta": delta, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": delta.get("content", ""), "finish_reason": finish}
        return self._envelope(self._chunk, [choice])

    def usage_chunk(self, usage: dict) -> dict:
        return self._envelope(self._chunk, [], usage=usage)

    def _envelope(self, obj: str, choices: list[dict], **extra) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices, **extra}


def usage(prompt_tokens: int, stats) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": stats.generated,
        "total_tokens": prompt_tokens + stats.generated,
        "forwards": stats.forwards,
        "tokens_per_forward": round(stats.tokens_per_forward, 4),
    }


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())
