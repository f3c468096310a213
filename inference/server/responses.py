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

    def full(self, content: str | None, calls: list[dict], finish: str, usage: dict, logprobs=None) -> dict:
        """`logprobs`: `logprobs_field`'s value for the whole answer, or None (not asked for)."""
        if self.kind == "chat":
            message = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = calls
            choice = {"index": 0, "message": message, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": content, "finish_reason": finish}
        if logprobs is not None:
            choice["logprobs"] = logprobs
        return self._envelope(self._whole, [choice], usage=usage)

    def chunk(self, delta: dict, finish: str | None = None, logprobs=None) -> dict:
        """`delta` in the chat form ({"role", "content", "tool_calls"}); completions carry its content."""
        if self.kind == "chat":
            choice = {"index": 0, "delta": delta, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": delta.get("content", ""), "finish_reason": finish}
        if logprobs is not None:
            choice["logprobs"] = logprobs
        return self._envelope(self._chunk, [choice])

    def usage_chunk(self, usage: dict) -> dict:
        return self._envelope(self._chunk, [], usage=usage)

    def _envelope(self, obj: str, choices: list[dict], **extra) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices, **extra}


def logprobs_field(kind: str, entries, tokenizer, text_offset: int = 0) -> dict:
    """OpenAI's `logprobs` of a choice for answer-token entries (`bdcore.decode.sequence.TokenLogprob`):
    chat `{"content": [{token, logprob, bytes, top_logprobs}]}`, completions `{tokens, token_logprobs,
    top_logprobs, text_offset}` (offsets count from `text_offset`, the text already sent)."""

    def piece(token_id: int) -> str:  # as the reply's text shows it: special tokens are not shown
        return tokenizer.decode([token_id], skip_special_tokens=True)

    if kind == "chat":
        content = []
        for e in entries:
            text = piece(e.token)
            top = [{"token": piece(t), "logprob": lp, "bytes": list(piece(t).encode())} for t, lp in e.top]
            content.append({"token": text, "logprob": e.logprob, "bytes": list(text.encode()), "top_logprobs": top})
        return {"content": content}
    tokens, offsets, at = [], [], text_offset
    for e in entries:
        tokens.append(piece(e.token))
        offsets.append(at)
        at += len(tokens[-1])
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{piece(t): lp for t, lp in e.top} for e in entries],
        "text_offset": offsets,
    }


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
