"""From an HTTP request to a `PreparedRequest`: body, model, prompt ids, context length, sampling, mode.

Every check runs before any decoding, in a fixed order (so a request with several faults always gets the
same error), and each fault is an `APIError` the client sees as a 4xx."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from bdcore.decode.config import SELF_SPEC_CANVASES, DecodeSettingsError
from bdcore.decode.sampling import SamplingParams
from bdcore.loading import CheckpointError, LoadedModel
from inference.native.engine import DecodeConfig
from inference.server.completion_prompts import completion_prompts
from inference.server.prompt_bound import check_prompt_chars
from inference.server.protocol import (
    APIError,
    ToolRequest,
    chat_prompt_text,
    sampling_params,
    tool_request,
)
from inference.server.request_checks import check_body, include_usage, read_json
from inference.server.tool_calls import forced_prefix

if TYPE_CHECKING:
    from inference.server.state import ServerState


@dataclass(frozen=True)
class PreparedRequest:
    kind: str  # "chat" or "completion"
    prompts: tuple[list[int], ...]  # one per choice: a chat has one, completions may send several
    prefix: str  # forced start of the reply: part of the prompt, put back before the reply is parsed
    tools: ToolRequest
    params: SamplingParams
    decode: DecodeConfig
    stream: bool
    include_usage: bool

    @property
    def prompt_ids(self) -> list[int]:
        """The prompt of a request with one (every chat, every stream)."""
        return self.prompts[0]


async def prepare(state: ServerState, kind: str, request: Request) -> PreparedRequest:
    body = await read_json(request, state.max_request_bytes)
    check_body(body, kind, model_name=state.model_name, allow_chat_template=state.allow_client_chat_template)
    tools = tool_request(body) if kind == "chat" else ToolRequest()
    # templates and tokenizers are slow on long prompts (and a client template, where allowed, runs as long
    # as it likes): off the event loop, so health probes and other requests go on meanwhile
    prompts, prefix = await run_in_threadpool(prompt_ids, state, kind, body, tools)
    stream = bool(body.get("stream"))
    if stream and len(prompts) > 1:
        raise APIError(
            400,
            f"a stream carries one prompt, this request has {len(prompts)}: send them without 'stream' "
            "(one choice each) or as one request each",
            param="stream",
        )
    longest = max(map(len, prompts))
    room = context_room(state.max_context, longest)
    # without an explicit max_tokens the reply may use the rest of the context, up to the default
    params = sampling_params(body, default_max_tokens=min(state.default_max_tokens, room), kind=kind)
    decode = request_decode(state.loaded, state.decode, body)
    check_reply_fits(state.max_context, longest, params.max_tokens)
    return PreparedRequest(kind, tuple(prompts), prefix, tools, params, decode, stream, include_usage(body))


def prompt_ids(state: ServerState, kind: str, body: dict, tools: ToolRequest) -> tuple[list[list[int]], str]:
    """The ids of each prompt and the forced reply prefix; a text too long for the context is refused by
    its length before it is tokenised (a tokenizer costs a 4 MB prompt seconds and gigabytes)."""
    tokenizer = state.loaded.tokenizer
    if kind == "chat":
        prompts = [chat_prompt_text(tokenizer, body, tools)]
    else:
        prompts = completion_prompts(body, state.vocab_size, state.loaded.mask_id)
    # tool_choice "required" / a named function: the reply is made to open a call (see forced_prefix)
    prefix = forced_prefix(tools.choice, tools.name) if tools.parse else ""
    prefix_ids = tokenizer(prefix, add_special_tokens=False)["input_ids"] if prefix else []
    param = "messages" if kind == "chat" else "prompt"
    out = []
    for prompt in prompts:
        if isinstance(prompt, str):
            check_prompt_chars(len(prompt) + len(prefix), state.chars_per_token, state.max_context, param)
            prompt = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        out.append(list(prompt) + prefix_ids)
    return out, prefix


def context_room(max_context: int, n_prompt: int) -> int:
    """Tokens left for the reply; none left is the client's fault."""
    room = max_context - n_prompt
    if room < 1:
        raise APIError(
            400,
            f"This model's maximum context length is {max_context} tokens. However, your messages resulted "
            f"in {n_prompt} tokens. Please reduce the length of the messages.",
            param="messages",
            code="context_length_exceeded",
        )
    return room


def check_reply_fits(max_context: int, n_prompt: int, max_tokens: int) -> None:
    if n_prompt + max_tokens > max_context:
        raise APIError(
            400,
            # OpenAI's wording: clients (LiteLLM, the openai SDK's users) recognise it as a context overflow
            f"This model's maximum context length is {max_context} tokens. However, you requested "
            f"{n_prompt + max_tokens} tokens ({n_prompt} in the messages, "
            f"{max_tokens} in the completion). Please reduce the length of the messages or completion.",
            param="messages",
            code="context_length_exceeded",
        )


def request_decode(loaded: LoadedModel, default: DecodeConfig, body: dict) -> DecodeConfig:
    """The server's decode settings with the request's `mode` and `self_spec_canvases` (extensions), if
    the checkpoint has them."""
    mode = body.get("mode", default.mode)
    try:
        loaded.check_mode(mode)
    except CheckpointError as e:
        raise APIError(400, str(e), param="mode") from e
    canvases = body.get("self_spec_canvases", default.self_spec_canvases)
    if canvases not in SELF_SPEC_CANVASES:
        raise APIError(
            400, f"'self_spec_canvases' must be one of {list(SELF_SPEC_CANVASES)}", param="self_spec_canvases"
        )
    decode = replace(default, mode=mode, self_spec_canvases=canvases)
    try:  # the server's own settings were checked at start; a request's choice of mode or canvases is new
        decode.resolve(loaded.capabilities)
    except DecodeSettingsError as e:
        raise APIError(400, str(e), param="self_spec_canvases" if "self_spec_canvases" in body else "mode") from e
    return decode
