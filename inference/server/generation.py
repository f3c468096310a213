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
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

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
    except Exception:
        log.exception("%s request failed", kind)
        state.metrics.record(kind, "-", 500)
        raise internal_error() from None


async def reply_in_full(
    state: ServerState, req: PreparedRequest, request: Request, reply: ReplyBuilder, t0: float
) -> Response:
    cancel = threading.Event()
    task = state.start(lambda: state.scheduler.generate(req.prompt_ids, req.params, req.decode, cancel=cancel))
    try:
        while not (await asyncio.wait({task}, timeout=DISCONNECT_POLL_S))[0]:
            if await request.is_disconnected():
                cancel.set()  # nobody will read the reply: free the batch slot at the next token
        gen = task.result()
    except Cancelled:
        state.metrics.record(req.kind, req.decode.mode, CLIENT_CLOSED)
        return Response(status_code=CLIENT_CLOSED)
    finally:
        cancel.set()  # this handler itself was cancelled (server shutdown): stop the worker too
    n_prompt = len(req.prompt_ids)
    latency = time.perf_counter() - t0
    state.metrics.record(req.kind, req.decode.mode, 200, prompt_tokens=n_prompt, stats=gen.stats, latency=latency)
    content, calls = split_calls(req.prefix + gen.text, req.tools)
    finish = "tool_calls" if calls else gen.finish_reason
    logprobs = None if gen.logprobs is None else answer_logprobs(req.kind, gen.logprobs, state.loaded.tokenizer)
    return JSONResponse(reply.full(content, calls, finish, usage(n_prompt, gen.stats), logprobs))
