"""benchmark/gpu_conversion.sh, the GPU conversion campaign, as its CPU twin at tiny scale: every step of
the script runs (self-distillation, conversion with the drafting metric, implied vs served tokens per
forward, serving in every mode at two concurrencies and with all canvases, the self-spec layouts side by
side) and results.json holds what docs/history/results-notebook.md quotes. The GPU run differs in sizes,
device and dtype only."""

import json
import os
import random
import subprocess
from pathlib import Path

import pytest
import torch

from bdcore.tokens import end_of_turn_id

pytestmark = pytest.mark.e2e  # a whole program, server or long sweep: `pytest -m 'not e2e'` skips it

REPO = Path(__file__).resolve().parent.parent
WORDS = ["Copy", "Add", "Sort", "Reverse", "abc", "17 3", "zz", "hello", "def f(x):", "return"]


def _plain_base(path: Path) -> Path:
    """An HF causal LM as users pass it (no <|mask|>, no sidecar), whose end-of-turn row is scaled up so
    that greedy answers end within a few tokens (a random model's never do)."""
    from data.toy_tokenizer import build_char_tokenizer
    from tests.tiny import tiny_model

    tok = build_char_tokenizer()
    model = tiny_model(vocab=len(tok))
    with torch.no_grad():
        model.get_output_embeddings().weight[end_of_turn_id(tok)] *= 1.5
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _prompts(path: Path, n: int, seed: int) -> Path:
    rng = random.Random(seed)
    rows = [{"messages": [{"role": "user", "content": " ".join(rng.choices(WORDS, k=3))}]} for _ in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_the_campaign_runs_every_step_and_writes_results(tmp_path):
    out = tmp_path / "out"
    env = {
        **os.environ,
        "GPU_CONV_DEVICE": "cpu",
        "GPU_CONV_WORK": str(tmp_path / "work"),
        "OUT": str(out),
        "BASE": str(_plain_base(tmp_path / "base")),
        "PROMPTS": str(_prompts(tmp_path / "train.jsonl", 40, 0)),
        "HELDOUT": str(_prompts(tmp_path / "heldout.jsonl", 24, 1)),
        "TRAIN_LIMIT": "0",
        "HELD_LIMIT": "0",
        "PY": str(Path(os.sys.executable)),
    }
    proc = subprocess.run(
        ["bash", "benchmark/gpu_conversion.sh"], cwd=REPO, env=env, capture_output=True, text=True, timeout=900
    )
    summary = (out / "summary.txt").read_text()
    assert proc.returncode == 0, summary + proc.stderr[-2000:]
    assert "FAIL" not in summary and "TIMEOUT" not in summary and "SKIP" not in summary, summary
    res = json.loads((out / "results.json").read_text())
    assert res["distil"]["train"]["kept"] >= 4 and res["distil"]["heldout"]["kept"] >= 2
    final = res["train_metrics"][-1]
    assert final["step"] == 4 and 1.0 <= final["draft_tpf_linear"] <= final["draft_tpf_all"] + 1e-9
    q = res["quality"]
    # fp32 held-out answers are the checkpoint's own greedy path: implied and served agree exactly there
    # (tests/test_draft_quality.py holds this per sample; here it is the script's plumbing that is checked)
    assert q["served_tpf_linear"] == pytest.approx(q["draft_tpf_linear"], rel=1e-6)
    assert q["served_tpf_all"] == pytest.approx(q["draft_tpf_all"], rel=1e-6)
    rows = {(r["mode"], r["concurrency"]): r for r in res["serving"]}
    assert set(rows) == {(m, c) for m in ("base generate", "causal", "diffusion", "self-spec") for c in (1, 2)}
    # the baseline is the draft adapter's own weights through transformers' generate, in fp32 like the server:
    # causal decoding of the checkpoint is exactly it
    assert all(rows[(m, c)]["same_as_causal"] == 1.0 for m in ("self-spec", "base generate") for c in (1, 2))
    assert all(
        r["vs_base"] == pytest.approx(r["tok_s"] / rows[("base generate", r["concurrency"])]["tok_s"])
        for r in rows.values()
    )
    spec_all = [r for r in res["serving_all"] if r["mode"] == "self-spec"]
    assert spec_all and spec_all[0]["same_as_causal"] == 1.0 and "self-spec" in summary
    # issue 26's table at both concurrencies: every layout, auto included, lossless (fp32 in the twin)
    assert set(res["layouts"]) == {"1", "2"}
    for rows in res["layouts"].values():
        names = [r["variant"] for r in rows]
        assert names[:2] == ["base generate", "causal"] and "self-spec auto" in names and "self-spec all N=4" in names
        assert all(r["same_as_causal"] == 1.0 for r in rows), rows
    assert "layouts conc  2:" in summary
