"""OpenAI request parsing and validation, response shapes and errors (no web framework here)."""

from __future__ import annotations

import time
import uuid

from inference.sampling import SamplingParams


class APIError(Exception):
    """An OpenAI-style error: the server answers `status` with {"error": {...}} and keeps serving."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _number(body: dict, key: str, kind, default, lo=None, hi=None):
    value = body.get(key, default)
    if value is None:
        return default
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or (kind is int and not float(value).is_integer())
    ):
        raise APIError(400, f"'{key}' must be a {'integer' if kind is int else 'number'}, got {value!r}", param=key)
    value = kind(value)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise APIError(400, f"'{key}' must lie in [{lo}, {hi}], got {value}", param=key)
    return value


def sampling_params(body: dict, *, default_max_tokens: int) -> SamplingParams:
    if _number(body, "n", int, 1) != 1:
        raise APIError(400, "only n=1 is supported", param="n")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    stop = body.get("stop") or ()
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 8:
        raise APIError(400, "'stop' must be a string or a list of up to 8 non-empty strings", param="stop")
    return SamplingParams(
        temperature=_number(body, "temperature", float, 0.0, 0.0, 2.0),
        top_p=_number(body, "top_p", float, 1.0, 1e-6, 1.0),
        top_k=_number(body, "top_k", int, 0, 0, None),
        max_tokens=_number({"max_tokens": max_tokens}, "max_tokens", int, default_max_tokens, 1, None),
        stop=tuple(stop),
        seed=_number(body, "seed", int, None),
    )


def chat_prompt_ids(tokenizer, body: dict) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "'messages' must be a non-empty list", param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool", "developer"):
            raise APIError(400, f"messages[{i}] needs a role of system, user, assistant or tool", param="messages")
        if m.get("content") is not None and not isinstance(m["content"], (str, list)):
            raise APIError(400, f"messages[{i}].content must be a string or a list of parts", param="messages")
    tools = body.get("tools")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise APIError(400, "'chat_template_kwargs' must be an object", param="chat_template_kwargs")
    try:
        text = tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=True, **kwargs
        )
    except Exception as e:
        raise APIError(400, f"the chat template rejected these messages: {e}", param="messages") from e
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def completion_prompt_ids(tokenizer, body: dict) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise APIError(400, "'prompt' must be a non-empty string", param="prompt")
    return tokenizer(prompt, add_special_tokens=False)["input_ids"]


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
