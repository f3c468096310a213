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
