"""The one schema of a recorded benchmark run: what the benchmarks write (`--record PATH`) and what
`python -m benchmark.report` reads to make docs/results.md and its plots.

A record is one JSON object per file, one run of one command:

    {"schema": 1, "kind": "speed", "title": "...", "command": "python -m benchmark...", "machine": "...",
     "date": "2026-12-05", "source": "where it was recorded", "rows": [{...}, ...], ...optional fields}

`kind` picks the rows' fields (ROW_FIELDS): `speed` (a variant's tok/s at a concurrency, against causal and
the base model's `generate`), `scaling` (drafting and `auto` speed against training minutes),
`diffusion_quality` (accuracy against tokens per forward per setting), `mode_quality` (pass@1 and agreement
with the base model per mode, temperature and task) or `arms` (training recipes side by side at one budget,
scored by the drafting metric and served). A record that breaks the schema is
refused with the file and the field named, so a typo cannot silently drop a figure from the page.

The results page shows today's figures only. When a newer run answers a record's question (the scaling
curve of today's recipe; speed at 1 and 8 requests on a machine family; diffusion quality; quality per
mode), give the older record `"superseded_by": "<the newer record's file name>.json"`: it stays in the data
folder and moves from docs/results.md and its plots to docs/history/results-older.md. The name must be
another record of the same folder (`load_all` checks it), so a typo cannot hide a run.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
from pathlib import Path

SCHEMA = 1

# field -> (accepted JSON type, required); "number" is an int or float (never a bool, never NaN or infinite)
RECORD_FIELDS = {
    "schema": ("int", True),
    "kind": ("str", True),
    "title": ("str", True),
    "command": ("str", True),  # the command that produced the rows, as run
    "machine": ("str", True),  # cores, CPU or GPU model
    "date": ("date", True),  # YYYY-MM-DD, the day the rows were measured (or recorded)
    "source": ("str", True),  # where the rows were taken from: a notebook section, or the benchmark that wrote them
    "rows": ("rows", True),
    "label": ("str", False),  # a short name for plot legends (default: the title)
    "model": ("str", False),  # the checkpoint measured, in words
    "dtype": ("str", False),
    "series": ("str", False),  # records sharing a series are one line set in a plot (e.g. concurrency 1 and 8)
    "notes": ("str", False),  # one paragraph printed under the table
    "speed_withdrawn": ("str", False),  # why the record's speed figures no longer hold (tokens per forward do)
    "superseded_by": ("str", False),  # the newer record (a file name in the same folder): history page only
}

ROW_FIELDS = {
    "speed": {
        "variant": ("str", True),  # "base generate", "causal", "diffusion", "self-spec auto", ...
        "concurrency": ("int", True),
        "run": ("int", False),  # repeated runs of one command, numbered from 1
        "tok_s": ("number", False),  # total: every request's tokens over the run's wall time
        "tok_s_per_request": ("number", False),  # per user: the mean over requests of tokens over its latency
        "tokens_per_forward": ("number", False),
        "acceptance_length": ("number", False),  # self-spec: tokens per draft-verify cycle, the verifier's included
        "vs_causal": ("number", False),  # given where only the ratio was recorded; else tok_s / causal's
        "vs_base": ("number", False),  # likewise, against the base model's `generate`
        "same_as_causal": ("number", False),  # share of outputs identical to causal decoding's, 0..1
        "accuracy": ("number", False),  # 0..1
    },
    "scaling": {
        "minutes": ("number", True),  # training minutes (idle CPU minutes where the notebook says so)
        "step": ("int", False),
        "tokens": ("number", False),  # training tokens seen by then (the trainer's metrics.jsonl)
        "implied_linear": ("number", False),  # tokens per forward implied by the one-forward drafting metric
        "implied_all": ("number", False),
        "served_linear": ("number", False),  # tokens per forward served (greedy, self-spec N = bd_size)
        "served_all": ("number", False),
        "auto_vs_causal": ("number", False),  # self-spec auto tok/s over our causal mode's
        "auto_vs_base": ("number", False),  # self-spec auto tok/s over the base model's generate
    },
    "arms": {  # recipes side by side from one starting point at an equal budget (benchmark/recipe_sweep.py)
        "arm": ("str", True),  # what the arm changes, in words or flags
        "minutes": ("number", True),  # training minutes (idle-equivalent where the notes say how)
        "steps": ("int", False),
        "tokens": ("number", False),
        "first_accepted": ("number", False),  # 0..1, the drafting metric's first-draft acceptance
        "implied_linear": ("number", False),
        "implied_all": ("number", False),
        "served_linear": ("number", False),  # acceptance length served (self-spec last), greedy
        "auto_vs_causal": ("number", False),
        "auto_vs_base": ("number", False),
        "ar_loss": ("number", False),  # the AR head's held-out loss: unchanged when the base is kept
    },
    "diffusion_quality": {
        "setting": ("str", True),  # "causal", "threshold 0.9", ...
        "accuracy": ("number", True),  # 0..1
        "tokens_per_forward": ("number", True),
        "threshold": ("number", False),
    },
    "mode_quality": {  # benchmark/mode_quality.py
        "variant": ("str", True),  # "base generate", "causal", "self-spec auto", "diffusion t=0.9", ...
        "task": ("str", True),  # "humaneval", "stdlib"
        "temperature": ("number", True),
        "prompts": ("int", True),
        "tokens_per_forward": ("number", True),
        "pass_at_1": ("number", False),  # 0..1, where the task has tests
        "same_as_causal": ("number", False),  # 0..1, temperature 0: equal to our causal mode's answer
        "agree_exact": ("number", False),  # 0..1, temperature 0: equal to the base model's greedy answer
        "agree_prefix": ("number", False),  # 0..1, tokens equal up to the first difference, over the longer answer
    },
}
KINDS = tuple(ROW_FIELDS)
# a speed row must say how fast in at least one of these
SPEED_FIGURES = ("tok_s", "vs_causal", "vs_base")
SHARES = ("same_as_causal", "accuracy", "pass_at_1", "agree_exact", "agree_prefix", "first_accepted")
BASELINE, CAUSAL = "base generate", "causal"  # the speed rows every ratio is taken against
VLLM = "stock vLLM"  # the base model on stock vLLM's CPU build (bench_decode --vllm): a ratio where a run has it


class RecordError(ValueError):
    """A record file that breaks the schema; the message names the file and the field."""


def _type_error(kind: str, value) -> str | None:
    """Why `value` is not of schema type `kind`, or None when it is."""
    if kind == "str":
        return None if isinstance(value, str) and value.strip() else "expected a non-empty string"
    if kind == "int":
        return None if isinstance(value, int) and not isinstance(value, bool) else "expected an integer"
    if kind == "number":
        if isinstance(value, bool) or not isinstance(value, int | float):
            return "expected a number"
        return None if math.isfinite(value) else "expected a finite number"
    if kind == "date":
        try:
            datetime.date.fromisoformat(value)
            return None if len(value) == 10 else "expected a date as YYYY-MM-DD"
        except (TypeError, ValueError):
            return "expected a date as YYYY-MM-DD"
    if kind == "rows":
        return None if isinstance(value, list) and value else "expected a non-empty list of rows"
    raise AssertionError(kind)


def _check_fields(obj, fields: dict, where: str, prefix: str) -> None:
    if not isinstance(obj, dict):
        raise RecordError(f"{where}: {prefix or 'record'}: expected a JSON object")
    for name in obj:
        if name not in fields:
            raise RecordError(f"{where}: field '{prefix}{name}': unknown (known: {', '.join(fields)})")
    for name, (kind, required) in fields.items():
        if name not in obj:
            if required:
                raise RecordError(f"{where}: field '{prefix}{name}': missing")
            continue
        why = _type_error(kind, obj[name])
        if why:
            raise RecordError(f"{where}: field '{prefix}{name}': {why}, got {obj[name]!r}")


def validate(record, where: str) -> dict:
    """`record` if it follows the schema, else RecordError naming `where` (the file) and the field."""
    _check_fields(record, RECORD_FIELDS, where, "")
    if record["schema"] != SCHEMA:
        raise RecordError(f"{where}: field 'schema': this reader knows version {SCHEMA}, got {record['schema']!r}")
    if record["kind"] not in ROW_FIELDS:
        raise RecordError(f"{where}: field 'kind': expected one of {', '.join(KINDS)}, got {record['kind']!r}")
    for i, row in enumerate(record["rows"]):
        _check_fields(row, ROW_FIELDS[record["kind"]], where, f"rows[{i}].")
        for share in SHARES:
            if share in row and not 0 <= row[share] <= 1:
                raise RecordError(f"{where}: field 'rows[{i}].{share}': a share in [0, 1], got {row[share]!r}")
        if record["kind"] == "speed" and not any(f in row for f in SPEED_FIGURES):
            raise RecordError(f"{where}: field 'rows[{i}]': a speed row needs one of {', '.join(SPEED_FIGURES)}")
    newer = record.get("superseded_by")
    if newer is not None and (not newer.endswith(".json") or "/" in newer or "\\" in newer):
        raise RecordError(
            f"{where}: field 'superseded_by': expected the newer record's file name (NAME.json, in the same "
            f"folder), got {newer!r}"
        )
    return record


def is_current(record: dict) -> bool:
    """Whether the record belongs on the results page (no newer run superseded it)."""
    return "superseded_by" not in record


def speed_rows(record: dict) -> list[dict]:
    """A speed record's rows with tok/s and the ratios filled in where the others give them: a ratio is
    taken against the causal (or base generate, or stock vLLM: `vs_vllm`) row of the same run and concurrency."""
    rows = [dict(r) for r in record["rows"]]
    key = lambda r: (r.get("run"), r["concurrency"])  # noqa: E731
    causal = {key(r): r for r in rows if r["variant"] == CAUSAL}
    base = {key(r): r for r in rows if r["variant"] == BASELINE}
    vllm = {key(r): r for r in rows if r["variant"] == VLLM}
    for r in rows:
        c, b, v = causal.get(key(r)), base.get(key(r)), vllm.get(key(r))
        if "tok_s" not in r and "vs_causal" in r and c is not None and "tok_s" in c:
            r["tok_s"] = r["vs_causal"] * c["tok_s"]
        if "tok_s" in r and c is not None and "tok_s" in c:
            r.setdefault("vs_causal", r["tok_s"] / c["tok_s"])
        if "tok_s" in r and b is not None and "tok_s" in b:
            r.setdefault("vs_base", r["tok_s"] / b["tok_s"])
        if "tok_s" in r and v is not None and "tok_s" in v:
            r["vs_vllm"] = r["tok_s"] / v["tok_s"]
    return rows


def load(path: Path) -> dict:
    """One record file, validated."""
    try:
        record = json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise RecordError(f"{path}: not JSON: {e}") from e
    return validate(record, str(path))


def load_all(folder: Path) -> list[tuple[Path, dict]]:
    """Every `*.json` record in `folder`, by file name; each `superseded_by` names another of them."""
    paths = sorted(Path(folder).glob("*.json"))
    if not paths:
        raise RecordError(f"{folder}: no *.json records")
    records = [(p, load(p)) for p in paths]
    names = {p.name for p in paths}
    for path, record in records:
        newer = record.get("superseded_by")
        if newer is not None and (newer == path.name or newer not in names):
            why = "names the record itself" if newer == path.name else f"names no record in {folder}"
            raise RecordError(f"{path}: field 'superseded_by': {why}, got {newer!r}")
    return records


def this_machine() -> str:
    """The machine a benchmark runs on, in words: cores and CPU model, and the GPU when one is used."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    words = f"{os.cpu_count()}-core {model}"
    try:
        import torch

        if torch.cuda.is_available():
            words += f", {torch.cuda.get_device_name()}"
    except ImportError:
        pass
    return words


def make(kind: str, rows: list[dict], *, title: str, command: str, source: str, **optional) -> dict:
    """A validated record of a run measured now on this machine. Rows' fields outside the schema and figures
    that are not finite (a NaN accuracy where no reference exists) are left out; optional record fields
    given as None are left out."""
    known = ROW_FIELDS[kind]
    clean = []
    for row in rows:
        kept = {}
        for name, value in row.items():
            if name not in known or value is None:
                continue
            if isinstance(value, float) and not math.isfinite(value):
                continue
            kept[name] = value
        clean.append(kept)
    record = {
        "schema": SCHEMA,
        "kind": kind,
        "title": title,
        "command": command,
        "machine": this_machine(),
        "date": datetime.date.today().isoformat(),
        "source": source,
        **{k: v for k, v in optional.items() if v is not None},
        "rows": clean,
    }
    return validate(record, f"<{kind} record for {title}>")


def write(path: Path, record: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
