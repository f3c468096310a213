"""Self-distillation: regenerate a prompt set's answers with the AR model itself, as SFT data.

    python -m data.self_distill --model CKPT --prompts data/prompts/humaneval_train.jsonl --out sft.jsonl
    python -m data.self_distill --model CKPT --prompts p.jsonl --out s.jsonl --temperature 0.7 --samples-per-prompt 4

Training on the model's own answers keeps plain SFT on the model's own distribution, so the
conversion teaches block diffusion rather than new content. Prompts are JSONL: `{"messages": [...]}`
whose last turn is the user's, or `{"prompt": "..."}` (one user turn); other fields are kept. Each
line is rendered with the tokenizer's chat template and a generation prompt and decoded causally on
the project's decode core (`bdcore.decode`), up to `--batch` answers in flight (a finished answer's
slot goes to the next prompt at the next forward). Only answers that end with the end-of-turn token
are written, as the chat with the assistant turn appended (the trainer's format, train/data.py); an
answer cut at `--max-new-tokens`, ended by another stop token (eos, the block filler), empty, or
whose text does not re-render to the very tokens the model produced is dropped and counted, never
truncated. Lines come out in prompt order whatever `--batch` is. `<out>.stats.json` holds the counts,
tokens generated, wall time and tok/s.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bdcore.chat import chat_ids
from bdcore.decode.driver import DecodeDriver, DecodeLoop
from bdcore.decode.modes import CausalDecoder
from bdcore.decode.runner import ModelRunner
from bdcore.decode.sampling import SamplingParams
from bdcore.decode.sequence import AnswerTokens, DecodeStats, Sequence
from bdcore.tokens import end_of_turn_id


class PromptError(Exception):
    """A prompt line that cannot be decoded; `reason` is the counter key."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass
class Request:
    index: int  # position in the output order
    record: dict  # the prompt line, with `messages`
    ids: list[int]
    seed: int | None
    decoder: CausalDecoder | None = field(default=None, repr=False)


def prompt_messages(record) -> list[dict]:
    if not isinstance(record, dict):
        raise PromptError("not_an_object")
    msgs = record.get("messages")
    if msgs is None and isinstance(record.get("prompt"), str):
        msgs = [{"role": "user", "content": record["prompt"]}]
    if not isinstance(msgs, list) or not msgs:
        raise PromptError("no_messages")
    if not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in msgs):
        raise PromptError("bad_message")
    if msgs[-1]["role"] != "user" or not isinstance(msgs[-1].get("content"), str):
        raise PromptError("last_turn_not_user")
    return msgs


def read_prompts(path: Path, limit: int, skipped: Counter) -> list[dict]:
    """Records with `messages` (a `prompt` field becomes one user turn); bad lines are counted in `skipped`."""
    records = []
    with open(path, "rb") as f:
        for raw in f:
            if limit and len(records) >= limit:
                break
            if not raw.strip():
                continue
            try:
                rec = json.loads(raw.decode("utf-8-sig"))
                msgs = prompt_messages(rec)
            except (UnicodeDecodeError, json.JSONDecodeError):
                skipped["malformed_json"] += 1
                continue
            except PromptError as e:
                skipped[e.reason] += 1
                continue
            rec = {k: v for k, v in rec.items() if k != "prompt"}
            rec["messages"] = msgs
            records.append(rec)
    return records


def answer_text(tok, record: dict, prompt_ids: list[int], tokens: list[int], eot: int) -> str | None:
    """The answer's text, or None when the chat with it appended does not render to exactly the prompt,
    the answer's tokens and end-of-turn (then the trainer would supervise tokens the model never produced)."""
    text = tok.decode(tokens, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    msgs = [*record["messages"], {"role": "assistant", "content": text}]
    try:
        full = chat_ids(tok, msgs, tools=record.get("tools"), generation_prompt=False)
    except Exception:  # a template may raise on content it does not accept
        return None
    expect = [*prompt_ids, *tokens, eot]
    return text if full[: len(expect)] == expect else None


def distill(loaded, records: list[dict], out_path: Path, args, *, progress: bool = True) -> dict:
    """Decode every record's answer(s), write the kept ones in prompt order, and return the stats."""
    tok, eot = loaded.tokenizer, end_of_turn_id(loaded.tokenizer)
    caps = loaded.capabilities
    max_pos = getattr(loaded.model.config, "max_position_embeddings", None)
    sampled = args.temperature > 0
    stats = {"skipped_prompts": Counter(), "dropped": Counter(), "kept": 0, "kept_tokens": 0, "generated_tokens": 0}
    requests: list[Request] = []
    for i, rec in enumerate(records):
        try:
            ids = chat_ids(tok, rec["messages"], tools=rec.get("tools"))
        except Exception:  # noqa: BLE001 (a template may raise on content it does not accept: counted)
            stats["skipped_prompts"]["template_error"] += 1
            continue
        if max_pos and len(ids) + args.max_new_tokens > max_pos:
            stats["skipped_prompts"]["prompt_too_long"] += 1
            continue
        for k in range(args.samples_per_prompt):
            # One seed per answer, fixed by its place in the file: reproducible whatever --batch is.
            seed = args.seed + i * args.samples_per_prompt + k if sampled else None
            requests.append(Request(len(requests), rec, ids, seed))

    params = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, max_tokens=args.max_new_tokens)
    done: dict[int, dict | None] = {}  # finished answers waiting for the ones before them
    next_out, forwards = 0, 0
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(requests), desc="self-distill", unit=" answer", dynamic_ncols=True)
    t0 = time.perf_counter()
    with open(out_path, "w", encoding="utf-8") as out:
        pending = list(reversed(requests))
        loop: DecodeLoop[Request] = DecodeLoop(DecodeDriver(ModelRunner.for_checkpoint(loaded.model, caps)), args.batch)
        while pending or loop.active:
            while pending and loop.room:
                r = pending.pop()
                sink = AnswerTokens(caps.stop_ids, args.max_new_tokens, DecodeStats())
                gen = torch.Generator().manual_seed(r.seed if r.seed is not None else 0)
                r.decoder = CausalDecoder(
                    Sequence.for_checkpoint(caps, r.ids, SamplingParams(**params, seed=r.seed), gen, sink)
                )
                loop.admit(r, r.decoder)
            retired = loop.step()
            forwards += 1
            for r, _ in retired:
                done[r.index] = _finish(tok, r, eot, stats)
                r.decoder = None  # frees its cache now, not when the set is done
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(kept=stats["kept"], dropped=sum(stats["dropped"].values()), refresh=False)
            while next_out in done:
                row = done.pop(next_out)
                if row is not None:
                    out.write(json.dumps(row, ensure_ascii=False) + "\n")
                next_out += 1
    wall = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    return {
        "prompts": len(records),
        "skipped_prompts": dict(sorted(stats["skipped_prompts"].items())),
        "requests": len(requests),
        "kept": stats["kept"],
        "dropped": dict(sorted(stats["dropped"].items())),
        "generated_tokens": stats["generated_tokens"],
        "kept_answer_tokens": stats["kept_tokens"],
        "forwards": forwards,
        "wall_s": round(wall, 3),
        "tok_per_s": round(stats["generated_tokens"] / wall, 2) if wall > 0 else 0.0,
    }


def _finish(tok, r: Request, eot: int, stats: dict) -> dict | None:
    """The output line for a finished answer, or None (dropped, counted by reason)."""
    sink: AnswerTokens = r.decoder.seq.out
    stats["generated_tokens"] += sink.stats.generated
    if sink.stop_token is None:
        reason = "length"
    elif sink.stop_token != eot:
        reason = f"stop_token:{tok.convert_ids_to_tokens(sink.stop_token)}"
    elif not sink.tokens:
        reason = "empty"  # training on it would teach the model to stop at once
    else:
        text = answer_text(tok, r.record, r.ids, sink.tokens, eot)
        reason = "retokenize_mismatch" if text is None else None
    if reason is not None:
        stats["dropped"][reason] += 1
        return None
    stats["kept"] += 1
    stats["kept_tokens"] += len(sink.tokens) + 1
    row = {**r.record, "messages": [*r.record["messages"], {"role": "assistant", "content": text}]}
    if r.seed is not None:
        row["seed"] = r.seed
    return row


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m data.self_distill", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", required=True, help="checkpoint directory (a plain HF AR model or a bdstack checkpoint)")
    p.add_argument("--prompts", required=True, type=Path, help='JSONL of {"messages": [...]} or {"prompt": "..."}')
    p.add_argument("--out", required=True, type=Path, help="output JSONL (stats go to <out>.stats.json)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; > 0: sampled")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass in (0, 1] when sampling (default: 1.0)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k likeliest tokens when sampling; 0 (default): off")
    p.add_argument("--seed", type=int, default=0, help="base seed: answer n of the file samples with seed + n")
    p.add_argument("--max-new-tokens", type=int, default=512, help="answers not ended by then are dropped (512)")
    p.add_argument("--batch", type=int, default=8, help="answers decoded together in one forward (8)")
    p.add_argument("--samples-per-prompt", type=int, default=1, help="answers per prompt, one seed each; > 1: sampled")
    p.add_argument("--limit", type=int, default=0, help="use only the first N valid prompts; 0 (default): all")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ...; auto (default): cuda when available")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp16", "fp32"], help="auto: bf16 on cuda")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _check(args) -> str | None:
    """The first problem with the flags, as one line, or None."""
    if not args.prompts.is_file():
        return f"--prompts {args.prompts}: no such file"
    if not (Path(args.model) / "config.json").is_file():
        return f"--model {args.model}: not a model directory (no config.json)"
    for flag, value, low in (("--batch", args.batch, 1), ("--max-new-tokens", args.max_new_tokens, 1)):
        if value < low:
            return f"{flag} {value}: must be >= {low}"
    if args.samples_per_prompt < 1 or args.limit < 0 or args.top_k < 0 or args.temperature < 0:
        return "--samples-per-prompt must be >= 1; --limit, --top-k and --temperature must be >= 0"
    if not 0 < args.top_p <= 1:
        return f"--top-p {args.top_p}: must lie in (0, 1]"
    if args.samples_per_prompt > 1 and args.temperature == 0:
        return "--samples-per-prompt > 1 needs --temperature > 0 (greedy answers to one prompt are identical)"
    return None


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    problem = _check(args)
    if problem:
        sys.exit(f"self_distill: error: {problem}")
    from bdcore.loading import CheckpointError, load_checkpoint

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    skipped: Counter = Counter()
    records = read_prompts(args.prompts, args.limit, skipped)
    if not records:
        sys.exit(f"self_distill: error: --prompts {args.prompts}: no usable prompt (skipped: {dict(skipped)})")
    try:
        loaded = load_checkpoint(args.model, device=device, dtype=args.dtype)
    except (CheckpointError, OSError, ValueError) as e:
        sys.exit(f"self_distill: error: --model {args.model}: {str(e).strip().splitlines()[0]}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    summary = distill(loaded, records, args.out, args, progress=not args.no_progress)
    summary["skipped_prompts"] = dict(sorted((Counter(summary["skipped_prompts"]) + skipped).items()))
    summary["settings"] = {
        "model": str(args.model),
        "prompts": str(args.prompts),
        **{k: getattr(args, k) for k in ("temperature", "top_p", "top_k", "seed", "max_new_tokens", "batch")},
        "samples_per_prompt": args.samples_per_prompt,
        "device": device,
        "dtype": args.dtype,
    }
    stats_path = args.out.with_name(args.out.name + ".stats.json")
    stats_path.write_text(json.dumps(summary, indent=2) + "\n")
    print(
        f"kept {summary['kept']}/{summary['requests']} answers (dropped: {summary['dropped'] or 'none'}), "
        f"{summary['generated_tokens']} tokens at {summary['tok_per_s']} tok/s -> {args.out}, {stats_path}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
