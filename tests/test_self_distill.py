"""data/self_distill.py: greedy answers are the native engine's causal answers token for token, whatever
--batch is; answers cut at the limit or ended by a stop token other than end-of-turn are dropped and
counted, never truncated; the output is what the trainer's reader supervises; sampling is reproducible
with one seed per answer; the CLI fails with one-line errors. Also: the shipped HumanEval prompt files."""

import json
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from bdcore.decode.sampling import SamplingParams
from bdcore.loading import load_checkpoint
from bdcore.tokens import end_of_turn_id
from data.self_distill import build_parser, main, read_prompts
from inference.native.engine import DecodeConfig, Engine
from tests.tiny import tiny_checkpoint
from train.data import load_samples

REPO = Path(__file__).resolve().parent.parent
MAX_NEW = 24
WORDS = ["Copy", "Add", "Sort", "Reverse", "abc", "17 3", "zz", "hello", "def f(x):", "return"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny checkpoint whose end-of-turn row is scaled up, so greedy answers end in every way the tool
    must tell apart (end-of-turn, the filler, the limit), and a prompt file in both accepted forms plus
    lines that must be skipped."""
    from transformers import AutoModelForCausalLM

    d = tmp_path_factory.mktemp("self_distill")
    path = tiny_checkpoint(d / "ckpt", arch="qwen3", bd_size=4)
    tok = load_checkpoint(path).tokenizer
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        model.get_output_embeddings().weight[end_of_turn_id(tok)] *= 1.5
    model.save_pretrained(path)
    rng = random.Random(0)
    lines = []
    for i in range(12):
        text = " ".join(rng.choices(WORDS, k=3))
        if i % 3 == 0:
            lines.append(json.dumps({"prompt": text, "id": i}))
        else:
            sys_msg = [{"role": "system", "content": "Be brief."}] if i % 3 == 2 else []
            lines.append(json.dumps({"messages": [*sys_msg, {"role": "user", "content": text}], "id": i}))
    lines += ["{not json", json.dumps({"messages": [{"role": "assistant", "content": "x"}]}), json.dumps({"x": 1}), ""]
    prompts = d / "prompts.jsonl"
    prompts.write_text("\n".join(lines) + "\n")
    loaded = load_checkpoint(path)
    return path, prompts, loaded, d


def _run(setup, name, *extra):
    path, prompts, _, d = setup
    out = d / f"{name}.jsonl"
    assert main(["--model", str(path), "--prompts", str(prompts), "--out", str(out), "--no-progress", *extra]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    stats = json.loads((d / f"{name}.jsonl.stats.json").read_text())
    return out, rows, stats


def _prompt_ids(tok, messages):
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False)["input_ids"]


def _reference(setup, params_for):
    """Per valid prompt line: the engine's answers, one per (params) in params_for(i)."""
    _, prompts, loaded, _ = setup
    engine = Engine(loaded, DecodeConfig(mode="causal"))
    records = read_prompts(prompts, 0, Counter())
    return records, [
        [engine.generate(_prompt_ids(loaded.tokenizer, r["messages"]), p) for p in params_for(i)]
        for i, r in enumerate(records)
    ]


def _stop_token(loaded, prompt_ids, tokens) -> int:
    """The token greedy decoding stopped at (the engine does not keep it)."""
    with torch.no_grad():
        logits = loaded.model(torch.tensor([prompt_ids + tokens])).logits[0, -1]
    logits[loaded.mask_id] = float("-inf")
    return int(logits.argmax())


@pytest.fixture(scope="module")
def greedy(setup):
    _, rows1, stats1 = _run(setup, "greedy_b1", "--max-new-tokens", str(MAX_NEW), "--batch", "1")
    out, rows3, stats3 = _run(setup, "greedy_b3", "--max-new-tokens", str(MAX_NEW), "--batch", "3")
    records, ref = _reference(setup, lambda i: [SamplingParams(max_tokens=MAX_NEW)])
    return out, (rows1, stats1), (rows3, stats3), records, [g for (g,) in ref]


def test_greedy_equals_engine_token_for_token_and_batch_size_does_not_matter(setup, greedy):
    _, (rows1, stats1), (rows3, stats3), records, ref = greedy
    loaded, tok = setup[2], setup[2].tokenizer
    eot = end_of_turn_id(tok)
    assert rows1 == rows3
    drop = lambda s: {k: v for k, v in s.items() if k not in ("wall_s", "tok_per_s", "forwards", "settings")}
    assert drop(stats1) == drop(stats3) and stats3["forwards"] < stats1["forwards"]
    assert stats1["skipped_prompts"] == {"last_turn_not_user": 1, "malformed_json": 1, "no_messages": 1}
    expected = []
    for rec, g in zip(records, ref):
        ids = _prompt_ids(tok, rec["messages"])
        if g.finish_reason == "stop" and g.tokens and _stop_token(loaded, ids, g.tokens) == eot:
            expected.append((rec["id"], g.tokens))
    got = [(r["id"], tok(r["messages"][-1]["content"], add_special_tokens=False)["input_ids"]) for r in rows1]
    assert got == expected and len(got) >= 2, "every answer ended by end-of-turn is kept, token for token, in order"
    assert stats1["generated_tokens"] == sum(g.stats.generated for g in ref)
    assert stats1["kept_answer_tokens"] == sum(len(t) + 1 for _, t in expected)


def test_cut_or_otherwise_stopped_answers_are_dropped_and_counted(setup, greedy):
    _, (rows, stats), _, records, ref = greedy
    loaded = setup[2]
    filler = loaded.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    cut = [r["id"] for r, g in zip(records, ref) if g.finish_reason == "length"]
    by_filler = [
        r["id"]
        for r, g in zip(records, ref)
        if g.finish_reason == "stop"
        and _stop_token(loaded, _prompt_ids(loaded.tokenizer, r["messages"]), g.tokens) == filler
    ]
    assert cut and by_filler, "the fixture reaches both ways of dropping an answer"
    assert stats["dropped"]["length"] == len(cut)
    assert stats["dropped"]["stop_token:<|endoftext|>"] == len(by_filler)
    assert stats["kept"] + sum(stats["dropped"].values()) == stats["requests"] == len(records) == 12
    kept_ids = {r["id"] for r in rows}
    assert not kept_ids & set(cut + by_filler), "a cut or filler-stopped answer never reaches the output"
    # A smaller limit cuts more answers; none comes out shortened.
    _, short_rows, short = _run(setup, "short", "--max-new-tokens", "3")
    full = {r["id"]: r["messages"][-1]["content"] for r in rows}
    tok = loaded.tokenizer
    for r in short_rows:
        answer = r["messages"][-1]["content"]
        assert answer == full[r["id"]] and len(tok(answer, add_special_tokens=False)["input_ids"]) <= 2
    assert short["dropped"]["length"] > stats["dropped"]["length"]


def test_output_round_trips_through_the_trainers_reader(setup, greedy):
    out, (rows, _), _, records, ref = greedy
    tok = setup[2].tokenizer
    eot = end_of_turn_id(tok)
    samples, data_stats = load_samples(
        str(out), tok, eot, multiturn=False, max_length=4096, max_response_length=None, bd_size=4, views=1
    )
    assert data_stats.kept == len(rows) and not data_stats.skipped
    answers = {r["id"]: g.tokens for r, g in zip(records, ref)}
    for row, sample in zip(rows, samples):
        ((start, end),) = sample.spans
        assert list(sample.input_ids[:start]) == _prompt_ids(tok, row["messages"][:-1])
        assert list(sample.input_ids[start:end]) == answers[row["id"]] + [eot]
        assert row["messages"][:-1] == records[[r["id"] for r in records].index(row["id"])]["messages"]


def test_sampling_is_reproducible_with_one_distinct_seed_per_answer(setup):
    flags = ["--temperature", "0.8", "--top-p", "0.95", "--seed", "7", "--samples-per-prompt", "2"]
    _, rows_a, stats_a = _run(setup, "sampled_a", *flags, "--max-new-tokens", "16", "--batch", "4")
    _, rows_b, stats_b = _run(setup, "sampled_b", *flags, "--max-new-tokens", "16", "--batch", "1")
    assert rows_a == rows_b and stats_a["dropped"] == stats_b["dropped"] and stats_a["requests"] == 24
    seeds = [r["seed"] for r in rows_a]
    assert rows_a and len(set(seeds)) == len(seeds) and set(seeds) <= set(range(7, 7 + 24))
    params = lambda i: [SamplingParams(temperature=0.8, top_p=0.95, max_tokens=16, seed=7 + 2 * i + k) for k in (0, 1)]
    records, ref = _reference(setup, params)
    by_seed = {7 + 2 * i + k: g for i, gens in enumerate(ref) for k, g in enumerate(gens)}
    tok = setup[2].tokenizer
    for r in rows_a:
        assert tok(r["messages"][-1]["content"], add_special_tokens=False)["input_ids"] == by_seed[r["seed"]].tokens
    assert stats_a["generated_tokens"] == sum(g.stats.generated for g in by_seed.values())


def test_answers_the_template_would_rewrite_are_dropped(setup, tmp_path):
    """A chat template that rewrites assistant contents (real ones trim them or drop think blocks; this one
    turns quotes into backticks) would turn such an answer into other tokens than the model produced: it is
    dropped, the others are kept as they are."""
    import shutil

    path, prompts, _, _ = setup
    rewritten = tmp_path / "rewritten"
    shutil.copytree(path, rewritten)
    tok = load_checkpoint(rewritten).tokenizer
    tok.chat_template = tok.chat_template.replace(
        "m['content'] }}", "(m['content'] | replace(\"'\", '`')) if m['role'] == 'assistant' else m['content'] }}"
    )
    tok.save_pretrained(rewritten)
    out = tmp_path / "t.jsonl"
    main(
        [
            "--model",
            str(rewritten),
            "--prompts",
            str(prompts),
            "--out",
            str(out),
            "--max-new-tokens",
            str(MAX_NEW),
            "--no-progress",
        ]
    )
    stats = json.loads((tmp_path / "t.jsonl.stats.json").read_text())
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert stats["dropped"]["retokenize_mismatch"] >= 1 and stats["kept"] == len(rows) >= 1
    for r in rows:
        assert "'" not in r["messages"][-1]["content"]


def _error(argv) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    msg = str(e.value.code)
    assert "\n" not in msg and msg.startswith("self_distill: error: ")
    return msg


def test_cli_one_line_errors_and_help(setup, tmp_path, capsys):
    path, prompts, _, _ = setup
    out = str(tmp_path / "o.jsonl")
    assert "no such file" in _error(["--model", str(path), "--prompts", str(tmp_path / "none.jsonl"), "--out", out])
    assert "not a model directory" in _error(["--model", str(tmp_path), "--prompts", str(prompts), "--out", out])
    assert "needs --temperature" in _error(
        ["--model", str(path), "--prompts", str(prompts), "--out", out, "--samples-per-prompt", "2"]
    )
    assert "--batch 0" in _error(["--model", str(path), "--prompts", str(prompts), "--out", out, "--batch", "0"])
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"x": 1}\n')
    assert "no usable prompt" in _error(["--model", str(path), "--prompts", str(empty), "--out", out])
    helptext = build_parser().format_help()
    for action in build_parser()._actions:
        assert action.help, f"{action.option_strings} has help"
    assert "--samples-per-prompt" in helptext and "--max-new-tokens" in helptext
    # As users run it: the message alone on stderr, a failing exit status.
    proc = subprocess.run(
        [sys.executable, "-m", "data.self_distill", "--model", str(tmp_path), "--prompts", str(prompts), "--out", out],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert proc.returncode != 0 and proc.stderr.strip().count("\n") == 0 and "no config.json" in proc.stderr


def test_shipped_humaneval_prompts():
    skipped = Counter()
    train = read_prompts(REPO / "data/prompts/humaneval_train.jsonl", 0, skipped)
    held = read_prompts(REPO / "data/prompts/humaneval_heldout.jsonl", 0, skipped)
    assert (len(train), len(held)) == (124, 40) and not skipped
    assert not {r["task_id"] for r in train} & {r["task_id"] for r in held}
    for r in held:
        assert r["entry_point"] in r["code_prompt"] and "def check(" in r["test"]
        assert r["code_prompt"].rstrip() in r["messages"][-1]["content"]
    # The canonical-answer set: the same train prompts, each answered by its canonical function.
    lines = (REPO / "data/prompts/humaneval_train_canonical.jsonl").read_text().splitlines()
    answered = [json.loads(x) for x in lines]
    assert [r["task_id"] for r in answered] == [r["task_id"] for r in train]
    for r, prompt in zip(answered, train):
        assert r["messages"][:-1] == prompt["messages"] and r["messages"][-1]["role"] == "assistant"
        answer = r["messages"][-1]["content"]
        assert answer.startswith("```python\n") and answer.endswith("\n```") and "def " in answer


def test_a_prompts_prefill_never_shares_a_forward_with_decode_steps(setup, monkeypatch):
    """A batched forward pads every sequence to the longest: a prefill among one-row decode steps would
    make the whole batch prompt-long (the tool once ran ten times slower for it)."""
    from bdcore.decode.runner import ModelRunner

    kinds, real = [], ModelRunner._forward_padded

    def spy(self, batch):
        kinds.append([cache.length == 0 for cache, _ in batch])
        return real(self, batch)

    monkeypatch.setattr(ModelRunner, "_forward_padded", spy)
    _run(setup, "grouped", "--max-new-tokens", str(MAX_NEW), "--batch", "3")
    assert all(all(k) or not any(k) for k in kinds), "a forward mixes prefills with decode steps"
    assert any(len(k) > 1 and not any(k) for k in kinds), "decode steps are batched"
    assert sum(k.count(True) for k in kinds) == 12, "every valid prompt is prefilled once"
