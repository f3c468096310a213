"""Held-out evaluation of converted checkpoints for `benchmark/conversion.py`.

For each checkpoint, every held-out prompt is decoded greedily by the native engine in causal,
diffusion and self-spec modes (in process, one request at a time): tokens per forward, tok/s, the
share of outputs identical to causal decoding (`stock_greedy`: the Hugging Face model's greedy loop,
apart from the engine, so the engine's own causal mode is measured against it too), and answer quality:
exact match against the reference answer (chats whose last turn is the assistant's) or pass@1 for
HumanEval-style prompts (`test` and `entry_point` fields; the program runs in a subprocess with a
timeout). The AR held-out loss is the checkpoint's mean next-token loss on reference answers under
causal attention.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bdcore.chat import chat_ids
from bdcore.decode.config import DecodeConfig
from bdcore.decode.sampling import SamplingParams
from bdcore.draft_adapter import draft_rows
from bdcore.scoring import exact_match
from bdcore.serving_gate import served_modes


@dataclass
class Heldout:
    prompt_ids: list[list[int]]
    records: list[dict]
    references: list[list[int] | None]  # reference answer ids (end-of-turn included), if any


def load_heldout(path: Path, tokenizer, limit: int) -> Heldout:
    from bdcore.tokens import end_of_turn_id

    eot = end_of_turn_id(tokenizer)
    prompts, records, refs = [], [], []
    for line in Path(path).read_text().splitlines()[:limit]:
        rec = json.loads(line)
        msgs = rec["messages"]
        context = msgs[:-1] if msgs[-1]["role"] == "assistant" else msgs
        prompts.append(chat_ids(tokenizer, context))
        records.append(rec)
        if msgs[-1]["role"] == "assistant":
            answer = tokenizer(msgs[-1]["content"], add_special_tokens=False)["input_ids"]
            refs.append(answer + [eot])
        else:
            refs.append(None)
    return Heldout(prompts, records, refs)


def code_of(text: str) -> str:
    """The answer's first ```python block (the prompts ask for the whole function in one), or all of it."""
    block = re.search(r"```(?:python)?\n(.*?)```", text, re.S)
    return block.group(1) if block else text


def passes(record: dict, answer: str, timeout: float = 10.0) -> bool:
    """HumanEval's check: the answer's function against the task's tests, in a fresh interpreter."""
    code = code_of(answer)
    if f"def {record['entry_point']}" not in code:
        code = record.get("code_prompt", "") + code
    program = f"{code}\n\n{record['test']}\n\ncheck({record['entry_point']})\n"
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(program)
    try:
        done = subprocess.run([sys.executable, f.name], capture_output=True, timeout=timeout)
        return done.returncode == 0
    except subprocess.TimeoutExpired:
        return False
    finally:
        Path(f.name).unlink(missing_ok=True)


def quality(record: dict, answer: str) -> bool | None:
    if "test" in record and "entry_point" in record:
        return passes(record, answer)
    msgs = record["messages"]
    if msgs[-1]["role"] == "assistant":
        return exact_match(answer, msgs[-1]["content"])
    return None


@torch.no_grad()
def ar_loss(model, heldout: Heldout, banned: int | None = None) -> float | None:
    """Mean next-token loss on the reference answers (causal attention: the model's AR head), with `banned`
    (the `<|mask|>` id) out of the distribution as decoding has it, so a converted checkpoint compares
    with its base over the same vocabulary."""
    total, count = 0.0, 0
    device = next(model.parameters()).device
    for prompt, ref in zip(heldout.prompt_ids, heldout.references):
        if ref is None:
            continue
        ids = torch.tensor([prompt + ref], device=device)
        with draft_rows(model, torch.zeros_like(ids, dtype=torch.bool)):  # no row drafts in a causal forward
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
        if banned is not None and banned < logits.shape[-1]:
            logits[:, banned] = float("-inf")
        total += float(torch.nn.functional.cross_entropy(logits, ids[0, len(prompt) :], reduction="sum"))
        count += len(ref)
    return total / count if count else None


@torch.no_grad()
def stock_greedy(model, prompt_ids: list[int], *, max_tokens: int, stop_ids, banned: int | None) -> list[int]:
    """Greedy causal decoding with nothing of the engine (no runner, no KV cache, no decode rules): one full
    forward of the Hugging Face model per token, `banned` (`<|mask|>`) out of the argmax. The answer
    without its stop token, cut at `max_tokens`, as the engine's `Generation.tokens` holds it. Run it
    before an `Engine` is built on `model`: the engine binds its decode forward to hybrid layers."""
    device = next(model.parameters()).device
    ids, answer = list(prompt_ids), []
    while len(answer) < max_tokens:
        x = torch.tensor([ids], device=device)
        with draft_rows(model, torch.zeros_like(x, dtype=torch.bool)):  # no row drafts in a causal forward
            logits = model(input_ids=x).logits[0, -1].float()
        if banned is not None and banned < logits.shape[-1]:
            logits[banned] = float("-inf")
        token = int(logits.argmax())
        if token in stop_ids:
            break
        answer.append(token)
        ids.append(token)
    return answer


def evaluate(checkpoint: Path, heldout: Heldout, *, max_tokens: int, threshold: float) -> dict:
    from bdcore.loading import load_checkpoint
    from inference.native.engine import Engine

    loaded = load_checkpoint(checkpoint)
    row = {"checkpoint": str(checkpoint), "ar_loss": ar_loss(loaded.model, heldout, loaded.mask_id)}
    row["threshold"] = threshold  # the diffusion commit threshold every mode's engine was given
    causal_tokens = [
        stock_greedy(loaded.model, ids, max_tokens=max_tokens, stop_ids=loaded.stop_ids, banned=loaded.mask_id)
        for ids in heldout.prompt_ids
    ]
    for mode in served_modes(loaded.capabilities, "native"):  # a plain AR base: causal only
        engine = Engine(loaded, DecodeConfig(mode=mode, threshold=threshold))
        outs, start = [], time.perf_counter()
        for ids in heldout.prompt_ids:
            outs.append(engine.generate(ids, SamplingParams(max_tokens=max_tokens)))
        wall = time.perf_counter() - start
        generated = sum(g.stats.generated for g in outs)
        forwards = sum(g.stats.forwards for g in outs)
        scores = [quality(r, g.text) for r, g in zip(heldout.records, outs)]
        scored = [s for s in scores if s is not None]
        row[mode] = {
            "tokens_per_forward": generated / forwards,
            "tok_s": generated / wall,
            "quality": sum(scored) / len(scored) if scored else None,
            "same_as_causal": sum(g.tokens == c for g, c in zip(outs, causal_tokens)) / len(outs),
        }
    return row
