"""benchmark/self_spec_canvases.py on a tiny checkpoint: the three variants side by side, each (the engine's
causal variant too) identical to causal decoding, which the benchmark takes from the Hugging Face model's
own greedy loop (`benchmark.conversion_eval.stock_greedy`), not from the engine."""

import json

import pytest

from benchmark import self_spec_canvases
from benchmark.record import load as load_record
from tests.tiny import tiny_checkpoint

pytestmark = pytest.mark.e2e  # a whole program, server or long sweep: `pytest -m 'not e2e'` skips it


@pytest.mark.parametrize("concurrency", [1, 3])
def test_variants_side_by_side_are_lossless(demo_kit, tmp_path, capsys, monkeypatch, concurrency):
    monkeypatch.setenv("BDSTACK_CACHE_DIR", str(tmp_path / "cache"))
    ckpt = tiny_checkpoint(tmp_path / "c", bd_size=4)
    out = tmp_path / "r.json"
    argv = [str(ckpt), "--heldout", str(demo_kit / "eval.jsonl"), "--limit", "4", "--max-tokens", "12"]
    # fp32: exact comparison with the stock loop (the default is the serving dtype, bf16 on this CPU); at
    # concurrency 1 the 4 prompts run in 4 interleaved slices, whose outputs must land back in prompt order
    argv += ["--draft-lens", "2,3", "--concurrency", str(concurrency), "--dtype", "fp32"]
    if concurrency == 3:  # the prompts twice over: 8 requests, each held to its own causal output
        argv += ["--repeat", "2"]
    # the baseline: these weights as their own base, through transformers' generate (batched and left-padded
    # at concurrency 3): it must decode what the stock greedy loop does, one token per forward
    argv += ["--base", str(ckpt)]
    record = tmp_path / "record.json"
    assert self_spec_canvases.main([*argv, "--json", str(out), "--record", str(record)]) == 0
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    recorded = load_record(record)  # the schema of benchmark.report's records, every variant a row
    assert [(r["variant"], r["concurrency"], r["tok_s"]) for r in recorded["rows"]] == [
        (name, concurrency, r["tok_s"]) for name, r in rows.items()
    ]
    assert recorded["kind"] == "speed" and recorded["dtype"] == "fp32" and "--record" in recorded["command"]
    fixed = [f"self-spec {c} N={n}" for n in (2, 3) for c in ("last", "all")]
    assert list(rows) == [self_spec_canvases.BASELINE, *self_spec_canvases.VARIANTS, *fixed]
    assert all(r["same_as_causal"] == 1.0 for r in rows.values())
    assert rows["causal"]["tokens_per_forward"] == 1.0 == rows[self_spec_canvases.BASELINE]["tokens_per_forward"]
    # A fixed N drafts N - 1 tokens at every forward; the forwards of a request are its prefill and steps.
    for n in (2, 3):
        assert set(rows[f"self-spec last N={n}"]["drafted"]) == {str(n - 1)}
        assert rows[f"self-spec all N={n}"]["drafted"] == {str(n - 1): rows[f"self-spec all N={n}"]["forwards"]}
    # A fixed all-canvases N drafts at every forward after the prefill: each is one draft-verify cycle, which
    # commits its accepted drafts and the verifier's token (the acceptance length), the prefill one token.
    for n in (2, 3):
        r = rows[f"self-spec all N={n}"]
        cycles = sum(r["accepted"].values())
        tokens = round(r["tokens_per_forward"] * r["forwards"])
        assert (r["forwards"] - cycles) + cycles * r["acceptance_length"] == pytest.approx(tokens)
    assert "acceptance_length" not in next(x for x in recorded["rows"] if x["variant"] == "causal")
    for r in rows.values():  # the rounds' tokens add up to the row's (tokens per forward x forwards)
        assert sum(t for t, _ in r["per_round"]) == round(r["tokens_per_forward"] * r["forwards"])
        assert len(r["per_round"]) == (4 if concurrency == 1 else 2)
    text = capsys.readouterr().out
    assert "| self-spec all N=3 |" in text and "auto: " in text and "the best fixed variant" in text
    causal = next(x for x in text.splitlines() if x.startswith("| causal |"))
    base_tok_s = rows[self_spec_canvases.BASELINE]["tok_s"]
    assert f"| {rows['causal']['tok_s'] / base_tok_s:.2f}x | 1.00x |" in causal  # vs base generate, vs causal
    assert "chosen on the other rounds" in text


def test_auto_against_a_best_fixed_variant_chosen_on_the_other_rounds():
    """By hand: A is fastest on rounds 0 and 1 but slow on round 2, B is steady. Leaving round 2 out picks A
    (10 tok/s elsewhere vs B's 5) and times it on round 2 (4 s); leaving 0 or 1 out picks B (5 vs 4), timed
    2 s each. The held-out best takes 8 s for 30 tokens, auto 6 s: 8/6."""
    a = {"variant": "A", "per_round": [[10, 1.0], [10, 1.0], [10, 4.0]]}
    b = {"variant": "B", "per_round": [[10, 2.0], [10, 2.0], [10, 2.0]]}
    auto = {"variant": "self-spec auto", "per_round": [[10, 1.5], [10, 1.5], [10, 3.0]]}
    ratio, picks = self_spec_canvases.auto_vs_best_held_out(auto, [a, b])
    assert ratio == pytest.approx(8 / 6) and picks == {"B": 2, "A": 1}
    one = {**auto, "per_round": auto["per_round"][:1]}
    assert self_spec_canvases.auto_vs_best_held_out(one, [{**a, "per_round": a["per_round"][:1]}]) is None


def test_variants_filter_keeps_causal_first_and_refuses_unknown_names(demo_kit, tmp_path, monkeypatch):
    monkeypatch.setenv("BDSTACK_CACHE_DIR", str(tmp_path / "cache"))
    ckpt = tiny_checkpoint(tmp_path / "c", bd_size=4)
    out = tmp_path / "r.json"
    argv = [str(ckpt), "--heldout", str(demo_kit / "eval.jsonl"), "--limit", "2", "--max-tokens", "8"]
    argv += ["--draft-lens", "2", "--json", str(out), "--dtype", "fp32"]
    assert self_spec_canvases.main([*argv, "--variants", "self-spec last N=2,self-spec auto"]) == 0
    rows = [r["variant"] for r in json.loads(out.read_text())["rows"]]
    assert rows == ["causal", "self-spec auto", "self-spec last N=2"]  # a full conversion without --base: none
    with pytest.raises(SystemExit, match="unknown"):
        self_spec_canvases.main([*argv, "--variants", "self-spec last N=9"])
    # a tree shape's commas belong to its name
    names = "self-spec last tree=2,2, self-spec auto,self-spec all tree=spine:2,2,2,causal"
    assert self_spec_canvases.variant_names(names) == [
        "self-spec last tree=2,2",
        "self-spec auto",
        "self-spec all tree=spine:2,2,2",
        "causal",
    ]


def test_draft_tree_variants():
    got = self_spec_canvases.variants(4, [], ["auto", "spine:2,2"])
    auto = dict(mode="self-spec", self_spec_canvases="auto", draft_len="auto")
    assert got["self-spec auto trees"] == auto | {"tree": "auto"}
    assert got["self-spec all tree=spine:2,2"] == dict(
        mode="self-spec", self_spec_canvases="all", draft_len=4, tree="spine:2,2"
    )
    assert "self-spec last tree=spine:2,2" in got and "self-spec auto" in got


def test_the_baseline_is_a_draft_adapters_own_weights_and_otherwise_named(tmp_path):
    from benchmark.base_generate import base_model_dir
    from tests.test_draft_adapter import draft_checkpoint

    draft = draft_checkpoint(tmp_path / "draft", "qwen3")
    full = tiny_checkpoint(tmp_path / "full", bd_size=4)
    assert base_model_dir(draft, None) == draft  # its weights are the base's, the adapter lives apart
    assert base_model_dir(full, None) is None  # a full conversion changed every weight: only --base names it
    assert base_model_dir(full, tmp_path / "b") == tmp_path / "b"
