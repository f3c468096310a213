"""train.py end to end on CPU: torchrun x2 + FSDP2, checkpoint, reload with stock HF classes."""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from bdcore.loading import cpu_has_bf16
from bdcore.sidecar import read_sidecar
from tests.conftest import run_train
from tests.train_args import train_args

pytestmark = pytest.mark.e2e  # a whole program, server or long sweep: `pytest -m 'not e2e'` skips it

COMMON = {"lr": "1e-3", "log_every": 1}


def test_torchrun_two_ranks_trains_saves_and_reloads(demo_kit, tmp_path):
    run = tmp_path / "run"
    run_train(train_args(demo_kit, run, **COMMON, pack=True, max_steps=3, save_every=2), nproc=2)
    assert (run / "latest").read_text().strip() == "final"
    assert (run / "step_2" / "train_state" / "trainer_state.json").is_file()
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["diff_tokens"] > 0 and r["ar_tokens"] > 0 and r["tokens_per_s"] > 0 for r in records)
    stats = json.loads((run / "data_stats.json").read_text())
    assert stats["kept"] == 160 and stats["rows"] < 160  # packed

    final = run / "final"
    tok = AutoTokenizer.from_pretrained(final)
    model = AutoModelForCausalLM.from_pretrained(final)
    sc = read_sidecar(final)
    sc.check_tokenizer(tok)
    assert sc.mask_id == tok.convert_tokens_to_ids("<|mask|>") == len(tok) - 1
    assert (sc.bd_size, sc.views, sc.clean_causal, sc.global_step, sc.ar_loss_weight) == (4, 2, True, 3, 0.2)
    assert model.config.vocab_size > sc.mask_id
    assert tok.chat_template and tok.convert_ids_to_tokens(tok.eos_token_id) == "<|im_end|>"

    base = load_file(str(demo_kit / "base_model" / "model.safetensors"))
    trained = load_file(str(final / "model.safetensors"))
    emb = trained["model.embed_tokens.weight"]
    assert not torch.equal(emb[: base["model.embed_tokens.weight"].shape[0]], base["model.embed_tokens.weight"])
    assert torch.equal(model.get_output_embeddings().weight, model.get_input_embeddings().weight)
    with torch.no_grad():
        out = model(input_ids=torch.tensor([tok("<|im_start|>user\nAdd 1 and 2.")["input_ids"]]))
    assert torch.isfinite(out.logits).all()


def test_ar_only_then_block_diffusion_conversion(demo_kit, tmp_path):
    ar = tmp_path / "ar"
    run_train(train_args(demo_kit, ar, **COMMON, recipe="ar_sft", max_steps=2))
    assert json.loads((ar / "run_config.json").read_text())["recipe"] == "ar_sft"
    assert not (ar / "final" / "block_diffusion.json").exists()
    assert "<|mask|>" not in AutoTokenizer.from_pretrained(ar / "final").get_vocab()
    bd = tmp_path / "bd"
    bd_flags = dict(model_id=ar / "final", max_steps=2, multiturn=True, within_block_causal=True)
    run_train(train_args(demo_kit, bd, **COMMON, **bd_flags))
    sc = read_sidecar(bd / "final")
    assert sc.base_model == str(ar / "final") and sc.within_block_causal
    assert json.loads((bd / "run_config.json").read_text())["recipe"] == "sft"
    sc.check_tokenizer(AutoTokenizer.from_pretrained(bd / "final"))


@pytest.mark.skipif(not cpu_has_bf16(), reason="this CPU has no native bf16 (AVX512-BF16 / AMX)")
def test_bf16_compute_on_a_cpu_with_native_bf16(demo_kit, tmp_path):
    """--dtype bf16 on CPU: FSDP computes in bf16, the master weights, optimizer and checkpoint stay fp32, and
    the losses track the fp32 run's."""
    losses = {}
    for dtype in ("fp32", "bf16"):
        run = tmp_path / dtype
        run_train(train_args(demo_kit, run, **COMMON, max_steps=3, dtype=dtype))
        losses[dtype] = [json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines()]
        saved = load_file(str(run / "final" / "model.safetensors"))
        assert all(t.dtype == torch.float32 for t in saved.values())
    assert losses["bf16"] != losses["fp32"], "bf16 compute really ran"
    assert losses["bf16"] == pytest.approx(losses["fp32"], rel=2e-2)


def test_bf16_is_refused_on_a_cpu_without_native_bf16(monkeypatch):
    from train import build
    from train.cli import parse_args
    from train.config import FlagError, JobConfig
    from train.parallel import DistInfo

    monkeypatch.setattr(build, "cpu_has_bf16", lambda: False)
    config = JobConfig.from_args(
        parse_args(["--model_id", "m", "--dataset", "d.jsonl", "--save_dir", "o", "--dtype", "bf16"])
    )
    with pytest.raises(FlagError, match="no native bf16"):
        build.check_runtime(config, DistInfo(0, 1, 0, torch.device("cpu")))
