"""benchmark/serving/bench_decode.py against a real server on a tiny draft-adapter checkpoint: the base
model's `generate` is each concurrency's first row and every tok/s is given against it, and `--in-process`
times the same requests on the engine here, the server's tok/s over it printed per mode."""

import json

import pytest

from benchmark.record import load as load_record
from benchmark.serving import bench_decode
from tests.test_draft_adapter import draft_checkpoint

pytestmark = pytest.mark.e2e  # a whole program, server or long sweep: `pytest -m 'not e2e'` skips it


def test_the_baseline_and_the_in_process_engine_beside_the_server(demo_kit, tmp_path, capsys, monkeypatch):
    from dataclasses import replace

    from inference.native.engine import Engine
    from inference.serve import build_parser, native_decode

    built = []  # the in-process engines' settings: the server's, in the request's mode (session 48: the
    real_init = Engine.__init__  # in-process self-spec ran a fixed layout beside the server's auto)
    monkeypatch.setattr(
        Engine,
        "__init__",
        lambda self, loaded, decode=None, **k: built.append(decode) or real_init(self, loaded, decode, **k),
    )
    ckpt = draft_checkpoint(tmp_path / "draft", "qwen3")
    out = tmp_path / "r.json"
    argv = [str(ckpt), "--prompts", str(demo_kit / "eval.jsonl"), "--num", "3", "--max-tokens", "8"]
    argv += ["--modes", "causal,self-spec", "--concurrency", "1,2", "--dtype", "fp32", "--in-process"]
    argv += ["--rounds", "2", "--repeat", "2"]  # 6 requests in 2 interleaved rounds
    record = tmp_path / "record.json"
    assert bench_decode.main([*argv, "--json", str(out), "--record", str(record)]) == 0
    rows = {(r["mode"], r["concurrency"]): r for r in json.loads(out.read_text())}
    server = native_decode(build_parser().parse_args([str(ckpt)]))
    assert built == [replace(server, mode="causal"), replace(server, mode="self-spec")]
    assert built[1].draft_len == built[1].self_spec_canvases == built[1].tree == "auto"
    assert [len(rows[("self-spec", c)]["vs_causal_by_round"]) for c in (1, 2)] == [2, 2]
    recorded = {(r["variant"], r["concurrency"]): r for r in load_record(record)["rows"]}
    assert set(recorded) == {(m, c) for m in ("base generate", "causal", "self-spec auto") for c in (1, 2)}
    assert recorded[("self-spec auto", 2)]["vs_base"] == rows[("self-spec", 2)]["vs_base"]
    for (variant, conc), r in recorded.items():  # the field's figures: acceptance length where drafts are verified,
        # tok/s per user where each request is timed (batched `generate` times only the whole batch)
        assert ("acceptance_length" in r) == (variant == "self-spec auto"), (variant, conc)
        # a cycle commits its accepted drafts and the verifier's token; the prefill's forward commits one token
        assert r["tokens_per_forward"] <= r.get("acceptance_length", 1) + 1e-9
        if variant != "base generate":
            mode = "self-spec" if variant == "self-spec auto" else variant
            assert r["tok_s_per_request"] == rows[(mode, conc)]["tok_s_per_request"] > 0
        else:
            assert "tok_s_per_request" not in r
    assert set(rows) == {(m, c) for m in ("base generate", "causal", "self-spec") for c in (1, 2)}
    for (mode, conc), r in rows.items():
        # the draft adapter's weights are the base's: causal and self-spec decode the baseline's tokens
        assert r["same_as_causal"] == 1.0, (mode, conc)
        assert r["vs_base"] == pytest.approx(r["tok_s"] / rows[("base generate", conc)]["tok_s"])
        assert ("in_process_tok_s" in r) == (mode != "base generate") and r.get("in_process_tok_s", 1) > 0
    text = capsys.readouterr().out
    # the native server's self-spec drafts `auto` (its default), and the table says so
    line = next(x for x in text.splitlines() if x.startswith("| self-spec auto | 2 |") and x.count("|") == 6)
    r = rows[("self-spec", 2)]
    assert line.endswith(f"| {r['tok_s'] / r['in_process_tok_s']:.2f}x |")
