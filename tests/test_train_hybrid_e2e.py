"""train.py on hybrid Qwen3.5 models: torchrun x2, reload, resume; a vision-language checkpoint trains text-only."""

import copy

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from bdcore.sidecar import read_sidecar
from data.toy_tokenizer import build_char_tokenizer
from tests.conftest import read_metrics, run_train
from tests.tiny import tiny_hybrid_config
from tests.train_args import train_args

pytestmark = pytest.mark.e2e  # a whole program, server or long sweep: `pytest -m 'not e2e'` skips it


def test_hybrid_trains_reloads_and_resumes_exactly(hybrid_kit, tmp_path):
    common = dict(pack=True, multiturn=True, lr="2e-3", max_steps=4)
    full, part = tmp_path / "full", tmp_path / "resumed"
    run_train(train_args(hybrid_kit, full, **common, save_every=2), nproc=2)
    run_train(train_args(hybrid_kit, part, **common, resume=full / "step_2"), nproc=2)
    a, b = read_metrics(full), read_metrics(part)
    assert a[4]["loss"] < a[1]["loss"]
    for step in (3, 4):
        for key in ("loss", "diff", "ar", "grad_norm"):
            assert abs(a[step][key] - b[step][key]) <= 1e-6 * max(1.0, abs(a[step][key])), (step, key)
    wa, wb = load_file(str(full / "final" / "model.safetensors")), load_file(str(part / "final" / "model.safetensors"))
    assert all(torch.allclose(wa[k], wb[k], rtol=0, atol=1e-6) for k in wa)

    model = AutoModelForCausalLM.from_pretrained(full / "final")
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    tok = AutoTokenizer.from_pretrained(full / "final")
    read_sidecar(full / "final").check_tokenizer(tok)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tok("<|im_start|>user\\nCopy: abc")["input_ids"]])).logits
    assert torch.isfinite(logits).all()


def test_vision_language_checkpoint_trains_its_text_model(tmp_path, hybrid_kit):
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    tok = build_char_tokenizer()
    text = tiny_hybrid_config(vocab=len(tok)).to_dict()
    vision = dict(
        depth=1,
        hidden_size=32,
        num_heads=2,
        intermediate_size=64,
        out_hidden_size=64,
        patch_size=4,
        temporal_patch_size=1,
        spatial_merge_size=1,
    )
    cfg = Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=True)
    src = tmp_path / "vl"
    Qwen3_5ForConditionalGeneration(copy.deepcopy(cfg)).save_pretrained(src)
    tok.save_pretrained(src)
    run = tmp_path / "run"
    run_train(train_args(hybrid_kit, run, model_id=src, max_steps=1))
    model = AutoModelForCausalLM.from_pretrained(run / "final")
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    assert read_sidecar(run / "final").base_model == str(src)
