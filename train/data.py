"""Conversations (JSONL or a hub dataset) -> tokenized `Sample`s, with every skip counted by reason.

A conversation is `{"messages": [{"role", "content"}...], "tools": [...]}` or ShareGPT-style
`{"conversations": [{"from", "value"}...]}`. It is rendered with the tokenizer's chat template; an
assistant turn is supervised only if the render of the conversation up to that turn with a
generation prompt is an exact token prefix of the full render (and so is the render that ends with
the turn), because only then does the row show the model what decoding will show it.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from train.rows import Sample, two_stream_length

ROLE_ALIASES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
}


class SkipSample(Exception):
    """A record that cannot become a training sample; `reason` is the counter key."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass
class DataStats:
    records: int = 0
    kept: int = 0
    skipped: Counter = field(default_factory=Counter)
    unsupervised_turns: Counter = field(default_factory=Counter)

    def to_dict(self) -> dict:
        return {
            "records": self.records,
            "kept": self.kept,
            "skipped": dict(sorted(self.skipped.items())),
            "unsupervised_turns": dict(sorted(self.unsupervised_turns.items())),
        }


def iter_records(source: str) -> Iterator[tuple[str, object]]:
    """Yield (where, record) from a .jsonl file, a directory of .jsonl files, or a hub dataset id.

    A line that is not valid JSON yields the `SkipSample("malformed_json")` in place of a record.
    """
    path = Path(source)
    if path.is_dir():
        files = sorted(path.rglob("*.jsonl"))
        if not files:
            raise FileNotFoundError(f"--dataset {source}: the directory holds no .jsonl files")
    elif path.is_file():
        files = [path]
    elif path.suffix == ".jsonl" or source.startswith((".", "/")):
        raise FileNotFoundError(f"--dataset {source}: no such file or directory")
    else:
        yield from _iter_hub(source)
        return
    for f in files:
        with open(f, encoding="utf-8") as fh:
            for n, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    yield f"{f}:{n}", json.loads(line)
                except json.JSONDecodeError:
                    yield f"{f}:{n}", SkipSample("malformed_json")


def _iter_hub(name: str) -> Iterator[tuple[str, object]]:
    try:
        import datasets
    except ImportError as e:
        raise SystemExit(
            f"--dataset {name}: not a local path, and loading it from the hub needs `datasets` "
            "(pip install datasets), or pass a local .jsonl file or directory"
        ) from e
    split = "train"
    if ":" in name:
        name, split = name.split(":", 1)
    for i, rec in enumerate(datasets.load_dataset(name, split=split)):
        yield f"{name}[{i}]", rec


def normalize(record) -> tuple[list[dict], list | None]:
    """Return (messages with role/content, tools) or raise SkipSample."""
    if not isinstance(record, dict):
        raise SkipSample("not_an_object")
    if isinstance(record.get("messages"), list):
        raw, role_key, content_key = record["messages"], "role", "content"
    elif isinstance(record.get("conversations"), list):
        raw, role_key, content_key = record["conversations"], "from", "value"
    else:
        raise SkipSample("no_messages")
    messages = []
    for m in raw:
        if not isinstance(m, dict) or role_key not in m:
            raise SkipSample("missing_role")
        role = ROLE_ALIASES.get(str(m[role_key]).lower())
        if role is None:
            raise SkipSample("unknown_role")
        content = m.get(content_key)
        if content is not None and not isinstance(content, (str, list)):
            raise SkipSample("bad_content")
        msg = {k: v for k, v in m.items() if k not in (role_key, content_key)}
        msg.update(role=role, content=content if content is not None else "")
        messages.append(msg)
    if not any(m["role"] == "assistant" for m in messages):
        raise SkipSample("no_assistant_turn")
    tools = record.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise SkipSample("bad_tools")
    return messages, tools


class ConversationTokenizer:
    def __init__(self, tokenizer, eot_id: int, *, multiturn: bool, chat_template_kwargs: dict | None = None):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template; conversations cannot be rendered")
        self.tok = tokenizer
        self.eot_id = eot_id
        self.multiturn = multiturn
        self.kwargs = chat_template_kwargs or {}

    def _ids(self, messages, tools, generation_prompt: bool) -> list[int]:
        try:
            text = self.tok.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt, **self.kwargs
            )
        except Exception as e:  # a template may raise on content it does not accept
            raise SkipSample("template_error") from e
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def __call__(self, messages: list[dict], tools, stats: DataStats | None = None) -> Sample:
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        last = turns[-1]
        full = self._ids(messages[: last + 1], tools, False)
        spans, reasons = [], []
        for k in turns if self.multiturn else [last]:
            prompt = self._ids(messages[:k], tools, True)
            upto = full if k == last else self._ids(messages[: k + 1], tools, False)
            if full[: len(prompt)] != prompt or full[: len(upto)] != upto or len(upto) <= len(prompt):
                reasons.append("template_mismatch")
                continue
            try:
                end = upto.index(self.eot_id, len(prompt)) + 1
            except ValueError:
                reasons.append("no_end_of_turn")
                continue
            if spans and len(prompt) < spans[-1][1]:
                reasons.append("overlapping_turn")
                continue
            spans.append((len(prompt), end))
        if not spans:
            raise SkipSample(reasons[-1] if reasons else "no_assistant_turn")
        if stats is not None:
            stats.unsupervised_turns.update(reasons)
        return Sample(full[: spans[-1][1]], spans)


def load_samples(
    source: str,
    tokenizer,
    eot_id: int,
    *,
    multiturn: bool,
    max_length: int,
    max_response_length: int | None,
    bd_size: int,
    views: int,
    progress: bool = False,
    chat_template_kwargs: dict | None = None,
) -> tuple[list[Sample], DataStats]:
    """Tokenize every record; skip (and count) what cannot be trained on. `max_length` bounds the
    two-stream row (L + views * padded response tokens)."""
    conv = ConversationTokenizer(tokenizer, eot_id, multiturn=multiturn, chat_template_kwargs=chat_template_kwargs)
    stats = DataStats()
    samples: list[Sample] = []
    records = iter_records(source)
    if progress:
        from tqdm import tqdm

        records = tqdm(
            records, desc="tokenize", unit=" rec", dynamic_ncols=True, mininterval=0.2 if sys.stderr.isatty() else 30.0
        )
    for _, rec in records:
        stats.records += 1
        try:
            if isinstance(rec, SkipSample):
                raise rec
            messages, tools = normalize(rec)
            sample = conv(messages, tools, stats)
            if max_response_length and max(e - s for s, e in sample.spans) > max_response_length:
                raise SkipSample("response_too_long")
            if two_stream_length(sample, bd_size, views) > max_length:
                raise SkipSample("too_long")
        except SkipSample as s:
            stats.skipped[s.reason] += 1
            continue
        samples.append(sample)
        stats.kept += 1
    if not samples:
        raise ValueError(
            f"--dataset {source}: no usable samples out of {stats.records} records "
            f"(skipped: {dict(stats.skipped) or 'none'}); check the format (messages/conversations), "
            "the chat template and --max_length"
        )
    return samples, stats
