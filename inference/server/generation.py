"""One POST to /v1/chat/completions or /v1/completions, from request to response.

The request is prepared (prepare.py), then decoded in a request thread while the scheduler batches it
with others. A whole reply comes back as JSON, a streamed one as SSE (streaming.py). A client that
disconnects cancels its request at the next token, streamed or not. Every outcome is counted in /metrics;
a fault surfaces as an opaque 500 (its detail goes to the log only)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from bdcore.decode.sequence import DecodeStats
from inference.native.engine import Cancelled
from inference.server.prepare import PreparedRequest, prepare
from inference.server.protocol import CLIENT_CLOSED, APIError, internal_error
from inference.server.responses import ReplyBuilder, answer_logprobs, usage
from inference.server.streaming import sse_events
from inference.server.tool_calls import split_calls

if TYPE_CHECKING:
    from inference.server.state import ServerState

log = logging.getLogger("bdstack.server")
DISCONNECT_POLL_S = 0.1  # how soon an abandoned non-streaming request is noticed


async def handle(state: ServerState, kind: str, request: Request) -> Response:
    try:
        req = await prepare(state, kind, request)
        reply, t0 = ReplyBuilder(kind, state.model_name), time.perf_counter()
        if req.stream:
            return StreamingResponse(sse_events(state, req, reply, t0), media_type="text/event-stream")
        return await reply_in_full(state, req, request, reply, t0)
    except APIError as e:
        state.metrics.record(kind, "-", e.status)
        raise
    except ClientDisconnect:  # gone before its body was whole: nothing failed here, and nobody reads a reply
        log.info("%s request: the client disconnected before sending its whole body", kind)
        state.metrics.record(kind, "-", CLIENT_CLOSED)
        return Response(status_code=CLIENT_CLOSED)
    except Exception:
        log.exception("%s request failed", kind)
        state.metrics.record(kind, "-", 500)
        raise internal_error() from None


async def reply_in_full(
    state: ServerState, req: PreparedRequest, request: Request, reply: ReplyBuilder, t0: float
) -> Response:
    """The whole reply: one choice per prompt (completions may send several), decoded side by side."""
    cancel = threading.Event()
    tasks = [
        state.start(lambda ids=ids: state.scheduler.generate(ids, req.params, req.decode, cancel=cancel))
        for ids in req.prompts
    ]
    try:
        while (await asyncio.wait(tasks, timeout=DISCONNECT_POLL_S))[1]:
            if await request.is_disconnected():
                cancel.set()  # nobody will read the reply: free the batch slots at the next token
        gens = [task.result() for task in tasks]
    except Cancelled:
        state.metrics.record(req.kind, req.decode.mode, CLIENT_CLOSED)
        return Response(status_code=CLIENT_CLOSED)
    finally:
        cancel.set()  # this handler itself was cancelled (server shutdown), or a prompt failed: stop the rest
    n_prompt = sum(map(len, req.prompts))
    stats = DecodeStats(  # the choices' together (each counts the forwards it took part in)
        generated=sum(g.stats.generated for g in gens),
        forwards=sum(g.stats.forwards for g in gens),
        accepted=sum((g.stats.accepted for g in gens), Counter()),
        drafted=sum((g.stats.drafted for g in gens), Counter()),
    )
    latency = time.perf_counter() - t0
    state.metrics.record(req.kind, req.decode.mode, 200, prompt_tokens=n_prompt, stats=stats, latency=latency)
    choices = []
    for i, gen in enumerate(gens):
        content, calls = split_calls(req.prefix + gen.text, req.tools)
        finish = "tool_calls" if calls else gen.finish_reason
        logprobs = None if gen.logprobs is None else answer_logprobs(req.kind, gen.logprobs, state.loaded.tokenizer)
        choices.append(reply.choice(i, content, calls, finish, logprobs))
    return JSONResponse(reply.full(choices, usage(n_prompt, stats)))
