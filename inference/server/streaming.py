"""A streamed reply as server-sent events.

The request decodes in a worker thread; its text deltas cross to the event loop through an asyncio queue.
Text goes out as it is decoded, except what may be the start of a tool call: that is held back until the
reply ends, then sent as `tool_calls` (or as content, if it was no call after all). A client that goes
away stops the decode at its next token and is counted as 499."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Iterator
from functools import partial
from typing import TYPE_CHECKING

from inference.native.engine import Cancelled, Generation
from inference.server.protocol import CLIENT_CLOSED, ToolRequest, internal_error
from inference.server.responses import ReplyBuilder, logprobs_field, usage
from inference.server.token_text import TokenText
from inference.server.tool_calls import content_before_tool_call, split_calls

if TYPE_CHECKING:
    from inference.server.prepare import PreparedRequest
    from inference.server.state import ServerState

log = logging.getLogger("bdstack.server")


class HoldBack:
    """Splits a growing reply into what can be streamed now and what waits for the end."""

    def __init__(self, prefix: str, tools: ToolRequest):
        self.prefix, self.tools = prefix, tools
        self.text, self.sent = prefix, 0  # the forced prefix opens a call: it is held back like one

    def add(self, delta: str) -> str:
        """The text that is now surely content and was not sent yet."""
        self.text += delta
        safe = self.text
        if self.tools.parse:
            # whitespace before a call is not content (a whole reply's content is stripped around its
            # calls): it waits for the next text, so that the stream's content equals the whole reply's
            safe = content_before_tool_call(self.text).rstrip()
        if len(safe) <= self.sent:
            return ""
        out, self.sent = safe[self.sent :], len(safe)
        return out

    def finish(self, gen: Generation) -> tuple[list[dict], str]:
        """The deltas still owed once the reply is complete, and its finish reason."""
        full = self.prefix + gen.text
        content, calls = split_calls(full, self.tools)
        if not calls:  # held-back text that was no call after all
            return ([{"content": full[self.sent :]}] if len(full) > self.sent else []), gen.finish_reason
        deltas = []
        head = full[: self.sent].strip()  # content already streamed, before the first call
        if content and content.startswith(head) and len(content) > len(head):
            deltas.append({"content": content[len(head) :]})  # text after the calls, held back with them
        deltas.append({"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]})
        return deltas, "tool_calls"


async def sse_events(state: ServerState, req: PreparedRequest, reply: ReplyBuilder, t0: float) -> AsyncIterator[str]:
    loop, queue, cancel = asyncio.get_running_loop(), asyncio.Queue(), threading.Event()
    status = CLIENT_CLOSED  # until the reply is complete
    try:
        post = partial(loop.call_soon_threadsafe, queue.put_nowait)  # from the worker thread to this loop
        task = state.start(lambda: _decode(state, req, cancel, post))
        yield _sse(reply.chunk({"role": "assistant", "content": ""}))
        held, scores = HoldBack(req.prefix, req.tools), PendingLogprobs(req.kind, state.loaded.tokenizer)
        while (event := await queue.get())[0] in ("text", "logprobs"):
            if event[0] == "logprobs":
                scores.add(event[1])
            elif delta := held.add(event[1]):
                yield _sse(reply.chunk({"content": delta}, logprobs=scores.take()))
        kind, item = event
        if kind == "done":
            for payload in _closing_chunks(req, reply, held, item, scores):
                yield _sse(payload)
            state.metrics.record(
                req.kind,
                req.decode.mode,
                200,
                prompt_tokens=len(req.prompt_ids),
                stats=item.stats,
                latency=time.perf_counter() - t0,
            )
            status = 200
        elif kind == "error":
            status = 500
            log.error("%s generation failed", req.kind, exc_info=item)
            yield _sse(internal_error().body())
        await task
        yield "data: [DONE]\n\n"
    finally:
        cancel.set()  # client gone (or finished): stop the worker at its next token
        if status != 200:
            state.metrics.record(req.kind, req.decode.mode, status)


def _decode(state: ServerState, req: PreparedRequest, cancel: threading.Event, post) -> None:
    """The worker thread: every outcome, a fault included, reaches the stream as a (kind, item) event."""
    try:
        gen = state.scheduler.generate(
            req.prompt_ids,
            req.params,
            req.decode,
            cancel=cancel,
            on_text=lambda d: post(("text", d)),
            on_logprobs=lambda entries: post(("logprobs", entries)),
        )
        post(("done", gen))
    except Cancelled:
        post(("cancelled", None))
    except Exception as e:  # surfaced to the client as a final error event
        post(("error", e))


class PendingLogprobs:
    """Answer-token log-probabilities decoded but not sent yet: they ride on the next content chunk (the
    tokens run ahead of the text while a stop string or tool call may be forming; a token whose character
    is still incomplete waits for the token that completes it)."""

    def __init__(self, kind: str, tokenizer):
        self.kind, self.text = kind, TokenText(tokenizer)

    def add(self, entries) -> None:
        self.text.add(entries)

    def take(self, final: bool = False) -> dict | None:
        pieces = self.text.take(final)
        return logprobs_field(self.kind, pieces) if pieces else None


def _closing_chunks(
    req: PreparedRequest, reply: ReplyBuilder, held: HoldBack, gen: Generation, scores: PendingLogprobs
) -> Iterator[dict]:
    deltas, finish = held.finish(gen)
    for delta in deltas:
        yield reply.chunk(delta, logprobs=scores.take())
    yield reply.chunk({}, finish, logprobs=scores.take(final=True))
    if req.include_usage:
        yield reply.usage_chunk(usage(len(req.prompt_ids), gen.stats))


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"
