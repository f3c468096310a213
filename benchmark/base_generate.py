"""The speed baseline of every decode benchmark: the base model decoded by `transformers` `generate`.

A user who converts a model already has this: the AR model it came from, decoded greedily by Hugging Face's
own loop with its KV cache. Our modes are worth something only as far as they beat it, so the
benchmarks time it beside them, on the same prompts, in the same run, one request at a time (or
`concurrency` prompts per `generate` call, left-padded, which is what batching looks like there).

Which weights are the base: a draft-adapter checkpoint stores them unchanged (its adapter lives apart, in
`draft_adapter/`), so the checkpoint itself is its base; any other conversion changed every weight, and the
base is the model it was converted from (`--base`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bdcore.decode.sequence import DecodeStats


@dataclass
class BaseGeneration:
    """What the benchmarks read of a `Generation`: the answer's tokens (no stop token) and its stats."""

    tokens: list[int]
    stats: DecodeStats


def base_model_dir(checkpoint: Path, base: Path | None) -> Path | None:
    """`base` if given; else the checkpoint itself when it is a draft adapter (its weights are the base's);
    else None (a full conversion's base is another model, which only the caller can name)."""
    if base is not None:
        return base
    from bdcore.sidecar import SIDECAR_NAME, read_sidecar

    if (checkpoint / SIDECAR_NAME).is_file() and read_sidecar(checkpoint).draft_adapter is not None:
        return checkpoint
    return None


def _sampling(params) -> dict:
    """`generate`'s arguments for our SamplingParams: greedy at temperature 0; else sampling with exactly the
    request's temperature, top-k and top-p (the model's generation_config defaults, such as top_k=50, do not
    apply: our modes sample without them)."""
    if params.temperature == 0:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": params.temperature, "top_k": params.top_k, "top_p": params.top_p}


def base_generator(model_dir: Path, *, dtype: torch.dtype, device: str, stop_ids, concurrency: int = 1):
    """A function running a list of prompt-id lists through `generate` on the base model (greedy, or sampled
    as `params` say, the same stop tokens as the engine), returning (`BaseGeneration`s, wall seconds), like the
    engine's runners."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    stops = sorted(stop_ids)
    pad = model.generation_config.pad_token_id
    pad = stops[0] if pad is None else pad

    def answer(out: list[int]) -> BaseGeneration:
        cut = next((i for i, t in enumerate(out) if t in stop_ids), None)
        tokens = out if cut is None else out[:cut]
        produced = len(tokens) + (cut is not None)  # the stop token counts, as in the engine's stats
        return BaseGeneration(tokens, DecodeStats(generated=produced, forwards=produced))

    @torch.inference_mode()
    def run(prompts: list[list[int]], params) -> tuple[list[BaseGeneration], float]:
        outs = []
        start = time.perf_counter()
        for i in range(0, len(prompts), concurrency):
            group = prompts[i : i + concurrency]
            width = max(len(p) for p in group)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in group], device=device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group], device=device)
            if params.seed is not None:
                torch.manual_seed(params.seed)
            got = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=params.max_tokens,
                eos_token_id=stops,
                pad_token_id=pad,
                **_sampling(params),
            )
            outs += [answer(row[width:].tolist()) for row in got]
        return outs, time.perf_counter() - start

    return run
