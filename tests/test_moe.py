"""Mixture-of-experts models (Qwen3-MoE): the router's load-balancing loss in the block-diffusion objective,
the flag that sets it, and the trainer end to end (FSDP2 on two ranks) into the engine's three modes.
Invariants 1-4 and the reference decoder run on a tiny Qwen3-MoE in their own files."""

import json
import random
import re

import pytest
import torch

from tests.tiny import FILLER_ID, MASK_ID, random_sample, tiny_model
from train.config import BlockDiffusionConfig
from train.model import TwoStreamLM, is_moe
from train.noise import noise_generator
from train.rows import SpecialIds, build_batch

IDS = SpecialIds(mask_id=MASK_ID, filler_id=FILLER_ID)
CFG = BlockDiffusionConfig(bd_size=4)


def _batch(row_length=None):
    rng = random.Random(2)
    rows = [[random_sample(rng, turns=2)] for _ in range(2)]
    return build_batch(rows, CFG, IDS, noise_generator(0, 0, 0), row_length=row_length)


def _switch_loss_by_hand(model, batch) -> torch.Tensor:
    """E * sum_e f_e * P_e over every layer's router at every real (non-padding) token: f_e the share of
    top-k assignments that go to expert e per token, P_e the mean router probability of e."""
    logits = []
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda mod, args, out: logits.append(out[0].detach()))
        for layer in model.get_decoder().layers
    ]
    try:
        with torch.no_grad():
            TwoStreamLM(model, CFG).logits(batch)
    finally:
        for h in hooks:
            h.remove()
    real = (batch.meta.stream >= 0).reshape(-1)
    probs = torch.cat([x[real] for x in logits]).float().softmax(-1)
    E, k = model.config.num_experts, model.config.num_experts_per_tok
    chosen = torch.zeros_like(probs).scatter_(1, probs.topk(k, dim=-1).indices, 1.0)
    return E * (chosen.mean(0) * probs.mean(0)).sum()


def test_router_aux_loss_is_added_over_real_tokens_only():
    model = tiny_model("qwen3_moe")
    assert is_moe(model.config) and not is_moe(tiny_model().config)
    batch = _batch()
    plain = TwoStreamLM(model, CFG)(batch)
    with_aux = TwoStreamLM(model, CFG, router_aux_coef=0.5)(batch)
    want = _switch_loss_by_hand(model, batch)
    assert plain.aux is None
    torch.testing.assert_close(with_aux.aux, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(with_aux.loss.detach(), plain.loss.detach() + 0.5 * want, atol=1e-5, rtol=1e-5)
    # Padding rows are routed too, but never counted.
    padded = _batch(row_length=batch.input_ids.shape[1] + 17)
    torch.testing.assert_close(TwoStreamLM(model, CFG, router_aux_coef=0.5)(padded).aux, want, atol=1e-5, rtol=1e-5)
    # The aux term trains the routers.
    with_aux.loss.backward()
    assert all(layer.mlp.gate.weight.grad.abs().sum() > 0 for layer in model.get_decoder().layers)


def test_router_aux_loss_is_refused_for_a_dense_model():
    with pytest.raises(ValueError, match="no expert router"):
        TwoStreamLM(tiny_model(), CFG, router_aux_coef=0.1)


@pytest.fixture(scope="module")
def moe_kit(tmp_path_factory):
    from tests.conftest import _make_kit

    return _make_kit(tmp_path_factory.mktemp("moe_kit"), "--layers", "2", "--arch", "qwen3_moe")


@pytest.mark.e2e
def test_torchrun_two_ranks_converts_an_moe_model_and_the_engine_serves_it(moe_kit, tmp_path):
    from transformers import AutoModelForCausalLM

    from bdcore.decode.config import DecodeConfig
    from bdcore.decode.sampling import SamplingParams
    from bdcore.loading import load_checkpoint
    from inference.native.engine import Engine
    from tests.conftest import run_train
    from tests.test_invariant_4_self_spec import _prompts
    from tests.train_args import train_args

    run = tmp_path / "run"
    run_train(train_args(moe_kit, run, max_steps=2, lr="1e-3", log_every=1, pack=True), nproc=2)
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(r["router_aux"] > 0 and r["diff_tokens"] > 0 for r in records), "the config's coefficient applies"
    model = AutoModelForCausalLM.from_pretrained(run / "final")
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    loaded = load_checkpoint(run / "final")
    engine = Engine(loaded)
    prompt = _prompts(loaded.tokenizer, 1, seed=2)[0]
    outs = {}
    for mode in ("causal", "diffusion", "self-spec"):
        outs[mode] = engine.generate(prompt, SamplingParams(max_tokens=10), DecodeConfig(mode=mode))
        assert outs[mode].stats.generated > 0
    assert outs["self-spec"].tokens == outs["causal"].tokens, "greedy self-spec is lossless on an MoE too"


@pytest.mark.e2e
def test_router_aux_flag(moe_kit, demo_kit, tmp_path, capfd):
    from tests.conftest import run_train, train_py_error
    from tests.train_args import train_args

    off = tmp_path / "off"
    run_train(train_args(moe_kit, off, max_steps=1, router_aux_loss_coef=0))
    assert "router_aux" not in json.loads((off / "metrics.jsonl").read_text().splitlines()[0])
    last = train_py_error(train_args(demo_kit, tmp_path / "dense", max_steps=1, router_aux_loss_coef="0.01"), capfd)[-1]
    assert re.search("--router_aux_loss_coef: .* is not a mixture-of-experts model", last), last
