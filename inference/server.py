"""OpenAI-compatible HTTP server over the native engine (FastAPI + uvicorn).

Concurrent requests are batched into shared forwards by `scheduler.py` (dense models, up to
`max_batch` in flight; hybrids decode one at a time). Each request waits in a worker thread;
streaming deltas cross to the event loop through an asyncio queue. A client that disconnects cancels
its request at the next token, streamed or not. Chat templates and tokenizers run in a thread pool too,
so one long prompt does not stall the event loop (health probes, other requests). Requests are checked
by `request_checks.py` first: size, API key, field types; errors are OpenAI-shaped, 5xx without detail.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from inference.metrics import ServerMetrics
from inference.native.engine import Cancelled, DecodeConfig, Engine
from inference.native.loading import CheckpointError, LoadedModel
from inference.native.scheduler import Scheduler
from inference.protocol import (
    APIError,
    ToolRequest,
    chat_prompt_ids,
    completion_prompt_ids,
    new_id,
    now,
    sampling_params,
    tool_request,
    usage,
)
from inference.request_checks import DEFAULT_MAX_REQUEST_BYTES, RequireKey, check_body, include_usage, read_json
from inference.tool_calls import content_before_tool_call, forced_prefix, parse_tool_calls

log = logging.getLogger("bdstack.server")
DISCONNECT_POLL_S = 0.1  # how soon an abandoned non-streaming request is noticed
CLIENT_CLOSED = 499  # nginx's status for a request whose client went away (counted in /metrics)


def internal_error() -> APIError:
    """What a client sees of a server fault: no exception text (it can carry paths and internals)."""
    return APIError(500, "internal error", type="server_error")


def create_app(
    loaded: LoadedModel,
    decode: DecodeConfig,
    *,
    model_name: str,
    api_key: str | None = None,
    default_max_tokens: int = 512,
    max_batch: int = 8,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    allow_client_chat_template: bool = False,
) -> FastAPI:
    engine = Engine(loaded, decode)
    scheduler = Scheduler(engine, max_batch)
    metrics = ServerMetrics()
    max_context = getattr(loaded.model.config, "max_position_embeddings", None) or 1 << 30
    app = FastAPI(title="bdstack", version="0.1.0")
    app.state.engine, app.state.metrics, app.state.scheduler = engine, metrics, scheduler
    if api_key:
        app.add_middleware(RequireKey, key=api_key)

    @app.exception_handler(APIError)
    async def _api_error(_request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):  # unknown path, wrong method
        err = APIError(exc.status_code, f"{exc.detail} ({request.method} {request.url.path})")
        return JSONResponse(err.body(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        metrics.record("other", "-", 500)
        return JSONResponse(internal_error().body(), status_code=500)

    def request_decode(body: dict) -> DecodeConfig:
        mode = body.get("mode", decode.mode)  # extension: per-request decode mode
        try:
            loaded.check_mode(mode)
        except CheckpointError as e:
            raise APIError(400, str(e), param="mode") from e
        return replace(decode, mode=mode)

    # Each in-flight request blocks a thread until it ends; asyncio's default pool holds cores + 4 threads
    # (6 on a 2-core machine), which would cap the scheduler's batch below --max-batch. Queued requests
    # hold threads too, so the pool has room beyond the batch.
    workers = ThreadPoolExecutor(max_workers=max(64, 4 * max_batch), thread_name_prefix="bdstack-request")
    app.state.workers = workers

    async def start(fn) -> asyncio.Future:
        """Run `fn` in a worker thread (the scheduler decides what runs together)."""
        return asyncio.get_running_loop().run_in_executor(workers, fn)

    def prompt(kind: str, body: dict, tools: ToolRequest) -> tuple[list[int], str]:
        """Prompt ids and forced reply prefix (runs in the thread pool: templates and tokenizers are slow
        on long prompts, and a client template, where allowed, runs as long as it likes)."""
        tok = loaded.tokenizer
        ids = chat_prompt_ids(tok, body, tools) if kind == "chat" else completion_prompt_ids(tok, body)
        # tool_choice "required" / a named function: the reply is made to open a call (see forced_prefix)
        prefix = forced_prefix(tools.choice, tools.name) if tools.parse else ""
        if prefix:
            ids = ids + tok(prefix, add_special_tokens=False)["input_ids"]
        return ids, prefix

    async def run(
        kind: str, body: dict, prompt_ids: list[int], prefix: str, build, request: Request, tools: ToolRequest
    ):
        room = max_context - len(prompt_ids)
        if room < 1:
            raise APIError(
                400,
                f"This model's maximum context length is {max_context} tokens. However, your messages resulted "
                f"in {len(prompt_ids)} tokens. Please reduce the length of the messages.",
                param="messages",
                code="context_length_exceeded",
            )
        # without an explicit max_tokens the reply may use the rest of the context, up to the default
        params = sampling_params(body, default_max_tokens=min(default_max_tokens, room))
        dec = request_decode(body)
        if params.max_tokens > room:
            raise APIError(
                400,
                # OpenAI's wording: clients (LiteLLM, the openai SDK's users) recognise it as a context overflow
                f"This model's maximum context length is {max_context} tokens. However, you requested "
                f"{len(prompt_ids) + params.max_tokens} tokens ({len(prompt_ids)} in the messages, "
                f"{params.max_tokens} in the completion). Please reduce the length of the messages or completion.",
                param="messages",
                code="context_length_exceeded",
            )
        rid, created, t0 = new_id("chatcmpl" if kind == "chat" else "cmpl"), now(), time.perf_counter()

        def split_calls(text: str) -> tuple[str | None, list[dict]]:
            """(content, tool_calls) of a finished reply; no calls unless the request's tools allow them."""
            if not tools.parse:
                return text, []
            content, calls = parse_tool_calls(text)
            return content, (calls if tools.parallel else calls[:1])

        if not body.get("stream"):
            cancel = threading.Event()
            task = await start(lambda: scheduler.generate(prompt_ids, params, dec, cancel=cancel))
            try:
                while not (await asyncio.wait({task}, timeout=DISCONNECT_POLL_S))[0]:
                    if await request.is_disconnected():
                        cancel.set()  # nobody will read the reply: free the batch slot at the next token
                gen = task.result()
            except Cancelled:
                metrics.record(kind, dec.mode, CLIENT_CLOSED)
                return Response(status_code=CLIENT_CLOSED)
            finally:
                cancel.set()  # this handler itself was cancelled (server shutdown): stop the worker too
            metrics.record(
                kind, dec.mode, 200, prompt_tokens=len(prompt_ids), stats=gen.stats, latency=time.perf_counter() - t0
            )
            body_out = build.full(rid, created, gen, usage(len(prompt_ids), gen.stats))
            if kind == "chat":
                content, calls = split_calls(prefix + gen.text)
                choice = body_out["choices"][0]
                choice["message"]["content"] = content
                if calls:
                    choice["message"]["tool_calls"] = calls
                    choice["finish_reason"] = "tool_calls"
            return JSONResponse(body_out)
        with_usage = include_usage(body)
        loop, queue, cancel = asyncio.get_running_loop(), asyncio.Queue(), threading.Event()

        def worker():
            try:
                gen = scheduler.generate(
                    prompt_ids,
                    params,
                    dec,
                    cancel=cancel,
                    on_text=lambda d: loop.call_soon_threadsafe(queue.put_nowait, ("text", d)),
                )
                loop.call_soon_threadsafe(queue.put_nowait, ("done", gen))
            except Cancelled:
                loop.call_soon_threadsafe(queue.put_nowait, ("cancelled", None))
            except Exception as e:  # surfaced to the client as a final error event
                loop.call_soon_threadsafe(queue.put_nowait, ("error", e))

        async def events():
            status = CLIENT_CLOSED  # until the reply is complete
            try:
                task = await start(worker)
                yield _sse(build.chunk(rid, created, {"role": "assistant", "content": ""}, None))
                text, sent = prefix, 0  # with tools, a possible <tool_call> block is held back
                while True:
                    kind_, item = await queue.get()
                    if kind_ == "text":
                        text += item
                        safe = content_before_tool_call(text) if tools.parse else text
                        if len(safe) > sent:
                            yield _sse(build.chunk(rid, created, {"content": safe[sent:]}, None))
                            sent = len(safe)
                        continue
                    if kind_ == "done":
                        finish, full = item.finish_reason, prefix + item.text
                        content, calls = split_calls(full) if kind == "chat" else (full, [])
                        if calls:
                            head = full[:sent].strip()  # content already streamed, before the first call
                            if content and content.startswith(head) and len(content) > len(head):
                                # text after the calls, held back with them
                                yield _sse(build.chunk(rid, created, {"content": content[len(head) :]}, None))
                            deltas = [{"index": i, **c} for i, c in enumerate(calls)]
                            yield _sse(build.chunk(rid, created, {"tool_calls": deltas}, None))
                            finish = "tool_calls"
                        elif len(full) > sent:  # held-back text that was no call after all
                            yield _sse(build.chunk(rid, created, {"content": full[sent:]}, None))
                        yield _sse(build.chunk(rid, created, {}, finish))
                        if with_usage:
                            yield _sse(build.usage_chunk(rid, created, usage(len(prompt_ids), item.stats)))
                        metrics.record(
                            kind,
                            dec.mode,
                            200,
                            prompt_tokens=len(prompt_ids),
                            stats=item.stats,
                            latency=time.perf_counter() - t0,
                        )
                        status = 200
                    elif kind_ == "error":
                        status = 500
                        log.error("%s generation failed", kind, exc_info=item)
                        yield _sse(internal_error().body())
                    break
                await task
                yield "data: [DONE]\n\n"
            finally:
                cancel.set()  # client gone (or finished): stop the worker at its next token
                if status != 200:
                    metrics.record(kind, dec.mode, status)

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model_name, "mode": decode.mode}

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [{"id": model_name, "object": "model", "created": now(), "owned_by": "bdstack"}],
        }

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(dict(scheduler.batch_sizes)), media_type="text/plain; version=0.0.4")

    async def serve(kind: str, request: Request, build):
        try:
            body = await read_json(request, max_request_bytes)
            check_body(body, kind, model_name=model_name, allow_chat_template=allow_client_chat_template)
            tools = tool_request(body) if kind == "chat" else ToolRequest()
            prompt_ids, prefix = await run_in_threadpool(prompt, kind, body, tools)
            return await run(kind, body, prompt_ids, prefix, build, request, tools)
        except APIError as e:
            metrics.record(kind, "-", e.status)
            raise
        except Exception:
            log.exception("%s request failed", kind)
            metrics.record(kind, "-", 500)
            raise internal_error() from None

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await serve("chat", request, _Chat(model_name))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await serve("completion", request, _Completion(model_name))

    return app


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


class _Chat:
    def __init__(self, model: str):
        self.model = model

    def full(self, rid, created, gen, u):
        return {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": self.model,
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": gen.text}, "finish_reason": gen.finish_reason}
            ],
            "usage": u,
        }

    def chunk(self, rid, created, delta, finish):
        return {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": self.model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        }

    def usage_chunk(self, rid, created, u):
        return {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": self.model,
            "choices": [],
            "usage": u,
        }


class _Completion(_Chat):
    def full(self, rid, created, gen, u):
        return {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": self.model,
            "choices": [{"index": 0, "text": gen.text, "finish_reason": gen.finish_reason}],
            "usage": u,
        }

    def chunk(self, rid, created, delta, finish):
        return {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": self.model,
            "choices": [{"index": 0, "text": delta.get("content", ""), "finish_reason": finish}],
        }

    def usage_chunk(self, rid, created, u):
        return {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": self.model,
            "choices": [],
            "usage": u,
        }
