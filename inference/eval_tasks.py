"""Evaluation tasks: loading problems (hub or local JSONL in the hub's schema), prompts, answer extraction.

gsm8k:    openai/gsm8k (main, test): `question`, `answer` ending in "#### <number>".
          Scored like lm-eval's gsm8k: "strict" reads the number after "####", "flexible" the last
          number in the reply; accuracy is the flexible match.
mmlu_pro: TIGER-Lab/MMLU-Pro (test): `question`, `options` (up to 10), `answer` (a letter), `category`.
          The reply's "answer is (X)" is read, else its last standalone option letter.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

LETTERS = "ABCDEFGHIJ"


@dataclass
class Problem:
    id: str
    messages: list[dict]
    reference: str
    meta: dict = field(default_factory=dict)


def _number(text: str) -> str | None:
    text = text.replace(",", "").replace("$", "").strip().rstrip(".")
    try:
        value = float(text)
    except ValueError:
        return None
    return str(int(value)) if value.is_integer() else str(value)


class GSM8K:
    name = "gsm8k"
    hub = ("openai/gsm8k", "main", "test")
    instruction = "Solve the problem step by step. Write the final answer as a number after '####'."

    def problem(self, i: int, row: dict) -> Problem:
        ref = _number(row["answer"].split("####")[-1])
        msgs = [{"role": "user", "content": f"{row['question']}\n{self.instruction}"}]
        return Problem(str(row.get("id", i)), msgs, ref)

    def score(self, p: Problem, text: str) -> dict:
        strict = re.search(r"####\s*(-?[\d,]*\.?\d+)", text)
        nums = re.findall(r"-?[\d,]*\.?\d+", text)
        strict_ans = _number(strict.group(1)) if strict else None
        flex_ans = _number(nums[-1]) if nums else None
        return {"correct": flex_ans == p.reference, "strict_correct": strict_ans == p.reference, "extracted": flex_ans}

    def aggregate(self, scores: list[dict]) -> dict:
        n = max(1, len(scores))
        return {
            "accuracy": sum(s["correct"] for s in scores) / n,
            "strict_accuracy": sum(s["strict_correct"] for s in scores) / n,
        }


class MMLUPro:
    name = "mmlu_pro"
    hub = ("TIGER-Lab/MMLU-Pro", None, "test")

    def problem(self, i: int, row: dict) -> Problem:
        opts = "\n".join(f"{LETTERS[j]}. {o}" for j, o in enumerate(row["options"]))
        content = (
            f"{row['question']}\n\n{opts}\n\nThink step by step, then finish with "
            '"The answer is (X)" where X is the letter of the correct option.'
        )
        return Problem(
            str(row.get("question_id", i)),
            [{"role": "user", "content": content}],
            row["answer"],
            {"category": row.get("category", "")},
        )

    def score(self, p: Problem, text: str) -> dict:
        m = re.findall(r"answer is \(?([A-J])\)?", text)
        letter = m[-1] if m else None
        if letter is None:
            loose = re.findall(r"\b([A-J])\b", text)
            letter = loose[-1] if loose else None
        return {"correct": letter == p.reference, "extracted": letter, "category": p.meta.get("category", "")}

    def aggregate(self, scores: list[dict]) -> dict:
        n = max(1, len(scores))
        by_cat: dict[str, list[bool]] = {}
        for s in scores:
            by_cat.setdefault(s["category"], []).append(s["correct"])
        return {
            "accuracy": sum(s["correct"] for s in scores) / n,
            "by_category": {k: sum(v) / len(v) for k, v in sorted(by_cat.items())},
        }


TASKS = {t.name: t for t in (GSM8K(), MMLUPro())}


def load_problems(task, data_file: str | None) -> list[Problem]:
    """Problems from a local JSONL (the hub dataset's schema) or from the hub via `datasets`."""
    if data_file:
        rows = [json.loads(line) for line in open(data_file) if line.strip()]
    else:
        try:
            import datasets
        except ImportError as e:
            raise SystemExit(
                f"{task.name}: loading from the hub needs `datasets` (pip install datasets), "
                "or pass --data-file with a local JSONL"
            ) from e
        path, config, split = task.hub
        rows = list(datasets.load_dataset(path, config, split=split))
    return [task.problem(i, row) for i, row in enumerate(rows)]
