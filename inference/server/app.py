"""The FastAPI app: shared state, the API key middleware, OpenAI-shaped error handlers and the routes.

Concurrent requests are batched into shared forwards by the scheduler (up to `max_batch` in flight, dense
and hybrid models alike). What a generation route does lives in generation.py."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from bdcore.loading import LoadedModel
from inference.native.engine import DecodeConfig
from inference.server.generation import handle
from inference.server.prometheus import ServerMetrics
from inference.server.protocol import APIError, internal_error
from inference.server.request_checks import RequireKey
from inference.server.responses import now
from inference.server.state import ServerState
from inference.server_defaults import SERVER

log = logging.getLogger("bdstack.server")


def create_app(
    loaded: LoadedModel,
    decode: DecodeConfig,
    *,
    model_name: str,
    api_key: str | None = None,
    default_max_tokens: int = SERVER.max_tokens,
    max_batch: int = SERVER.max_batch,
    max_request_bytes: int = SERVER.max_request_bytes,
    allow_client_chat_template: bool = False,
    chat_template_timeout: float = SERVER.chat_template_timeout_s,
    compiled: bool = False,
) -> FastAPI:
    state = ServerState.build(
        loaded,
        decode,
        model_name=model_name,
        default_max_tokens=default_max_tokens,
        max_batch=max_batch,
        max_request_bytes=max_request_bytes,
        allow_client_chat_template=allow_client_chat_template,
        chat_template_timeout=chat_template_timeout,
        compiled=compiled,
    )
    if state.chars_per_token is None:
        log.warning(
            "this tokenizer's pipeline may drop text or fold a run of any length into one token, so prompts "
            "too long for the context are refused only after they are tokenised whole (inference/server/"
            "prompt_bound.py); the body limit (--max-request-bytes) is all that bounds their cost"
        )
    app = FastAPI(title="bdstack", version="0.1.0")
    app.state.server = state
    # the parts tests and operators reach for by name
    app.state.engine, app.state.metrics, app.state.scheduler = state.engine, state.metrics, state.scheduler
    app.state.workers = state.workers
    if api_key:
        app.add_middleware(RequireKey, key=api_key)
    _add_error_handlers(app, state.metrics)
    _add_routes(app, state)
    return app


def _add_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
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


def _add_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health")
    async def health():
        return {"status": "ok", "model": state.model_name, "mode": state.decode.mode}

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [{"id": state.model_name, "object": "model", "created": now(), "owned_by": "bdstack"}],
        }

    @app.get("/metrics")
    async def prometheus():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await handle(state, "chat", request)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(state, "completion", request)
