"""The `prompt` of /v1/completions in every shape OpenAI and vLLM take: a string, a list of token ids, or a
list of strings or of token-id lists (evaluation harnesses send ids, and several prompts at once). Each
prompt is served as its own choice; ids must be in the vocabulary (`<|mask|>` is refused in prepare.py,
for ids and text alike)."""

from __future__ import annotations

from inference.server.protocol import APIError

MAX_PROMPTS = 128  # one request's prompts share the batch with every other request
SHAPES = "a non-empty string, a list of token ids, or a list of strings or of token-id lists"


def _is_id(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def completion_prompts(body: dict, vocab_size: int) -> list[tuple[str, str | list[int]]]:
    """The request's prompts, each a string or a validated list of token ids, with where it was sent
    ("prompt", or "prompt[i]" in a list of prompts) for the errors that name it."""
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(map(_is_id, prompt))):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        prompts = prompt
    else:
        raise APIError(400, f"'prompt' must be {SHAPES}", param="prompt")
    if len(prompts) > MAX_PROMPTS:
        raise APIError(
            400, f"'prompt' holds {len(prompts)} prompts; send at most {MAX_PROMPTS} prompts a request", param="prompt"
        )
    out = []
    for i, p in enumerate(prompts):
        where = f"prompt[{i}]" if prompts is prompt else "prompt"  # a list of prompts, or the one
        if not p:
            raise APIError(400, f"{where} is empty; each prompt needs at least one character or token", param="prompt")
        if isinstance(p, list):
            _check_ids(p, where, vocab_size)
        out.append((where, p))
    return out


def _check_ids(ids: list, where: str, vocab_size: int) -> None:
    for j, t in enumerate(ids):
        if not _is_id(t):
            raise APIError(400, f"{where}[{j}] is {t!r}: a prompt list must hold token ids (integers)", param="prompt")
        if not 0 <= t < vocab_size:
            raise APIError(
                400,
                f"{where}[{j}] is {t}, not a token id of this model's vocabulary (0 to {vocab_size - 1})",
                param="prompt",
            )
