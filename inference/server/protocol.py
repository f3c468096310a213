"""OpenAI request fields, parsed and validated, and the errors a client sees (no web framework here)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from bdcore.chat import chat_text
from bdcore.decode.sampling import SamplingParams
from inference.server.template_limits import DEFAULT_LIMITS, TemplateLimits, TemplateStopped, render_bounded


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


CLIENT_CLOSED = 499  # nginx's status for a request whose client went away (counted in /metrics)


def internal_error() -> APIError:
    """What a client sees of a server fault: no exception text (it can carry paths and internals)."""
    return APIError(500, "internal error", type="server_error")


def _number(body: dict, key: str, kind, default, lo=None, hi=None):
    value = body.get(key, default)
    if value is None:
        return default
    kind_name = "integer" if kind is int else "number"
    # NaN and infinities pass every range check below, so they are refused by name
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or (isinstance(value, float) and not (math.isfinite(value) and (kind is float or value.is_integer())))
    ):
        raise APIError(400, f"'{key}' must be a finite {kind_name}, got {value!r}", param=key)
    try:
        value = kind(value)
    except OverflowError:  # an integer too large for a float
        raise APIError(400, f"'{key}' is out of range", param=key) from None
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise APIError(400, f"'{key}' must lie in [{lo}, {hi}], got {value}", param=key)
    return value


MAX_TOP_LOGPROBS = {"chat": 20, "completion": 5}  # OpenAI's limits


def logprobs_request(body: dict, kind: str) -> int | None:
    """How many alternatives to report per answer token (0: only the token's own), or None for none.
    Chat: `logprobs` true/false and `top_logprobs` 0..20; completions: `logprobs` 0..5 (null: none)."""
    top = MAX_TOP_LOGPROBS[kind]
    if kind == "completion":
        return _number(body, "logprobs", int, None, 0, top)
    wanted = body.get("logprobs")
    if wanted not in (None, True, False):
        raise APIError(400, "'logprobs' must be true or false", param="logprobs")
    k = _number(body, "top_logprobs", int, None, 0, top)
    if k and not wanted:
        raise APIError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    return (k or 0) if wanted else None


def sampling_params(body: dict, *, default_max_tokens: int, kind: str = "chat") -> SamplingParams:
    if _number(body, "n", int, 1) != 1:
        raise APIError(400, "only n=1 is supported", param="n")
    logprobs = logprobs_request(body, kind)
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    stop = body.get("stop") or ()
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 8:
        raise APIError(400, "'stop' must be a string or a list of up to 8 non-empty strings", param="stop")
    return SamplingParams(
        temperature=_number(body, "temperature", float, SamplingParams.temperature, 0.0, 2.0),
        top_p=_number(body, "top_p", float, SamplingParams.top_p, 1e-6, 1.0),
        top_k=_number(body, "top_k", int, SamplingParams.top_k, 0, None),
        max_tokens=_number({"max_tokens": max_tokens}, "max_tokens", int, default_max_tokens, 1, None),
        stop=tuple(stop),
        seed=_number(body, "seed", int, None, -(2**63), 2**64 - 1),  # what torch's generator takes
        logprobs=logprobs,
    )


@dataclass(frozen=True)
class ToolRequest:
    """What a chat request asks of tools: the validated `tools`, `tool_choice` and `parallel_tool_calls`.

    `choice` is "auto", "none", "required" or "function" (then `name` is the function forced)."""

    tools: tuple = ()
    choice: str = "none"
    name: str | None = None
    parallel: bool = True

    @property
    def parse(self) -> bool:
        """Whether the reply is scanned for tool calls."""
        return bool(self.tools) and self.choice != "none"


def tool_request(body: dict) -> ToolRequest:
    tools = body.get("tools")
    if tools is None:
        tools = []
    if not isinstance(tools, list):
        raise APIError(400, "'tools' must be a list of function tools", param="tools")
    names = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or t.get("type", "function") != "function":
            raise APIError(400, f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}", param="tools")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise APIError(400, f"tools[{i}].function.name must be a non-empty string", param="tools")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise APIError(400, f"tools[{i}].function.parameters must be a JSON schema object", param="tools")
        names.append(fn["name"])
    choice, name = body.get("tool_choice"), None
    if choice is None:
        choice = "auto" if tools else "none"
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise APIError(
                400, "'tool_choice' object must be {'type': 'function', 'function': {'name': ...}}", param="tool_choice"
            )
        if name not in names:
            raise APIError(400, f"tool_choice names {name!r}, which is not among 'tools'", param="tool_choice")
        choice = "function"
    elif choice not in ("auto", "none", "required"):
        raise APIError(
            400, f"'tool_choice' must be 'auto', 'none', 'required' or a function, got {choice!r}", param="tool_choice"
        )
    if choice == "required" and not tools:
        raise APIError(400, "tool_choice 'required' needs 'tools'", param="tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise APIError(400, "'parallel_tool_calls' must be a boolean", param="parallel_tool_calls")
    return ToolRequest(tuple(tools), choice, name, parallel is not False)


def _text_content(content, where: str) -> str:
    """A message's content as the string chat templates expect: None -> "", text parts joined."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise APIError(400, f"{where}.content must be a string or a list of parts", param="messages")
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif (
            isinstance(part, dict) and part.get("type") in ("text", "input_text") and isinstance(part.get("text"), str)
        ):
            texts.append(part["text"])
        else:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise APIError(400, f"{where}.content: only text parts are supported, got {kind!r}", param="messages")
    return "\n".join(texts)


def template_messages(messages) -> list[dict]:
    """OpenAI chat messages -> what HF chat templates read (the request body is left untouched).

    Content becomes a string (text parts joined), `developer` becomes `system`, null fields are dropped,
    and assistant tool-call arguments sent as JSON strings (OpenAI's wire form) become objects, the form
    templates expect (Qwen, Llama and Mistral templates serialise them themselves)."""
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "'messages' must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool", "developer"):
            raise APIError(400, f"messages[{i}] needs a role of system, user, assistant or tool", param="messages")
        msg = {k: v for k, v in m.items() if v is not None}
        msg["role"] = "system" if m["role"] == "developer" else m["role"]
        msg["content"] = _text_content(m.get("content"), f"messages[{i}]")
        calls = msg.pop("tool_calls", None)
        if calls:
            if m["role"] != "assistant" or not isinstance(calls, list):
                raise APIError(400, f"messages[{i}].tool_calls must be a list on an assistant", param="messages")
            msg["tool_calls"] = [_template_call(c, f"messages[{i}].tool_calls[{j}]") for j, c in enumerate(calls)]
        out.append(msg)
    return out


def _template_call(call, where: str) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise APIError(400, f"{where} needs function.name", param="messages")
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            parsed = json.loads(args) if args.strip() else {}
            args = parsed if isinstance(parsed, dict) else args
        except json.JSONDecodeError:
            pass  # not JSON: the template gets the string as sent
    return {**call, "type": call.get("type") or "function", "function": {**fn, "arguments": args or {}}}


def response_format_instruction(body: dict) -> str | None:
    """`response_format` json_object / json_schema as a system instruction (no constrained decoding here:
    the model is asked for JSON, and the reply is returned as written)."""
    fmt = body.get("response_format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return "Reply with one valid JSON object and nothing else."
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise APIError(400, "response_format json_schema needs json_schema.schema", param="response_format")
        return "Reply with one valid JSON object and nothing else. It must conform to this JSON schema:\n" + json.dumps(
            schema, ensure_ascii=False
        )
    raise APIError(
        400, "'response_format' type must be 'text', 'json_object' or 'json_schema'", param="response_format"
    )


def chat_prompt_text(
    tokenizer, body: dict, tools: ToolRequest | None = None, limits: TemplateLimits = DEFAULT_LIMITS
) -> str:
    """The rendered chat template: what is tokenised (prepare.py measures it first)."""
    messages = template_messages(body.get("messages"))
    instruction = response_format_instruction(body)
    if instruction and messages[0]["role"] == "system":
        messages[0]["content"] = (messages[0]["content"] + "\n\n" + instruction).strip()
    elif instruction:
        messages.insert(0, {"role": "system", "content": instruction})
    tools = tools if tools is not None else tool_request(body)
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise APIError(400, "'chat_template_kwargs' must be an object", param="chat_template_kwargs")
    if body.get("chat_template") is not None:  # the server refuses it unless --allow-client-chat-template
        if not isinstance(body["chat_template"], str):
            raise APIError(400, "'chat_template' must be a string", param="chat_template")
        kwargs = {**kwargs, "chat_template": body["chat_template"]}

    def render() -> str:
        # tool_choice "none": the model is not shown the tools, so it answers in text
        return chat_text(tokenizer, messages, tools=list(tools.tools) if tools.parse else None, **kwargs)

    try:
        if kwargs.get("chat_template") is None:  # the server's own template: the operator's code, run as is
            return render()
        return render_bounded(render, limits)
    except TemplateStopped as e:
        where = "chat_template" if body.get("chat_template") is not None else "chat_template_kwargs"
        raise APIError(400, e.problem, param=where, code=e.code) from None
    except Exception as e:
        raise APIError(400, f"the chat template rejected these messages: {e}", param="messages") from e
