"""From an HTTP request to a `PreparedRequest`: body, model, prompt ids, context length, sampling, mode.

Every check runs before any decoding, in a fixed order (so a request with several faults always gets the
same error), and each fault is an `APIError` the client sees as a 4xx."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from bdcore.decode.config import ResolvedDecode
from bdcore.decode.memory import RequestFloor, available_bytes, describe, request_bytes
from bdcore.decode.sampling import SamplingParams
from bdcore.loading import LoadedModel
from bdcore.serving_gate import CannotServe, resolve
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
    decode: ResolvedDecode  # through the serving gate once, here; the engine takes it as it is
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
    longest, param = max(map(len, prompts)), "messages" if kind == "chat" else "prompt"
    room = context_room(state.max_context, longest, param)
    # without an explicit max_tokens the reply may use the rest of the context, up to the default
    params = sampling_params(body, default_max_tokens=min(state.default_max_tokens, room), kind=kind)
    decode = request_decode(state.loaded, state.decode, body)
    check_reply_fits(state.max_context, longest, params.max_tokens, param)
    check_memory(state.request_floor, decode, longest, params.max_tokens, param)
    return PreparedRequest(kind, tuple(prompts), prefix, tools, params, decode, stream, include_usage(body))


def prompt_ids(state: ServerState, kind: str, body: dict, tools: ToolRequest) -> tuple[list[list[int]], str]:
    """The ids of each prompt and the forced reply prefix. A text too long for the context is refused by
    its length before any prompt is tokenised (a tokenizer costs a 4 MB prompt seconds and gigabytes), and
    a prompt too long in tokens before the next one is tokenised."""
    tokenizer = state.loaded.tokenizer
    param = "messages" if kind == "chat" else "prompt"
    if kind == "chat":
        prompts = [(param, chat_prompt_text(tokenizer, body, tools, state.template_limits))]
    else:
        prompts = completion_prompts(body, state.vocab_size)
    # tool_choice "required" / a named function: the reply is made to open a call (see forced_prefix)
    prefix = forced_prefix(tools.choice, tools.name) if tools.parse else ""
    for _, prompt in prompts:
        if isinstance(prompt, str):
            check_prompt_chars(len(prompt) + len(prefix), state.chars_per_token, state.max_context, param)
    prefix_ids = tokenizer(prefix, add_special_tokens=False)["input_ids"] if prefix else []
    out = []
    for where, prompt in prompts:
        ids = prompt if isinstance(prompt, list) else tokenizer(prompt, add_special_tokens=False)["input_ids"]
        check_no_mask(ids, where, state.loaded.mask_id, spelled=isinstance(prompt, str))
        out.append(list(ids) + prefix_ids)
        context_room(state.max_context, len(out[-1]), param)
    return out, prefix


def check_no_mask(ids: list[int], where: str, mask_id: int | None, *, spelled: bool) -> None:
    """No prompt reaches the engine holding `<|mask|>`, by any route: the model never saw one in a prompt,
    and the engine would read it as a slot to denoise. Text that spells it (the tokenizer reads the
    spelling as the token) is refused like the id itself (docs/design.md 8.20)."""
    if mask_id is None or mask_id not in ids:
        return
    if spelled:
        problem = f"{where} spells <|mask|>, the mask token (id {mask_id}), which a prompt may not hold"
    else:
        problem = f"{where}[{ids.index(mask_id)}] is the <|mask|> token ({mask_id}), which a prompt may not hold"
    param = where.split("[")[0]  # prompt[1] -> prompt
    raise APIError(400, f"{problem}; remove it (the model fills <|mask|> slots, it never reads one)", param=param)


def context_room(max_context: int, n_prompt: int, param: str) -> int:
    """Tokens left for the reply; none left is the client's fault (`param`: "messages" or "prompt")."""
    room = max_context - n_prompt
    if room < 1:
        raise APIError(
            400,
            f"This model's maximum context length is {max_context} tokens. However, your {param} resulted "
            f"in {n_prompt} tokens. Please reduce the length of the {param}.",
            param=param,
            code="context_length_exceeded",
        )
    return room


def check_reply_fits(max_context: int, n_prompt: int, max_tokens: int, param: str) -> None:
    if n_prompt + max_tokens > max_context:
        raise APIError(
            400,
            # OpenAI's wording: clients (LiteLLM, the openai SDK's users) recognise it as a context overflow
            f"This model's maximum context length is {max_context} tokens. However, you requested "
            f"{n_prompt + max_tokens} tokens ({n_prompt} in the {param}, "
            f"{max_tokens} in the completion). Please reduce the length of the {param} or completion.",
            param=param,
            code="context_length_exceeded",
        )


def check_memory(floor: RequestFloor, decode: ResolvedDecode, n_prompt: int, max_tokens: int, param: str) -> None:
    """Refuse a request that cannot fit in the memory the process can still get (`bdcore.decode.memory`: a floor
    of what it will hold), before it holds any: a MemoryError mid-decode is a 500 after the memory went."""
    need, room = request_bytes(floor, decode, n_prompt, max_tokens), available_bytes()
    if room is None or need <= room:
        return
    if request_bytes(floor, decode, n_prompt, 1) <= room:
        fix, param = "ask for fewer max_tokens", "max_tokens"
    elif decode.mode != "causal" and request_bytes(floor, replace(decode, mode="causal"), n_prompt, 1) <= room:
        size = f"block {decode.block}" if decode.mode == "diffusion" else f"draft_len {decode.draft_len}"
        fix, param = f"its {decode.mode} forwards ({size}) are what does not fit: ask for mode causal", "mode"
    else:
        fix = f"send a shorter {param}"
    raise APIError(
        400,
        f"this request needs at least {describe(need)} ({n_prompt} prompt tokens, max_tokens {max_tokens}, "
        f"{decode.mode} mode), more than the {describe(room)} this server can still allocate; {fix}",
        param=param,
        code="request_too_large",
    )


def request_decode(loaded: LoadedModel, default: DecodeConfig, body: dict) -> ResolvedDecode:
    """The server's decode settings with the request's `mode` and `self_spec_canvases` (extensions), through
    the serving gate: a 400 naming the field when the checkpoint cannot serve them."""
    mode = body.get("mode", default.mode)
    canvases = body.get("self_spec_canvases", default.self_spec_canvases)
    try:
        return resolve(loaded.capabilities, replace(default, mode=mode, self_spec_canvases=canvases), "native")
    except CannotServe as e:  # the other settings are the server's own: the request changed mode or canvases
        raise APIError(400, str(e), param=e.setting if e.setting in body else "mode") from e
