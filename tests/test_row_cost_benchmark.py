"""benchmark/row_cost.py on a tiny checkpoint: both dtypes measured, the table's ratios are the JSON's."""

import json

from benchmark import row_cost
from tests.tiny import tiny_checkpoint


def test_row_cost_curves_per_dtype(tmp_path, capsys):
    ckpt = tiny_checkpoint(tmp_path / "c", bd_size=4)
    out = tmp_path / "r.json"
    argv = [str(ckpt), "--dtypes", "fp32,bf16", "--sizes", "1,8", "--context", "8", "--repeats", "1"]
    assert row_cost.main([*argv, "--json", str(out)]) == 0
    curves = json.loads(out.read_text())["seconds"]
    assert set(curves) == {"fp32", "bf16"} and all(set(c) == {"1", "8"} for c in curves.values())
    text = capsys.readouterr().out
    line = next(x for x in text.splitlines() if x.startswith("| 8 |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    fp32, bf16 = curves["fp32"], curves["bf16"]
    assert cells[2] == f"{fp32['8'] / fp32['1']:.2f}x"
    assert cells[5] == f"{bf16['8'] / fp32['8']:.2f}x"


def test_a_checkpoint_against_its_base_side_by_side(tmp_path, capsys):
    """`--against`: the draft-adapter checkpoint's forwards and the base's in one run, the ratio column the
    JSON's, each figure the fastest of the alternations."""
    from tests.test_draft_adapter import draft_checkpoint

    ckpt = draft_checkpoint(tmp_path / "draft", "qwen3")
    base = tiny_checkpoint(tmp_path / "base", bd_size=4)
    out = tmp_path / "r.json"
    argv = [str(ckpt), "--against", str(base), "--dtypes", "fp32", "--sizes", "1,4", "--context", "8"]
    assert row_cost.main([*argv, "--repeats", "1", "--alternations", "2", "--json", str(out)]) == 0
    rec = json.loads(out.read_text())
    mine, theirs = rec["seconds"]["fp32"], rec["base_seconds"]["fp32"]
    text = capsys.readouterr().out
    assert "against" in text
    line = [x for x in text.splitlines() if x.startswith("| 4 |")][-1]
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[1:] == [f"{1000 * mine['4']:.1f}", f"{1000 * theirs['4']:.1f}", f"{mine['4'] / theirs['4']:.3f}x"]


def test_alternations_keep_each_sizes_fastest():
    runs = [{"fp32": {1: 2.0, 4: 3.0}}, {"fp32": {1: 1.5, 4: 3.5}}]
    assert row_cost.fastest(runs) == {"fp32": {1: 1.5, 4: 3.0}}
