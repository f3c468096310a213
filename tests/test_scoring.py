"""Answer scoring (bdcore/scoring.py) as RL rewards and evaluation use it: an answer without a number is
never a GSM8K match, and a reference that holds no number is refused where it is loaded (RL: counted and
never drawn; evaluation: reported as invalid), never scored."""

import json
import subprocess
import sys

import pytest

from inference.eval_tasks import TASKS, Problem
from tests.conftest import REPO, train_py_error
from tests.train_args import train_args
from train.rewards import checked_reward, load_reward, unreadable_references

GSM = TASKS["gsm8k"]


def test_a_numberless_answer_never_matches():
    gsm = load_reward("gsm8k")
    assert gsm("The answer is 42.", "#### 42") == 1.0
    assert gsm("I am not sure", "#### 42") == 0.0
    with pytest.raises(ValueError, match="unreadable reference"):
        gsm("I am not sure", "The answer is 42.")  # None == None used to pay 1.0


def test_a_negative_answer_keeps_its_sign():
    """A number's leading '-' is part of it (lm-eval's flexible match reads it too): a correct negative
    answer scores 1 as an RL reward and in GSM8K accuracy, and the positive one scores 0."""
    gsm = load_reward("gsm8k")
    assert gsm("The balance falls by 12, to -7.", "#### -7") == 1.0
    assert gsm("It is 7.", "#### -7") == 0.0
    problem = GSM.problem(0, {"question": "q", "answer": "#### -7"})
    assert problem.reference == "-7"
    assert GSM.score(problem, "so -7\n#### -7") == {"correct": True, "strict_correct": True, "extracted": "-7"}
    assert GSM.score(problem, "so 7")["correct"] is False


def test_unreadable_references_are_named_per_reward():
    refs = ["#### 7", "18", "The answer is 42.", "1 2 3", "#### nan"]
    assert sorted(unreadable_references("gsm8k", refs)) == [2, 3, 4]
    assert unreadable_references("exact", refs) == {} and unreadable_references("pkg.mod:f", refs) == {}


def test_a_reward_value_must_be_a_finite_number():
    assert checked_reward("r", lambda a, b: True, "x", "y") == 1.0
    assert checked_reward("r", lambda a, b: 2, "x", "y") == 2.0
    for value in (float("nan"), float("inf"), "1.0", None, [1.0]):
        with pytest.raises(ValueError, match="--rl_reward: the reward r on the answer 'x'"):
            checked_reward("r", lambda a, b, v=value: v, "x", "y")


def test_evaluation_reports_an_unreadable_reference_as_invalid():
    rows = [{"question": "q", "answer": "#### 5"}, {"question": "q", "answer": "no number here"}]
    good, bad = (GSM.problem(i, r) for i, r in enumerate(rows))
    assert bad.reference is None
    scores = [GSM.score(good, "#### 5"), GSM.score(bad, "no idea"), GSM.score(good, "no idea")]
    assert scores[1]["invalid"] and not scores[1]["correct"]
    assert not scores[2]["correct"], "an answer without a number never matches"
    assert GSM.aggregate(scores) == {"accuracy": 0.5, "strict_accuracy": 0.5, "invalid": 1}
    assert TASKS["chat"].score(Problem("", [], " 7\n"), "7")["correct"]


def _rl_gsm8k_args(kit, run, dataset):
    rl = dict(rl_diffusion_rollout=True, rl_reward="gsm8k", rl_group_size=2, rl_prompts_per_step=1)
    return train_args(kit, run, max_steps=1, dataset=dataset, rl_max_new_tokens=4, **rl)


def _rl_gsm8k(kit, run, dataset):
    args = _rl_gsm8k_args(kit, run, dataset)
    return subprocess.run([sys.executable, "train.py", *args], cwd=REPO, capture_output=True, text=True, timeout=300)


@pytest.mark.e2e
def test_rl_counts_the_references_it_cannot_score_and_refuses_data_with_none(demo_kit, tmp_path, capfd):
    lines = (demo_kit / "train.jsonl").read_text().splitlines()
    unreadable = sum(json.loads(x)["task"] != "add" for x in lines)  # sorted digits and words hold no one number
    proc = _rl_gsm8k(demo_kit, tmp_path / "mixed", demo_kit / "train.jsonl")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"--rl_reward gsm8k cannot score {unreadable} of {len(lines)} references" in proc.stdout + proc.stderr
    words = tmp_path / "words.jsonl"
    words.write_text("".join(x + "\n" for x in lines if json.loads(x)["task"] in ("rev", "copy")))
    last = train_py_error(_rl_gsm8k_args(demo_kit, tmp_path / "words", words), capfd)[-1]
    assert not (tmp_path / "words" / "final").exists()
    assert last.startswith("train.py: error: --rl_reward: gsm8k can score none of"), last
