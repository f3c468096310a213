"""The reply shapes of /v1/chat/completions and /v1/completions, whole or as stream chunks.

The two endpoints share one envelope (id, object, created, model, choices, usage); they differ only in
the object names and in how a choice carries its text (a chat `message` / `delta`, a completion `text`)."""

from __future__ import annotations

import time
import uuid

from inference.server.token_text import TokenPiece, TokenText

_OBJECTS = {"chat": ("chat.completion", "chat.completion.chunk"), "completion": ("text_completion", "text_completion")}
_ID_PREFIXES = {"chat": "chatcmpl", "completion": "cmpl"}


class ReplyBuilder:
    """The bodies of one reply; every chunk of a stream carries the same id and creation time."""

    def __init__(self, kind: str, model: str):
        self.kind, self.model = kind, model
        self.id, self.created = new_id(_ID_PREFIXES[kind]), now()
        self._whole, self._chunk = _OBJECTS[kind]

    def choice(self, index: int, content: str | None, calls: list[dict], finish: str, logprobs=None) -> dict:
        """One choice of a whole reply; `logprobs`: `logprobs_field`'s value for it, or None (not asked for)."""
        if self.kind == "chat":
            message = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = calls
            choice = {"index": index, "message": message, "finish_reason": finish}
        else:
            choice = {"index": index, "text": content, "finish_reason": finish}
        if logprobs is not None:
            choice["logprobs"] = logprobs
        return choice

    def full(self, choices: list[dict], usage: dict) -> dict:
        return self._envelope(self._whole, choices, usage=usage)

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


def logprobs_field(kind: str, pieces: list[TokenPiece]) -> dict:
    """OpenAI's `logprobs` of a choice for answer tokens with their share of the text (token_text.py):
    chat `{"content": [{token, logprob, bytes, top_logprobs}]}`, completions `{tokens, token_logprobs,
    top_logprobs, text_offset}` (offsets in characters of the reply's text)."""
    if kind == "chat":
        content = []
        for p in pieces:
            top = [{"token": s, "logprob": lp, "bytes": list(s.encode())} for s, lp in p.top]
            content.append(
                {"token": p.text, "logprob": p.entry.logprob, "bytes": list(p.text.encode()), "top_logprobs": top}
            )
        return {"content": content}
    return {
        "tokens": [p.text for p in pieces],
        "token_logprobs": [p.entry.logprob for p in pieces],
        "top_logprobs": [_keyed_top(p) for p in pieces],
        "text_offset": [p.offset for p in pieces],
    }


def _keyed_top(piece: TokenPiece) -> dict[str, float]:
    """Completions' `top_logprobs` of one token, a dict by token string. Alternatives may share a string
    (byte tokens that are no character alone all read U+FFFD): the chosen token keeps its string, and an
    alternative whose string is taken is keyed `token_id:<id>` (vLLM's spelling of a token by id), so
    every entry stays, as in chat's list."""
    chosen = piece.entry.token
    ids = [t for t, _ in piece.entry.top]  # the same alternatives, in the same order, as `piece.top`
    taken = {s for t, (s, _) in zip(ids, piece.top) if t == chosen}
    out = {}
    for t, (s, lp) in zip(ids, piece.top):
        if t != chosen and s in taken:
            s = f"token_id:{t}"
        taken.add(s)
        out[s] = lp
    return out


def answer_logprobs(kind: str, entries, tokenizer) -> dict:
    """`logprobs` of a whole reply."""
    text = TokenText(tokenizer)
    text.add(entries)
    return logprobs_field(kind, text.take(final=True))


def usage(prompt_tokens: int, stats) -> dict:
    """OpenAI's usage, plus tokens per forward (every forward); a self-spec reply adds its draft-verify cycles,
    the drafts they accepted and the acceptance length (docs/serving.md)."""
    out = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": stats.generated,
        "total_tokens": prompt_tokens + stats.generated,
        "forwards": stats.forwards,
        "tokens_per_forward": round(stats.tokens_per_forward, 4),
    }
    if stats.verify_steps:
        out["verify_steps"] = stats.verify_steps
        out["accepted_drafts"] = stats.accepted_drafts
        out["acceptance_length"] = round(stats.acceptance_length, 4)
    return out


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())
