"""What the server checks before any work: body size and JSON, the API key, and each field's type.

Unknown fields are refused rather than ignored (a client that asks for `echo` or `best_of` must learn
that it did not get it), except a few that change nothing about the reply (`user`, `metadata`, ...).
Fields this server does not implement are accepted only with their no-op value.
"""

from __future__ import annotations

import hmac
import json
import re

from fastapi import Request
from fastapi.responses import JSONResponse

from inference.server.protocol import APIError

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # a JSON escape of a UTF-16 half, paired or lone

_COMMON = {
    "model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "top_k", "n", "stop", "seed",
    "logprobs", "mode", "self_spec_canvases",
}  # fmt: skip
_FIELDS = {
    "chat": _COMMON | {
        "messages", "max_completion_tokens", "tools", "tool_choice", "parallel_tool_calls", "response_format",
        "top_logprobs", "chat_template_kwargs", "chat_template",
    },
    "completion": _COMMON | {"prompt"},
}  # fmt: skip
# Bookkeeping fields with no bearing on the reply: accepted when well-typed, then ignored.
_IGNORED = {
    "user": str, "metadata": dict, "store": bool, "service_tier": str, "prompt_cache_key": str,
    "safety_identifier": str,
}  # fmt: skip
# Features this server lacks, by the values that ask for nothing (clients often send these defaults).
_NO_OP = {
    "presence_penalty": (0,), "frequency_penalty": (0,), "logit_bias": ({},), "echo": (False,),
    "best_of": (1,), "suffix": ("",), "modalities": (["text"],),
}  # fmt: skip


def _same(value, default) -> bool:
    if isinstance(default, bool) or isinstance(value, bool):  # True == 1 must not pass for best_of
        return value is default
    if isinstance(default, (int, float)):
        return isinstance(value, (int, float)) and value == default
    return type(value) is type(default) and value == default


def check_body(body: dict, kind: str, *, model_name: str, allow_chat_template: bool) -> None:
    """Refuse unknown fields, mistyped top-level fields and client templates (unless allowed)."""
    for key, value in body.items():
        if key in _NO_OP:
            if value is not None and not any(_same(value, d) for d in _NO_OP[key]):
                raise APIError(400, f"'{key}' is not supported by this server", param=key)
        elif key in _IGNORED:
            if value is not None and not isinstance(value, _IGNORED[key]):
                raise APIError(400, f"'{key}' must be a {_IGNORED[key].__name__}", param=key)
        elif key not in _FIELDS[kind]:
            raise APIError(400, f"Unrecognized request argument supplied: {key}", param=key)
    check_model(body, model_name)
    for key in ("stream", "mode"):
        want = bool if key == "stream" else str
        if body.get(key) is not None and not isinstance(body[key], want):
            raise APIError(400, f"'{key}' must be a {'boolean' if want is bool else 'string'}", param=key)
    options = body.get("stream_options")
    usage_flag = options.get("include_usage") if isinstance(options, dict) else None
    if options is not None and not (isinstance(options, dict) and (usage_flag is None or isinstance(usage_flag, bool))):
        raise APIError(400, "'stream_options' must be an object with a boolean include_usage", param="stream_options")
    kwargs = body.get("chat_template_kwargs")
    for where, holder in (("chat_template", body), ("chat_template_kwargs", kwargs)):
        # a template is code the server runs: it can loop for as long as the client likes
        if not allow_chat_template and isinstance(holder, dict) and holder.get("chat_template") is not None:
            raise APIError(
                400,
                "client-supplied chat templates are disabled on this server (start it with "
                "--allow-client-chat-template to allow them)",
                param=where,
            )


def check_model(body: dict, model_name: str) -> None:
    """The request may name the served model or none; any other name is a 404, as OpenAI answers it."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise APIError(400, "'model' must be a string", param="model")
    if model not in (None, model_name):
        raise APIError(
            404,
            f"model {model!r} does not exist; this server serves {model_name!r}",
            param="model",
            code="model_not_found",
        )


def include_usage(body: dict) -> bool:
    return bool((body.get("stream_options") or {}).get("include_usage"))


def _too_large(limit: int) -> APIError:
    return APIError(413, f"request body exceeds {limit} bytes", code="request_too_large")


async def read_json(request: Request, limit: int) -> dict:
    """The body as a JSON object, read no further than `limit` bytes (the declared length is trusted
    only to refuse early: a chunked body has none)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        # strict UTF-8, as RFC 8259 asks of JSON between systems (a byte-order mark is skipped): json.loads
        # would read UTF-16 and -32 too, and let encoded surrogates through
        body = json.loads(raw.decode("utf-8-sig"))
    # ValueError: also bytes that are no UTF-8, ints past Python's digit limit; RecursionError: deep nesting
    except (ValueError, RecursionError) as e:
        raise APIError(400, f"request body is not valid JSON: {str(e)[:200]}") from None
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object")
    if _SURROGATE_ESCAPE.search(raw):  # only a \u escape can spell one in strict UTF-8
        check_unicode(body)
    return body


def check_unicode(body: dict) -> None:
    """Refuse a string (or key) holding a lone UTF-16 surrogate: JSON may spell one ("\\ud800"), but it is
    no Unicode text, and tokenizers raise on it (which would be a 500). A paired escape is one character."""
    stack = [("", body, None)]
    while stack:  # no recursion: the body may nest as deep as the parser allowed
        where, value, field = stack.pop()
        if isinstance(value, dict):  # its keys are checked before any path below it names them
            texts = value.keys()
            stack += [(f"{where}.{k}" if where else k, v, field or k) for k, v in value.items()]
        elif isinstance(value, list):
            texts = ()
            stack += [(f"{where}[{i}]", v, field) for i, v in enumerate(value)]
        else:
            texts = (value,)
        for text in texts:
            if isinstance(text, str) and not _is_unicode(text):
                raise APIError(
                    400,
                    f"{where or 'a field name'} holds a lone UTF-16 surrogate (a JSON \\ud800-\\udfff escape "
                    "without its pair), which is not Unicode text; send the text as UTF-8, or escape both "
                    "halves of the pair",
                    param=field,
                )


def _is_unicode(s: str) -> bool:
    try:
        s.encode()
    except UnicodeEncodeError:
        return False
    return True


class RequireKey:
    """ASGI middleware: every path but the open ones (health probes) needs 'Authorization: Bearer KEY'.

    It guards /metrics, /docs and /openapi.json too: they tell what is served and how busy it is."""

    def __init__(self, app, key: str, open_paths: tuple[str, ...] = ("/health",)):
        self.app, self.expected, self.open_paths = app, f"Bearer {key}".encode(), open_paths

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            sent = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(sent, self.expected):
                err = APIError(
                    401,
                    "invalid or missing API key (send 'Authorization: Bearer <key>')",
                    type="authentication_error",
                    code="invalid_api_key",
                )
                await JSONResponse(err.body(), status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)
