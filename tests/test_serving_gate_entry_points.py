"""Every backend's entry point refuses or accepts a mode through the serving gate, and through nothing else.

The gate's table (`bdcore.serving_gate.CHECKPOINT_RULES`) is replaced per backend by one that refuses every
mode, then by one that accepts every mode. Refusing, each entry point must refuse with the gate's own
message (so it asked the gate); accepting, each must go on with a decode the real table refuses (so no
check of its own stands beside the gate). The entry points: the native loader, engine, server request and
serve.py's start-up check, the trainer's rollouts; serve.py's SGLang and vLLM commands (causal and ours),
its backend choice, the SGLang plugin inside SGLang, and the vLLM plugin's model check and sampler.
"""

from __future__ import annotations

import pytest
import torch
import yaml

from bdcore import serving_gate
from bdcore.decode.config import DecodeConfig
from bdcore.decode.sampling import SamplingParams
from bdcore.loading import load_checkpoint
from bdcore.serving_gate import CannotServe
from inference import serve
from inference.native.engine import Engine
from inference.server.prepare import request_decode
from inference.server.protocol import APIError
from inference.sglang_backend import plugin
from inference.sglang_backend.command import bdstack_settings as sglang_settings
from inference.vllm_backend.checkpoint import check_servable
from inference.vllm_backend.command import bdstack_settings as vllm_settings
from inference.vllm_backend.sampler import RequestDecoder
from tests.tiny import tiny_checkpoint
from train.rollout import rollout

REFUSED = "refused by the test's table"
SGLANG = ["--backend", "sglang", "--dry-run", "--sglang-python", "/opt/sg/bin/python"]
VLLM = ["--backend", "vllm", "--dry-run", "--vllm-python", "/opt/vllm/bin/python"]


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """Served in every mode by every backend."""
    return tiny_checkpoint(tmp_path_factory.mktemp("dense"), bd_size=4)


@pytest.fixture(scope="module")
def block_causal(tmp_path_factory):
    """Self-spec refused natively, diffusion and self-spec refused by SGLang and vLLM."""
    return tiny_checkpoint(tmp_path_factory.mktemp("block_causal"), bd_size=4, clean_causal=False)


def gate(monkeypatch, backend: str, *, accept: bool) -> None:
    rule = (lambda caps, mode: None) if accept else (lambda caps, mode: REFUSED)
    monkeypatch.setitem(serving_gate.CHECKPOINT_RULES, backend, rule)


def test_native_entry_points_follow_the_gate(monkeypatch, dense, block_causal):
    loaded, refused_natively = load_checkpoint(dense), load_checkpoint(block_causal)
    gate(monkeypatch, "native", accept=False)
    with pytest.raises(CannotServe, match=REFUSED):
        load_checkpoint(dense)
    with pytest.raises(CannotServe, match=REFUSED):
        Engine(loaded, DecodeConfig(mode="causal"))
    with pytest.raises(APIError, match=REFUSED):
        request_decode(loaded, DecodeConfig(mode="causal"), {"mode": "diffusion"})
    assert serve.decode_refusal(str(dense), DecodeConfig(mode="diffusion")) == REFUSED
    with pytest.raises(CannotServe, match=REFUSED):
        rollout(loaded.model, [[5, 6]], caps=loaded.capabilities, decode=DecodeConfig(), params=SamplingParams())

    gate(monkeypatch, "native", accept=True)
    self_spec = DecodeConfig(mode="self-spec", draft_len=3)
    engine = Engine(refused_natively, self_spec)
    assert engine.default_resolved.mode == "self-spec"
    resolved = request_decode(refused_natively, DecodeConfig(mode="causal"), {"mode": "self-spec"})
    assert resolved.mode == "self-spec"
    assert serve.decode_refusal(str(block_causal), self_spec) is None
    params = SamplingParams(max_tokens=2)
    out = rollout(refused_natively.model, [[5, 6]], caps=refused_natively.capabilities, decode=self_spec, params=params)
    assert len(out) == 1


@pytest.mark.parametrize("mode", ["causal", "diffusion", "self-spec"])
@pytest.mark.parametrize(("backend", "flags"), [("sglang", SGLANG), ("vllm", VLLM)])
def test_serve_commands_follow_the_gate(monkeypatch, capsys, dense, block_causal, backend, flags, mode):
    gate(monkeypatch, backend, accept=False)
    with pytest.raises(SystemExit, match=REFUSED):
        serve.main([str(dense), "--mode", mode, *flags])
    gate(monkeypatch, backend, accept=True)
    assert serve.main([str(block_causal), "--mode", mode, *flags]) == 0
    assert capsys.readouterr().out


def test_the_backend_choice_follows_the_gate(monkeypatch, dense, block_causal):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("BDSTACK_SGLANG_PYTHON", raising=False)
    gate(monkeypatch, "vllm", accept=False)
    assert serve.pick_backend("auto", "diffusion", None, "/opt/vllm/bin/python", str(dense)) == "native"
    gate(monkeypatch, "vllm", accept=True)
    assert serve.pick_backend("auto", "diffusion", None, "/opt/vllm/bin/python", str(block_causal)) == "vllm"


def test_the_sglang_plugin_follows_the_gate(monkeypatch, tmp_path, dense, block_causal):
    settings = sglang_settings(dense, "diffusion")
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(settings.to_dict()))
    gate(monkeypatch, "sglang", accept=False)
    with pytest.raises(CannotServe, match=REFUSED):
        plugin.load_settings(str(dense), settings.algorithm, str(path))
    gate(monkeypatch, "sglang", accept=True)
    assert plugin.load_settings(str(block_causal), settings.algorithm, str(path)) == settings


def test_the_vllm_plugin_follows_the_gate(monkeypatch, dense, block_causal):
    settings = vllm_settings(dense, "self-spec")
    gate(monkeypatch, "vllm", accept=False)
    with pytest.raises(CannotServe, match=REFUSED):
        check_servable(dense, settings)
    with pytest.raises(CannotServe, match=REFUSED):
        RequestDecoder(settings, [5, 6], SamplingParams(max_tokens=2), torch.Generator())
    gate(monkeypatch, "vllm", accept=True)
    assert check_servable(block_causal, settings).draft_len == settings.size
    assert RequestDecoder(settings, [5, 6], SamplingParams(max_tokens=2), torch.Generator()).next_step().tokens
