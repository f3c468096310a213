"""The one-forward drafting metric (bdcore/decode/policy/draft_quality.py): its walk against hand-computed decode
traces, and on tiny models (dense and hybrid) against served self-spec, linear and all canvases: on an answer
that is the checkpoint's own greedy output the replayed walk takes exactly the engine's forwards."""

import pytest
import torch

from bdcore.decode.config import DecodeConfig
from bdcore.decode.policy.draft_quality import (
    DraftQuality,
    SampleDrafts,
    accepted_prefix,
    draft_quality,
    score_sample,
    walk_forwards,
)
from bdcore.decode.runner import ModelRunner
from bdcore.decode.sampling import SamplingParams
from bdcore.loading import load_checkpoint
from bdcore.tokens import end_of_turn_id
from inference.native.engine import Engine
from tests.test_invariant_4_self_spec import _prompts
from tests.tiny import tiny_checkpoint


def test_accepted_prefix_stops_at_the_first_disagreement():
    assert accepted_prefix(torch.tensor([5, 6, 7]), torch.tensor([5, 6, 7])) == 3
    assert accepted_prefix(torch.tensor([5, 9, 7]), torch.tensor([5, 6, 7])) == 1
    assert accepted_prefix(torch.tensor([9, 6, 7]), torch.tensor([5, 6, 7])) == 0


def test_walk_replays_the_decoder_by_hand():
    # an answer at positions 10..19 (the stop token at 19), drafts of N - 1 = 3 tokens
    s = SampleDrafts(10, 20, accepted=[3, 0, 0, 0, 1, 2, 0, 0, 3, 0], ar_nll=[0.0] * 10, ar_matches_data=0)
    # all canvases: prefill (emits 10), verify at 10 accepts 3 (emits 11-14), at 14 accepts 1 (15-16),
    # at 16 accepts 0 (17), at 17 accepts 0 (18), at 18 accepts 3 but only the stop token is left: 6 forwards
    assert walk_forwards(s, 4, all_canvases=True) == 6
    # linear: prefill; verify at 10 accepts all (11-14, warm at 14); verify at 14 accepts 1 (15, correction 16);
    # cold step emits 17 (warm at 17); verify at 17 accepts 0 (correction 18); cold step emits 19: 6 forwards
    assert walk_forwards(s, 4, all_canvases=False) == 6
    never = SampleDrafts(10, 20, accepted=[0] * 10, ar_nll=[0.0] * 10, ar_matches_data=0)
    assert walk_forwards(never, 4, all_canvases=True) == 10  # one token a forward, the prefill's included
    assert walk_forwards(never, 4, all_canvases=False) == 10  # verify (correction) and cold steps alternate


def test_walk_with_a_tree_by_hand():
    """A tree accepts the AR tokens among each depth's candidates (the ranks); the canvases follow the argmax
    chain, so a path through a side candidate leaves no drafts, as a rejection does in linear mode."""
    from bdcore.decode.tree import TreeShape

    # anchors 10..18 of an answer ending at 19; ranks of the AR token in each of the 3 slots
    ranks = [[0, 1, 0], [1, 0, 0], [0, 0, 0], [0, 0, 0], [2, 0, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0]]
    s = SampleDrafts(10, 20, accepted=[1, 0, 3, 3, 0, 3, 3, 3, 3], ar_nll=[0.0] * 9, ar_matches_data=0, ranks=ranks)
    chain = TreeShape((1, 1, 1))
    for every in (False, True):  # a tree of one candidate per depth is the chain
        assert walk_forwards(s, 4, all_canvases=every, tree=chain) == walk_forwards(s, 4, all_canvases=every)
    two = TreeShape((2, 2, 1))
    # every canvas: prefill; at 10 the path takes slot 2's second candidate (ranks 0, 1, 0: accepts 3, but off
    # the chain), emits 11-14; cold at 14; at 15 (ranks 0,0,0) accepts 3, emits 16-19: 4 forwards
    assert walk_forwards(s, 4, all_canvases=True, tree=two) == 4
    assert walk_forwards(s, 4, all_canvases=False, tree=two) == 4  # each verify took all three or went cold
    spine = TreeShape((2, 2, 2), spine=True)
    # a spine's side candidate is a leaf: at 10 it accepts 2 (slot 2's second candidate), emits 11-13; cold at
    # 13 (emits 14); at 14 slot 1's AR token is the third candidate (rank 2, width 2): emits 15; at 15 all three
    # (16-19): prefill, verify, cold, verify, verify = 5
    assert walk_forwards(s, 4, all_canvases=True, tree=spine) == 5


def test_the_summary_by_hand():
    """The figures the trainer logs and the server takes as its acceptance prior: `draft_first_accept` counts
    anchors whose first draft was accepted (accepted prefix > 0), not every anchor."""
    s = SampleDrafts(10, 20, accepted=[3, 0, 0, 0, 1, 2, 0, 0, 3, 0], ar_nll=[0.5] * 10, ar_matches_data=6)
    q = DraftQuality()
    q.add(s, 4)
    assert q.summary() == pytest.approx(
        {
            "draft_first_accept": 4 / 10,  # anchors 10, 14, 15 and 18
            "draft_mean_accepted": 9 / 10,
            "draft_tpf_linear": 10 / 6,  # the forwards of test_walk_replays_the_decoder_by_hand
            "draft_tpf_all": 10 / 6,
            "eval_ar_loss": 0.5,
            "eval_ar_matches_data": 6 / 9,  # of the answer tokens after the first
        }
    )


def _served_and_measured(ckpt, canvases, prompts, draft_len):
    params = SamplingParams(max_tokens=24)
    causal = Engine(ckpt, DecodeConfig(mode="causal"))
    spec = Engine(ckpt, DecodeConfig(mode="self-spec", self_spec_canvases=canvases, draft_len=draft_len))
    runner = ModelRunner.for_checkpoint(ckpt.model, ckpt.capabilities)
    eot = end_of_turn_id(ckpt.tokenizer)
    for ids in prompts:
        out = causal.generate(ids, params)
        answer = ids + out.tokens + ([eot] if out.finish_reason == "stop" else [])
        measured = score_sample(runner, answer, len(ids), mask_id=ckpt.mask_id, draft_len=draft_len, max_rows=64)
        served = spec.generate(ids, params)
        assert served.tokens == out.tokens
        yield measured, served.stats.forwards


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
@pytest.mark.parametrize("canvases", ["last", "all"])
def test_the_walk_takes_the_served_forwards_on_the_models_own_answers(tmp_path, arch, canvases):
    ckpt = load_checkpoint(tiny_checkpoint(tmp_path, arch=arch, bd_size=4))
    accepted = 0
    for measured, forwards in _served_and_measured(ckpt, canvases, _prompts(ckpt.tokenizer, 6, seed=3), 4):
        assert walk_forwards(measured, 4, all_canvases=canvases == "all") == forwards
        accepted += sum(measured.accepted)
    assert accepted > 0 or arch == "qwen3_5", "some drafts were accepted: the test saw verify steps that emit more"


def test_a_model_whose_drafts_always_agree(tmp_path):
    """Flat logits: every row's argmax is the same token, so every draft is accepted (the all-accepted path)."""
    ckpt = load_checkpoint(tiny_checkpoint(tmp_path, bd_size=4))
    with torch.no_grad():
        ckpt.model.model.norm.weight.zero_()
    prompts = _prompts(ckpt.tokenizer, 2, seed=5)
    for canvases in ("last", "all"):
        for measured, forwards in _served_and_measured(ckpt, canvases, prompts, 4):
            assert all(k == min(3, measured.end - 1 - (measured.start + i)) for i, k in enumerate(measured.accepted))
            assert walk_forwards(measured, 4, all_canvases=canvases == "all") == forwards


def test_chunked_forwards_score_as_one(tmp_path):
    """Anchors split over several forwards (`max_rows`) give the same prefixes and AR losses as one forward."""
    ckpt = load_checkpoint(tiny_checkpoint(tmp_path, bd_size=4))
    runner = ModelRunner.for_checkpoint(ckpt.model, ckpt.capabilities)
    ids = _prompts(ckpt.tokenizer, 1, seed=7)[0]
    sample = (ids + ids[:12], len(ids))
    one = draft_quality(runner, [sample], mask_id=ckpt.mask_id, draft_len=4, max_rows=10_000)
    many = draft_quality(runner, [sample], mask_id=ckpt.mask_id, draft_len=4, max_rows=len(sample[0]) + 8)
    assert one.per_sample[0].accepted == many.per_sample[0].accepted
    assert one.summary() == pytest.approx(many.summary())
    with torch.no_grad():
        stock = ckpt.model(input_ids=torch.tensor([sample[0]])).logits[0].float()
    stock[:, ckpt.mask_id] = float("-inf")
    want = torch.nn.functional.cross_entropy(stock[len(ids) - 1 : -1], torch.tensor(sample[0][len(ids) :]))
    assert one.summary()["eval_ar_loss"] == pytest.approx(float(want), rel=1e-4)


def test_the_benchmark_on_self_distilled_answers_implies_what_is_served(tmp_path, capsys):
    """`python -m benchmark.draft_quality --compare-served` on answers the checkpoint wrote itself (greedy):
    implied and served tokens per forward agree exactly, for both layouts. The tree tables follow the
    figures, their linear chain the mean accepted prefix (tests/test_tree_acceptance.py holds the rest)."""
    import json

    from benchmark.draft_quality import main
    from benchmark.record import load as load_record
    from train.data import heldout_answers

    ckpt_dir = tiny_checkpoint(tmp_path / "ckpt", bd_size=4)
    ckpt = load_checkpoint(ckpt_dir)
    causal = Engine(ckpt, DecodeConfig(mode="causal"))
    rows, answers = [], []
    words = ["Copy abc", "Add 17 3", "Sort zz hello", "Reverse hello abc", "abc zz", "hello 17", "Copy 3"]
    for text in words:
        messages = [{"role": "user", "content": text}]
        prompt = ckpt.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        answer = causal.generate(
            ckpt.tokenizer(prompt, add_special_tokens=False)["input_ids"], SamplingParams(max_tokens=20)
        )
        rows.append({"messages": [*messages, {"role": "assistant", "content": answer.text}]})
        answers.append(answer.tokens)
    data = tmp_path / "all.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # keep the answers whose text renders back to the tokens the model chose (a random model writes odd ids)
    rendered = heldout_answers(str(data), ckpt.tokenizer, end_of_turn_id(ckpt.tokenizer))
    kept = [r for r, a, (ids, start) in zip(rows, answers, rendered) if ids[start : start + len(a)] == a]
    assert len(kept) >= 3
    data.write_text("".join(json.dumps(r) + "\n" for r in kept))
    out = tmp_path / "quality.json"
    record = tmp_path / "record.json"  # the checkpoint as a point of the results page's scaling curve
    argv = [str(ckpt_dir), "--data", str(data), "--compare-served", "--json", str(out), "--max-rows", "40"]
    assert main([*argv, "--record", str(record), "--minutes", "7.5"]) == 0
    result = json.loads(out.read_text())
    (point,) = load_record(record)["rows"]
    assert point["minutes"] == 7.5 and point["implied_all"] == result["draft_tpf_all"]
    assert point["served_linear"] == result["served_tpf_linear"]
    assert result["samples"] == len(kept) and result["draft_len"] == 4
    assert result["draft_tpf_linear"] == pytest.approx(result["served_tpf_linear"])
    assert result["draft_tpf_all"] == pytest.approx(result["served_tpf_all"])
    linear, *trees = result["trees"]["tree_shapes"]
    assert linear["shape"] == "(1,1,1)" and linear["mean_accepted"] == pytest.approx(result["draft_mean_accepted"])
    assert linear["tpf_linear"] == result["draft_tpf_linear"] and linear["tpf_all"] == result["draft_tpf_all"]
    assert trees and all(max(t["widths"]) > 1 for t in trees)
    for tree in trees:  # on the checkpoint's own answers, a tree's implied tokens per forward is what is served
        assert tree["tpf_linear"] == pytest.approx(tree["served_tpf_linear"]), tree
        assert tree["tpf_all"] == pytest.approx(tree["served_tpf_all"]), tree
    printed = capsys.readouterr().out
    figures = dict(line.split(maxsplit=1) for line in printed.split("\n\n")[0].splitlines())
    assert figures["draft_mean_accepted"] == f"{result['draft_mean_accepted']:.4f}" and "trees" not in figures
    assert "| tree shape | tree nodes (verify rows) |" in printed and "| (4,2,1) | 20 |" in printed


@pytest.mark.e2e
def test_the_trainer_logs_the_benchmarks_figures(demo_kit, tmp_path):
    """`train.py --eval_data` logs the drafting metric every --eval_every steps; at the last step it is what
    `benchmark.draft_quality` measures on the saved checkpoint (the sharded student decodes as served)."""
    import json

    from benchmark.draft_quality import main
    from tests.conftest import read_metrics, run_train
    from tests.train_args import train_args

    run = tmp_path / "run"
    flags = dict(max_steps=2, eval_data=demo_kit / "eval.jsonl", eval_every=1, eval_samples=3, lr="5e-3")
    run_train(train_args(demo_kit, run, **flags))
    records = read_metrics(run)
    assert all("draft_tpf_all" in records[s] and "eval_ar_loss" in records[s] for s in (1, 2))
    out = tmp_path / "bench.json"
    main([str(run / "final"), "--data", str(demo_kit / "eval.jsonl"), "--limit", "3", "--json", str(out)])
    bench = json.loads(out.read_text())
    for key in ("draft_first_accept", "draft_mean_accepted", "draft_tpf_linear", "draft_tpf_all"):
        assert records[2][key] == pytest.approx(bench[key]), key
    assert records[2]["eval_ar_loss"] == pytest.approx(bench["eval_ar_loss"], rel=1e-4)
    # The checkpoint carries the last figures, the serving engine's prior for its self-spec acceptance.
    from bdcore.decode.policy.acceptance import prior_from_quality
    from bdcore.loading import load_checkpoint

    saved = json.loads((run / "final" / "draft_quality.json").read_text())
    assert saved["step"] == 2 and saved["draft_len"] == 4
    assert saved["draft_first_accept"] == pytest.approx(records[2]["draft_first_accept"])
    want = prior_from_quality(records[2]["draft_first_accept"], records[2]["draft_mean_accepted"], 4)
    assert load_checkpoint(run / "final").draft_prior == pytest.approx(want)
