"""eval.py: scoring on hand-made answers; end to end against the native server with shards and merge."""

import json

import pytest

from inference import eval as evaluate
from inference.eval_tasks import TASKS, load_problems
from tests.conftest import REPO, native_server
from tests.tiny import tiny_checkpoint

pytestmark = pytest.mark.e2e  # a whole program, server or long sweep: `pytest -m 'not e2e'` skips it

FIX = REPO / "tests" / "fixtures"


def test_gsm8k_scoring_right_and_wrong():
    task = TASKS["gsm8k"]
    p = load_problems(task, FIX / "gsm8k.jsonl")
    assert [x.reference for x in p] == ["7", "36", "2000", "6"]
    assert task.score(p[0], "3 plus 4 is 7.\n#### 7") == {"correct": True, "strict_correct": True, "extracted": "7"}
    assert task.score(p[2], "In all 2,000 meters.")["correct"]  # flexible: last number, commas dropped
    assert not task.score(p[2], "In all 2,000 meters.")["strict_correct"]
    assert not task.score(p[1], "#### 35")["correct"] and not task.score(p[3], "no idea")["correct"]
    assert task.score(p[1], "#### $36.00")["correct"]
    agg = task.aggregate([task.score(p[0], "#### 7"), task.score(p[1], "#### 1")])
    assert agg == {"accuracy": 0.5, "strict_accuracy": 0.5, "invalid": 0}


def test_mmlu_pro_scoring_right_and_wrong():
    task = TASKS["mmlu_pro"]
    p = load_problems(task, FIX / "mmlu_pro.jsonl")
    assert "B. 4" in p[0].messages[0]["content"] and p[0].reference == "B"
    assert task.score(p[0], "2 + 2 = 4, so the answer is (B).")["correct"]
    assert task.score(p[2], "It is water. The answer is C")["correct"]
    assert task.score(p[1], "Mars... B")["correct"]  # loose: last standalone option letter
    assert not task.score(p[1], "The answer is (A)")["correct"]
    agg = task.aggregate([task.score(p[0], "answer is (B)"), task.score(p[2], "answer is (A)")])
    assert agg["accuracy"] == 0.5 and agg["by_category"] == {"chemistry": 0.0, "math": 1.0}


@pytest.fixture(scope="module")
def base_url(tmp_path_factory):
    with native_server(tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), bd_size=4), mode="diffusion") as (url, _):
        yield url + "/v1"


@pytest.mark.parametrize("task", ["gsm8k", "mmlu_pro"])
def test_end_to_end_shards_and_merge(base_url, tmp_path, task):
    for shard in ("0/2", "1/2"):
        assert (
            evaluate.main(
                [
                    task,
                    "--base-url",
                    base_url,
                    "--data-file",
                    str(FIX / f"{task}.jsonl"),
                    "--shard",
                    shard,
                    "--max-tokens",
                    "12",
                    "--out",
                    str(tmp_path / shard[0]),
                    "--quiet",
                ]
            )
            == 0
        )
    s0 = json.loads((tmp_path / "0" / "summary.json").read_text())
    assert s0["problems"] == 2 and s0["errors"] == 0 and s0["tokens_per_forward"] > 0
    merged = evaluate.merge([str(tmp_path / "0"), str(tmp_path / "1")], str(tmp_path / "all"))
    lines = (tmp_path / "all" / "requests.jsonl").read_text().splitlines()
    assert merged["problems"] == len(lines) == 4 and sorted(json.loads(x)["id"] for x in lines) == sorted(
        json.loads(x)["id"] for x in lines
    )
    for key in (
        "accuracy",
        "wall_s",
        "tok_s",
        "tok_s_per_request",
        "latency_p50_s",
        "latency_p90_s",
        "latency_max_s",
        "mean_output_tokens",
        "cut_at_max_tokens",
        "tokens_per_forward",
    ):
        assert key in merged
    assert 0.0 <= merged["cut_at_max_tokens"] <= 1.0 and merged["mean_output_tokens"] <= 12


def test_request_errors_are_counted_not_fatal(tmp_path):
    evaluate.main(
        [
            "gsm8k",
            "--base-url",
            "http://127.0.0.1:9/v1",
            "--model",
            "x",
            "--data-file",
            str(FIX / "gsm8k.jsonl"),
            "--out",
            str(tmp_path),
            "--quiet",
            "--timeout",
            "2",
        ]
    )
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["errors"] == 4 and s["accuracy"] == 0.0


def test_bad_shard_is_a_clear_error():
    with pytest.raises(SystemExit, match="--shard"):
        evaluate.main(["gsm8k", "--shard", "3/2"])


def test_ifeval_aggregates_the_four_standard_scores():
    """lm-eval's IFEval checkers need nltk data from the network, so a stand-in with the same contract
    (doc, [response]) -> four metrics checks our side: loading, prompting and the aggregation."""
    from inference.eval_tasks import IFEval

    def checker(doc, results):
        text = results[0]
        ok = [
            text == text.lower() if i.startswith("change_case") else text.rstrip().endswith("bye")
            for i in doc["instruction_id_list"]
        ]
        loose = [o or text.strip().lower().endswith("bye") for o in ok]
        return {
            "prompt_level_strict_acc": all(ok),
            "inst_level_strict_acc": ok,
            "prompt_level_loose_acc": all(loose),
            "inst_level_loose_acc": loose,
        }

    task = IFEval(checker)
    p = load_problems(task, FIX / "ifeval.jsonl")
    assert p[1].messages[0]["content"].startswith("Say hi") and p[1].id == "2"
    scores = [task.score(p[0], "hello there"), task.score(p[1], "hi, BYE")]
    agg = task.aggregate(scores)
    assert agg["prompt_level_strict_acc"] == 0.5 and agg["prompt_level_loose_acc"] == 1.0
    assert agg["inst_level_strict_acc"] == pytest.approx(1 / 3) and agg["inst_level_loose_acc"] == 1.0
    assert agg["accuracy"] == agg["prompt_level_strict_acc"]


def test_ifeval_without_lm_eval_is_a_clear_error():
    from inference.eval_tasks import IFEval

    try:
        import lm_eval  # noqa: F401

        pytest.skip("lm-eval is installed here")
    except ImportError:
        pass
    with pytest.raises(SystemExit, match="lm-eval"):
        _ = IFEval().checker


def test_chat_exact_task(tmp_path):
    task = TASKS["chat"]
    f = tmp_path / "c.jsonl"
    f.write_text(
        json.dumps(
            {
                "messages": [{"role": "user", "content": "Copy: ab"}, {"role": "assistant", "content": "ab"}],
                "task": "copy",
            }
        )
        + "\n"
    )
    (p,) = load_problems(task, f)
    assert p.messages == [{"role": "user", "content": "Copy: ab"}] and p.reference == "ab"
    assert task.score(p, " ab\n")["correct"] and not task.score(p, "ba")["correct"]
    assert task.aggregate([task.score(p, "ab"), task.score(p, "x")]) == {"accuracy": 0.5, "by_group": {"copy": 0.5}}
    with pytest.raises(SystemExit, match="--data-file"):
        load_problems(task, None)
