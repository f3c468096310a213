"""benchmark/self_spec_canvases.py on a tiny checkpoint: the three variants side by side, each (the engine's
causal variant too) identical to causal decoding, which the benchmark takes from the Hugging Face model's
own greedy loop (`benchmark.conversion_eval.stock_greedy`), not from the engine."""

import json

import pytest

from benchmark import self_spec_canvases
from tests.tiny import tiny_checkpoint

pytestmark = pytest.mark.e2e  # a whole program, server or long sweep: `pytest -m 'not e2e'` skips it


def test_variants_side_by_side_are_lossless(demo_kit, tmp_path, capsys):
    ckpt = tiny_checkpoint(tmp_path / "c", bd_size=4)
    out = tmp_path / "r.json"
    argv = [str(ckpt), "--heldout", str(demo_kit / "eval.jsonl"), "--limit", "4", "--max-tokens", "12"]
    assert self_spec_canvases.main([*argv, "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["variant"] for r in rows] == list(self_spec_canvases.VARIANTS)
    assert all(r["same_as_causal"] == 1.0 and r["tokens_per_forward"] > 0 for r in rows)
    assert rows[0]["tokens_per_forward"] == 1.0
    assert "| self-spec all |" in capsys.readouterr().out
