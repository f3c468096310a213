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

from bdcore.chat import chat_ids
from bdcore.checkpoint_files import first_line
from train.config import FlagError
from train.rows import Sample, two_stream_length
from train.single_stream import single_stream_length

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


class DataError(FlagError):
    """The --dataset source cannot give a single training sample; `stats` counts what was read."""

    def __init__(self, problem: str, stats: DataStats | None = None):
        super().__init__("--dataset", problem)
        self.stats = stats


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
    """(where, record) from a .jsonl file, a directory of .jsonl files, or a hub dataset id.

    A missing source raises DataError here, not at the first record. A line that is not UTF-8 or
    not JSON yields a `SkipSample` in place of a record; a blank line yields None.
    """
    path = Path(source)
    if path.is_dir():
        files = sorted(path.rglob("*.jsonl"))
        if not files:
            raise DataError(
                f"{source}: the directory holds no .jsonl files; pass a .jsonl file or a directory that holds some"
            )
    elif path.is_file():
        files = [path]
    elif path.exists():  # /dev/null, a pipe, a socket: "no such file" would send the user looking for a typo
        raise DataError(
            f"{source}: not a regular file or directory (a device, pipe or socket); pass a .jsonl file, a directory "
            "of .jsonl files, or a hub dataset id"
        )
    elif path.suffix == ".jsonl" or source.startswith((".", "/", "~")):
        raise DataError(
            f"{source}: no such file or directory; pass an existing .jsonl file, a directory of .jsonl files, "
            "or a hub dataset id"
        )
    else:
        return _iter_hub(source)
    return _iter_files(files)


def _iter_files(files: list[Path]) -> Iterator[tuple[str, object]]:
    for f in files:
        with open(f, "rb") as fh:
            for n, raw in enumerate(fh, 1):
                yield f"{f}:{n}", _parse_line(raw)


def _parse_line(raw: bytes) -> object:
    """One JSONL line -> a record, or the SkipSample that says why it is none (blank lines: None)."""
    try:
        # utf-8-sig: editors on Windows start a file with a byte-order mark, which json rejects.
        line = raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        return SkipSample("not_utf8")
    if not line.strip():
        return None
    try:
        return json.loads(line)
    except (json.JSONDecodeError, RecursionError):  # json recurses per `[` or `{`: deep nesting overflows it
        return SkipSample("malformed_json")


def _iter_hub(name: str) -> Iterator[tuple[str, object]]:
    try:
        import datasets
    except ImportError as e:
        raise DataError(
            f"{name}: not a local path, and loading it from the hub needs `datasets` "
            "(pip install datasets), or pass a local .jsonl file or directory"
        ) from e
    split = "train"
    if ":" in name:
        name, split = name.split(":", 1)
    try:
        records = datasets.load_dataset(name, split=split)
    except Exception as e:  # the hub client raises many types; each means "cannot load this id"
        reason = first_line(e)
        raise DataError(
            f"{name} (split {split!r}) cannot be loaded from the hub ({reason}); check the id and split "
            "(name:split) and the network, or pass a local .jsonl file or directory"
        ) from e
    return ((f"{name}[{i}]", rec) for i, rec in enumerate(records))


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
        msg = {k: v for k, v in m.items() if k not in (role_key, content_key)}
        msg.update(role=role, content=_text_content(m.get(content_key)))
        messages.append(msg)
    if not any(m["role"] == "assistant" for m in messages):
        raise SkipSample("no_assistant_turn")
    tools = record.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise SkipSample("bad_tools")
    return messages, tools


def _text_content(content) -> str:
    """A message's content as text: a string, or a list of text parts joined (OpenAI / HF multimodal form).

    Any other part (an image, audio, a number) would reach the chat template as its Python repr, or
    be dropped by it silently, so such a message cannot be trained on as text.
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise SkipSample("bad_content")
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict) and part.get("type", "text") == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            raise SkipSample("non_text_content")
    return "".join(texts)


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
            return chat_ids(self.tok, messages, tools=tools, generation_prompt=generation_prompt, **self.kwargs)
        except Exception as e:  # a template may raise on content it does not accept
            raise SkipSample("template_error") from e

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
    single_stream: bool = False,
    progress: bool = False,
    chat_template_kwargs: dict | None = None,
) -> tuple[list[Sample], DataStats]:
    """Tokenize every record; skip (and count) what cannot be trained on. `max_length` bounds the
    two-stream row (L + views * padded response tokens), or with `single_stream` the single-stream one
    (L + the fillers that close each response's last block)."""
    conv = ConversationTokenizer(tokenizer, eot_id, multiturn=multiturn, chat_template_kwargs=chat_template_kwargs)
    stats = DataStats()
    samples: list[Sample] = []
    try:
        records = iter_records(source)
    except DataError as e:
        e.stats = stats
        raise
    if progress:
        from tqdm import tqdm

        records = tqdm(
            records, desc="tokenize", unit=" rec", dynamic_ncols=True, mininterval=0.2 if sys.stderr.isatty() else 30.0
        )
    for _, rec in records:
        if rec is None:
            continue
        stats.records += 1
        try:
            if isinstance(rec, SkipSample):
                raise rec
            messages, tools = normalize(rec)
            sample = conv(messages, tools, stats)
            if max_response_length and max(e - s for s, e in sample.spans) > max_response_length:
                raise SkipSample("response_too_long")
            if single_stream:
                length = single_stream_length(sample, bd_size)
            else:
                length = two_stream_length(sample, bd_size, views)
            if length > max_length:
                raise SkipSample("too_long")
        except SkipSample as s:
            stats.skipped[s.reason] += 1
            continue
        samples.append(sample)
        stats.kept += 1
    if stats.records == 0:
        raise DataError(f"{source}: is empty (no records); pass a dataset of conversations (JSONL: one a line)", stats)
    if not samples:
        raise DataError(
            f"{source}: no usable samples out of {stats.records} records "
            f"(skipped: {dict(stats.skipped) or 'none'}); check the format (messages/conversations), "
            "the chat template and --max_length",
            stats,
        )
    return samples, stats


def heldout_answers(
    source: str, tokenizer, eot_id: int, *, limit: int | None = None, chat_template_kwargs: dict | None = None
) -> list[tuple[list[int], int]]:
    """Per record of a chat dataset, its last answer rendered as the training rows render it: ([prompt,
    answer] ids ending with the end-of-turn token, the answer's first position). What the drafting metric
    (`bdcore.decode.policy.draft_quality`) scores, in the trainer (`--eval_data`) and in `benchmark.draft_quality`."""
    samples, _ = load_samples(
        source,
        tokenizer,
        eot_id,
        multiturn=False,
        max_length=1 << 62,
        max_response_length=None,
        bd_size=2,
        views=0,
        chat_template_kwargs=chat_template_kwargs,
    )
    out = [(list(s.input_ids[: s.spans[-1][1]]), s.spans[-1][0]) for s in samples]
    return out[:limit] if limit else out
