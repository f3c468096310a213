"""benchmark/bandwidth.py: the bytes a decode step reads per token against a hand count and a loaded model,
the ceiling and fraction arithmetic, the CLI's rows, bad input in one line."""

import json

import pytest
import torch

from benchmark import bandwidth
from tests.tiny import tiny_checkpoint

HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 64, 128, 2, 4, 2, 16  # benchmark/tiny.py's sizes


def _vocab(path) -> int:
    return json.loads((path / "config.json").read_text())["vocab_size"]


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("dtype,per", [("fp32", 4), ("bf16", 2)])
def test_bytes_per_token_by_hand(tmp_path, tied, dtype, per):
    """Tiny Qwen3: every layer's weights once, one embedding row, the output layer whole (the embedding
    matrix when tied), keys and values of both layers at the context."""
    ckpt = tiny_checkpoint(tmp_path / "c", tied=tied)
    got = bandwidth.bytes_per_token(ckpt, dtype, context=10)
    attention = HIDDEN * HEADS * HEAD_DIM * 2 + HIDDEN * KV_HEADS * HEAD_DIM * 2 + 2 * HEAD_DIM  # q, o, k, v, q/k norms
    layer = attention + 3 * HIDDEN * INTER + 2 * HIDDEN  # + gate, up, down; two layer norms
    assert got["tied"] is tied
    assert got["weights"] == (LAYERS * layer + HIDDEN) * per  # + the final norm
    assert got["embedding_rows"] == HIDDEN * per
    assert got["output_head"] == _vocab(ckpt) * HIDDEN * per
    assert got["kv_cache"] == LAYERS * 2 * KV_HEADS * HEAD_DIM * 10 * per
    assert got["recurrent_state"] == 0
    parts = ("weights", "embedding_rows", "output_head", "kv_cache", "recurrent_state")
    assert got["total"] == sum(got[p] for p in parts)


def test_a_hybrid_model_reads_its_recurrent_state(tmp_path):
    """Tiny Qwen3.5 (three gated-delta layers, one full-attention): the fp32 state and the convolution window
    of each gated-delta layer, and keys and values of the one attention layer."""
    ckpt = tiny_checkpoint(tmp_path / "h", arch="qwen3_5")
    got = bandwidth.bytes_per_token(ckpt, "bf16", context=7)
    conv_dim = 2 * 2 * 16 + 4 * 16  # q and k (2 heads x 16), v (4 heads x 16)
    assert got["recurrent_state"] == 3 * (4 * 16 * 16 * 4 + (4 - 1) * conv_dim * 2)
    assert got["kv_cache"] == 1 * 2 * KV_HEADS * HEAD_DIM * 7 * 2


@pytest.mark.parametrize(
    "arch,tied", [("qwen3", True), ("qwen3", False), ("qwen3_5", True), ("llama", False), ("qwen3_moe", True)]
)
def test_weight_bytes_equal_the_loaded_model(tmp_path, arch, tied):
    """The count from the headers equals the bf16 model as transformers loads it: its parameters' bytes with
    the embedding matrix taken as one row, the output layer whole (once more when tied, since the forward
    reads it as the output layer too), and a mixture of experts' experts at 2 of 4."""
    from transformers import AutoModelForCausalLM

    ckpt = tiny_checkpoint(tmp_path / "c", arch=arch, tied=tied)
    got = bandwidth.bytes_per_token(ckpt, "bf16", context=1)
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16)
    embedding = model.get_input_embeddings().weight
    share = {n: 0.5 if ".experts." in n else 1.0 for n, _ in model.named_parameters()}
    loaded = sum(share[n] * p.nbytes for n, p in model.named_parameters())  # a tied matrix once
    row = embedding.nbytes // embedding.shape[0]
    expected = loaded - embedding.nbytes + row + (embedding.nbytes if tied else 0)
    assert got["weights"] + got["embedding_rows"] + got["output_head"] == expected


def test_ceiling_and_fractions():
    assert bandwidth.ceiling_tok_s(10.0, 5e8) == pytest.approx(20.0)
    assert bandwidth.fractions({"a": 5.0, "b": 20.0}, 20.0) == {"a": 0.25, "b": 1.0}
    assert bandwidth.parse_tok_s(["native=21.5", "hf=3"]) == {"native": 21.5, "hf": 3.0}


def test_the_cli_prints_a_row_per_engine(tmp_path, capsys):
    ckpt = tiny_checkpoint(tmp_path / "c")
    out = tmp_path / "bw.json"
    argv = [str(ckpt), "--dtype", "bf16", "--context", "8", "--threads", "1", "--size", "8", "--repeats", "2"]
    threads = torch.get_num_threads()
    try:
        assert bandwidth.main([*argv, "--tok-s", "native=30", "--tok-s", "hf=12.5", "--json", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    rec = json.loads(out.read_text())
    read = rec["bandwidth"]["read_gb_s"]
    assert rec["bandwidth"]["threads"] == 1 and len(read["runs"]) == 2 and read["best"] >= read["median"] > 0
    counted = rec["bytes_per_token"]
    assert counted == bandwidth.bytes_per_token(ckpt, "bf16", context=8)
    ceiling = rec["ceiling_tok_s"]["best"]
    assert ceiling == pytest.approx(read["best"] * 1e9 / counted["total"])
    text = capsys.readouterr().out
    for name, value in (("native", 30.0), ("hf", 12.5)):
        assert rec["tok_s"][name]["fraction_of_ceiling"] == pytest.approx(value / ceiling)
        assert f"| {name} | {value:g} | {100 * value / ceiling:.1f}% |" in text.splitlines()
    assert f"ceiling: {ceiling:.1f} tok/s" in text


def test_help_says_what_is_measured(capsys):
    with pytest.raises(SystemExit):
        bandwidth.main(["--help"])
    text = capsys.readouterr().out
    assert "memory read bandwidth" in text.replace("\n", " ") and "every weight of the model is" in text


@pytest.mark.parametrize(
    "extra,words",
    [
        (["--tok-s", "native"], "'native'"),
        (["--tok-s", "native=fast"], "'native=fast'"),
        (["--tok-s", "=3"], "'=3'"),
        (["--tok-s", "native=-1"], "'native=-1'"),
        (["--tok-s", "a=1", "--tok-s", "a=2"], "given twice"),
        (["--context", "0"], "--context 0"),
    ],
)
def test_bad_input_is_one_line(tmp_path, capsys, extra, words):
    ckpt = tiny_checkpoint(tmp_path / "c")
    capsys.readouterr()  # the save's progress bar
    assert bandwidth.main([str(ckpt), "--size", "1", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("benchmark.bandwidth: ") and words in err


def test_a_missing_checkpoint_is_one_line(tmp_path, capsys):
    assert bandwidth.main([str(tmp_path / "nowhere"), "--size", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "nowhere" in err and "config.json" in err
