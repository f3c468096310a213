"""Evaluation tasks: loading problems (hub or local JSONL in the hub's schema), prompts, answer extraction.

gsm8k:    openai/gsm8k (main, test): `question`, `answer` ending in "#### <number>".
          Scored like lm-eval's gsm8k: "strict" reads the number after "####", "flexible" the last
          number in the reply; accuracy is the flexible match.
mmlu_pro: TIGER-Lab/MMLU-Pro (test): `question`, `options` (up to 10), `answer` (a letter), `category`.
          The reply's "answer is (X)" is read, else its last standalone option letter.
chat:     any chat JSONL whose last message is the assistant's reference answer (`--data-file` only):
          exact match after stripping whitespace (the demo kit's eval.jsonl is one).
ifeval:   google/IFEval (train): `key`, `prompt`, `instruction_id_list`, `kwargs`. Scored by lm-eval's own
          IFEval checkers (`pip install "lm-eval[ifeval]"`; nltk fetches its punkt_tab data once, so the
          first run needs network): prompt- and instruction-level accuracy, strict and loose.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from bdcore.scoring import exact_match, gsm8k_reference, last_number, numbers_match, strict_number

LETTERS = "ABCDEFGHIJ"


@dataclass
class Problem:
    id: str
    messages: list[dict]
    reference: str
    meta: dict = field(default_factory=dict)


class GSM8K:
    name = "gsm8k"
    hub = ("openai/gsm8k", "main", "test")
    instruction = "Solve the problem step by step. Write the final answer as a number after '####'."

    def problem(self, i: int, row: dict) -> Problem:
        ref = gsm8k_reference(row["answer"])
        msgs = [{"role": "user", "content": f"{row['question']}\n{self.instruction}"}]
        return Problem(str(row.get("id", i)), msgs, ref)

    def score(self, p: Problem, text: str) -> dict:
        flex_ans = last_number(text)
        if p.reference is None:  # the row's answer holds no number: reported as invalid, never scored
            return {"correct": False, "strict_correct": False, "extracted": flex_ans, "invalid": True}
        return {
            "correct": numbers_match(flex_ans, p.reference),
            "strict_correct": numbers_match(strict_number(text), p.reference),
            "extracted": flex_ans,
        }

    def aggregate(self, scores: list[dict]) -> dict:
        valid = [s for s in scores if not s.get("invalid")]
        n = max(1, len(valid))
        return {
            "accuracy": sum(s["correct"] for s in valid) / n,
            "strict_accuracy": sum(s["strict_correct"] for s in valid) / n,
            "invalid": len(scores) - len(valid),  # rows whose reference has no number: out of the accuracy
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


class IFEval:
    name = "ifeval"
    hub = ("google/IFEval", None, "train")

    def __init__(self, checker=None):
        self._checker = checker  # (doc, [response]) -> lm-eval's four metrics; injectable for tests

    @property
    def checker(self):
        if self._checker is None:
            try:
                from lm_eval.tasks.ifeval.utils import process_results
            except ImportError as e:
                raise SystemExit('ifeval is scored by lm-eval: pip install "lm-eval[ifeval]"') from e
            self._checker = process_results
        return self._checker

    def problem(self, i: int, row: dict) -> Problem:
        doc = {k: row[k] for k in ("key", "prompt", "instruction_id_list", "kwargs")}
        return Problem(str(row.get("key", i)), [{"role": "user", "content": row["prompt"]}], "", {"doc": doc})

    def score(self, p: Problem, text: str) -> dict:
        r = self.checker(p.meta["doc"], [text])
        return {"correct": bool(r["prompt_level_strict_acc"]), **{k: r[k] for k in r}}

    def aggregate(self, scores: list[dict]) -> dict:
        n = max(1, len(scores))
        inst = {k: [x for s in scores for x in s[k]] for k in ("inst_level_strict_acc", "inst_level_loose_acc")}
        return {
            "accuracy": sum(s["prompt_level_strict_acc"] for s in scores) / n,
            "prompt_level_strict_acc": sum(s["prompt_level_strict_acc"] for s in scores) / n,
            "prompt_level_loose_acc": sum(s["prompt_level_loose_acc"] for s in scores) / n,
            "inst_level_strict_acc": sum(inst["inst_level_strict_acc"]) / max(1, len(inst["inst_level_strict_acc"])),
            "inst_level_loose_acc": sum(inst["inst_level_loose_acc"]) / max(1, len(inst["inst_level_loose_acc"])),
        }


class ChatExact:
    name = "chat"
    hub = None

    def problem(self, i: int, row: dict) -> Problem:
        msgs = row["messages"]
        if not msgs or msgs[-1]["role"] != "assistant":
            raise ValueError(f"chat task: row {i} does not end with the assistant's reference answer")
        return Problem(str(row.get("id", i)), msgs[:-1], msgs[-1]["content"], {"task": row.get("task", "")})

    def score(self, p: Problem, text: str) -> dict:
        return {"correct": exact_match(text, p.reference), "group": p.meta.get("task", "")}

    def aggregate(self, scores: list[dict]) -> dict:
        groups: dict[str, list[bool]] = {}
        for s in scores:
            groups.setdefault(s["group"], []).append(s["correct"])
        return {
            "accuracy": sum(s["correct"] for s in scores) / max(1, len(scores)),
            "by_group": {k: sum(v) / len(v) for k, v in sorted(groups.items())},
        }


TASKS = {t.name: t for t in (GSM8K(), MMLUPro(), IFEval(), ChatExact())}


def load_problems(task, data_file: str | None) -> list[Problem]:
    """Problems from a local JSONL (the hub dataset's schema) or from the hub via `datasets`."""
    if data_file:
        rows = [json.loads(line) for line in open(data_file) if line.strip()]
    elif task.hub is None:
        raise SystemExit(f"{task.name}: give --data-file (this task has no hub dataset)")
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
