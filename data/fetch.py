"""Fetch training and evaluation sets from the Hugging Face hub and write them in our JSONL forms.

    python -m data.fetch ultrachat --out data/cache/ultrachat.jsonl [--limit 20000]
    python -m data.fetch gsm8k --out data/cache/gsm8k.jsonl
    python -m data.fetch --list

SFT sets become trainer JSONL (`{"messages": [...]}`); evaluation sets keep the hub schema that
`inference/eval.py --data-file` reads. Every output gets `<out>.sha256` (and the command prints the
digest) so a run can name exactly the data it used. Needs `datasets` and network access to the hub;
`data/DATA_CATALOG.md` lists each set's license, size and command.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path


def _messages(row: dict) -> dict | None:
    msgs = row.get("messages")
    if not isinstance(msgs, list) or not msgs:
        return None
    return {"messages": [{"role": m["role"], "content": m["content"]} for m in msgs]}


def _sharegpt(row: dict) -> dict | None:
    roles = {"human": "user", "gpt": "assistant", "system": "system"}
    conv = row.get("conversations") or []
    msgs = [{"role": roles.get(m.get("from"), "user"), "content": m.get("value", "")} for m in conv]
    return {"messages": msgs} if msgs else None


def _keep(fields: tuple[str, ...]) -> Callable[[dict], dict]:
    return lambda row: {k: row[k] for k in fields}


@dataclass(frozen=True)
class Source:
    hub: str
    config: str | None
    split: str
    convert: Callable[[dict], dict | None]
    kind: str  # "sft" | "eval"
    license: str
    about: str


SOURCES: dict[str, Source] = {
    "ultrachat": Source(
        "HuggingFaceH4/ultrachat_200k",
        None,
        "train_sft",
        _messages,
        "sft",
        "MIT",
        "multi-turn chat, 208k conversations",
    ),
    "tulu3": Source(
        "allenai/tulu-3-sft-mixture",
        None,
        "train",
        _messages,
        "sft",
        "ODC-BY-1.0",
        "instruction mixture (math, code, chat, safety), 939k conversations",
    ),
    "openhermes": Source(
        "teknium/OpenHermes-2.5",
        None,
        "train",
        _sharegpt,
        "sft",
        "see dataset card (mixed sources)",
        "ShareGPT-style instructions, 1.0M conversations",
    ),
    "gsm8k": Source(
        "openai/gsm8k",
        "main",
        "test",
        _keep(("question", "answer")),
        "eval",
        "MIT",
        "grade-school math, 1319 test problems",
    ),
    "mmlu_pro": Source(
        "TIGER-Lab/MMLU-Pro",
        None,
        "test",
        _keep(("question_id", "question", "options", "answer", "category")),
        "eval",
        "MIT",
        "10-option multiple choice, 12032 test questions",
    ),
    "ifeval": Source(
        "google/IFEval",
        None,
        "train",
        _keep(("key", "prompt", "instruction_id_list", "kwargs")),
        "eval",
        "Apache-2.0",
        "verifiable instruction following, 541 prompts",
    ),
}


def write_jsonl(rows: Iterable[dict], convert, out: Path, limit: int = 0) -> tuple[int, int, str]:
    """Convert and write rows; return (written, skipped, sha256 of the file). Writes `<out>.sha256`."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    digest, written, skipped = hashlib.sha256(), 0, 0
    with open(tmp, "w") as f:
        for row in rows:
            rec = convert(row)
            if rec is None:
                skipped += 1
                continue
            line = json.dumps(rec, ensure_ascii=False) + "\n"
            f.write(line)
            digest.update(line.encode())
            written += 1
            if limit and written >= limit:
                break
    tmp.replace(out)
    out.with_name(out.name + ".sha256").write_text(f"{digest.hexdigest()}  {out.name}\n")
    return written, skipped, digest.hexdigest()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name", nargs="?", choices=sorted(SOURCES))
    p.add_argument("--out", type=Path, default=None, help="output JSONL (default data/cache/<name>.jsonl)")
    p.add_argument("--limit", type=int, default=0, help="stop after N rows (0: all)")
    p.add_argument("--list", action="store_true", help="list the sets")
    args = p.parse_args(argv)
    if args.list or not args.name:
        for name, s in SOURCES.items():
            print(f"{name:12} {s.kind:5} {s.hub:32} {s.license:32} {s.about}")
        return 0
    try:
        import datasets
    except ImportError as e:
        raise SystemExit("data.fetch needs `datasets` (pip install datasets) and network access to the hub") from e
    src = SOURCES[args.name]
    out = args.out or Path("data/cache") / f"{args.name}.jsonl"
    rows = datasets.load_dataset(src.hub, src.config, split=src.split, streaming=True)
    written, skipped, sha = write_jsonl(rows, src.convert, out, args.limit)
    print(f"{out}: {written} rows ({skipped} skipped), sha256 {sha}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
