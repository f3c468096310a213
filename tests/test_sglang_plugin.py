"""The SGLang side of bdstack without SGLang: serve.py's command and settings file, the checks a
checkpoint must pass, and the registration pieces (`inference/sglang_backend/plugin.py` takes SGLang's classes
as arguments; here they are given stand-ins with the 0.5.23 signatures)."""

import dataclasses
import enum
import inspect
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import yaml

from bdcore.decode.sampling import SamplingParams
from bdcore.loading import load_checkpoint
from bdcore.serving_gate import CannotServe
from inference import serve
from inference.backend_command import REPO_ROOT
from inference.native.engine import DecodeConfig, Engine
from inference.sglang_backend import plugin
from inference.sglang_backend.command import bdstack_settings, child_environment
from inference.sglang_backend.settings import DIFFUSION, SELF_SPEC, DecodeSettings
from tests.contracts.sglang.names import DLLM_CONFIG_PARAMS
from tests.sglang_emulator import EmulatedAttention
from tests.sglang_emulator import serve as emulate
from tests.test_invariant_4_self_spec import _prompts
from tests.tiny import tiny_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("sgl"), bd_size=4)


def _dry_run(capsys, *argv) -> list[str]:
    assert serve.main(["--backend", "sglang", "--dry-run", "--sglang-python", "/opt/sg/bin/python", *argv]) == 0
    return capsys.readouterr().out.split()


@pytest.mark.parametrize(("mode", "algorithm", "size"), [("diffusion", DIFFUSION, 4), ("self-spec", SELF_SPEC, 3)])
def test_dry_run_builds_the_launcher_command_and_settings(ckpt, capsys, mode, algorithm, size):
    extra = ["--draft-len", "3"] if mode == "self-spec" else ["--threshold", "0.7", "--steps", "2"]
    cmd = _dry_run(capsys, str(ckpt), "--mode", mode, *extra, "--port", "8123", "--", "--tp", "2")
    assert cmd[:3] == ["/opt/sg/bin/python", "-m", "inference.sglang_backend.launch"]
    assert cmd[cmd.index("--model-path") + 1] == str(ckpt) and cmd[cmd.index("--port") + 1] == "8123"
    assert cmd[cmd.index("--dllm-algorithm") + 1] == algorithm
    assert cmd[cmd.index("--attention-backend") + 1] == "triton"
    assert "--no-dllm-fdfo" in cmd, "SGLang 0.5.23 turns FDFO on by default"
    assert cmd[-2:] == ["--tp", "2"]
    settings = DecodeSettings.from_dict(yaml.safe_load(open(cmd[cmd.index("--dllm-algorithm-config") + 1])))
    loaded = load_checkpoint(ckpt)
    assert settings.block_size == size and settings.mask_id == loaded.mask_id
    assert settings.stop_ids == loaded.stop_ids
    if mode == "diffusion":
        assert (settings.threshold, settings.denoise_steps) == (0.7, 2)


def test_causal_runs_stock_sglang_and_bad_settings_are_refused(ckpt, capsys):
    cmd = _dry_run(capsys, str(ckpt), "--mode", "causal")
    assert cmd[:3] == ["/opt/sg/bin/python", "-m", "sglang.launch_server"] and "--dllm-algorithm" not in cmd
    with pytest.raises(SystemExit, match="draft_len 8 exceeds the trained block size 4"):
        _dry_run(capsys, str(ckpt), "--mode", "self-spec", "--draft-len", "8")


def test_all_canvases_self_spec_is_native_only(ckpt, capsys):
    with pytest.raises(SystemExit, match="--self-spec-canvases all is a native-engine decode"):
        _dry_run(capsys, str(ckpt), "--mode", "self-spec", "--self-spec-canvases", "all")


def test_child_environment_makes_the_launcher_importable():
    env = child_environment({"PYTHONPATH": "/x"})
    assert env["PYTHONPATH"].split(os.pathsep) == [str(REPO_ROOT), "/x"]


def test_checkpoint_checks(ckpt, tmp_path):
    good = bdstack_settings(ckpt, "self-spec")
    path = tmp_path / "s.yaml"

    def check(settings, model=ckpt):
        path.write_text(yaml.safe_dump(settings.to_dict()))
        return plugin.load_settings(str(model), settings.algorithm, str(path))

    assert check(good) == good
    with pytest.raises(plugin.PluginError, match="mask_id"):
        check(DecodeSettings(**(good.to_dict() | {"mask_id": good.mask_id + 1})))
    with pytest.raises(CannotServe, match="draft_len 5 exceeds the trained block size 4"):
        check(DecodeSettings(**(good.to_dict() | {"block_size": 5})))
    with pytest.raises(plugin.PluginError, match="needs --dllm-algorithm-config"):
        plugin.load_settings(str(ckpt), SELF_SPEC, None)
    with pytest.raises(plugin.PluginError, match="is a BdstackSelfSpec config"):
        plugin.load_settings(str(ckpt), DIFFUSION, str(path))
    sidecar = json.loads((ckpt / "block_diffusion.json").read_text())
    changed = tmp_path / "ckpt"
    changed.mkdir()
    for f in ckpt.iterdir():
        if f.is_file():
            (changed / f.name).write_bytes(f.read_bytes())
    (changed / "block_diffusion.json").write_text(json.dumps(sidecar | {"clean_causal": False}))
    with pytest.raises(CannotServe, match="clean_causal: false"):
        check(good, changed)
    (changed / "block_diffusion.json").unlink()
    with pytest.raises(CannotServe, match="not a bdstack block-diffusion checkpoint"):
        check(good, changed)


def test_hybrid_checkpoints_need_a_within_block_causal_canvas(tmp_path):
    hybrid = tiny_checkpoint(tmp_path / "h", arch="qwen3_5", bd_size=4)
    refused = "hybrid .* bidirectional canvas .* --backend native"
    with pytest.raises(ValueError, match=refused):  # the launcher refuses it before SGLang starts
        bdstack_settings(hybrid, "diffusion")
    # and so does the plugin inside SGLang, given settings for it (made with the canvas flag flipped)
    sidecar = json.loads((hybrid / "block_diffusion.json").read_text())
    (hybrid / "block_diffusion.json").write_text(json.dumps(sidecar | {"within_block_causal": True}))
    settings = dataclasses.replace(bdstack_settings(hybrid, "diffusion"), within_block_causal=False)
    (hybrid / "block_diffusion.json").write_text(json.dumps(sidecar))
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(settings.to_dict()))
    with pytest.raises(CannotServe, match=refused):
        plugin.load_settings(str(hybrid), DIFFUSION, str(path))
    (hybrid / "block_diffusion.json").write_text(json.dumps(sidecar | {"within_block_causal": True}))
    settings = bdstack_settings(hybrid, "self-spec")
    assert settings.within_block_causal
    path.write_text(yaml.safe_dump(settings.to_dict()))
    assert plugin.load_settings(str(hybrid), SELF_SPEC, str(path)) == settings


def test_mamba_state_guard_restores_the_batch_slots_only():
    # SGLang's mamba pool layout (0.5.23): conv = [tensor [layers, slots, ...]], temporal [layers, slots, H, K, V]
    conv = [torch.arange(2 * 5 * 3, dtype=torch.float32).reshape(2, 5, 3)]
    temporal = torch.randn(2, 5, 2, 4, 4)
    cache = SimpleNamespace(conv=conv, temporal=temporal)
    mapping = torch.tensor([3, 0, 4, 1, 2])  # request pool index -> mamba slot
    pool = SimpleNamespace(
        mamba_pool=SimpleNamespace(mamba_cache=cache), get_mamba_indices=lambda req_idx: mapping[req_idx]
    )
    runner = SimpleNamespace(req_to_token_pool=pool)
    batch = SimpleNamespace(req_pool_indices=torch.tensor([0, 2]))  # slots 3 and 4
    before_conv, before_temporal = conv[0].clone(), temporal.clone()
    with plugin.mamba_state_guard(None, runner, batch):
        conv[0].add_(100.0)  # the canvas forward writes every slot it touches (and here, all of them)
        temporal.mul_(2.0)
    torch.testing.assert_close(conv[0][:, [3, 4]], before_conv[:, [3, 4]])
    torch.testing.assert_close(temporal[:, [3, 4]], before_temporal[:, [3, 4]])
    torch.testing.assert_close(conv[0][:, [0, 1, 2]], before_conv[:, [0, 1, 2]] + 100.0)
    dense = SimpleNamespace(req_to_token_pool=SimpleNamespace())
    with plugin.mamba_state_guard(None, dense, batch):
        pass


def test_mamba_state_guard_translates_unified_memory_slots():
    # --enable-unified-memory: get_mamba_indices gives virtual ids, translate_mamba_indices the physical ones
    temporal = torch.randn(1, 4, 2)
    cache = SimpleNamespace(conv=[torch.zeros(1, 4, 2)], temporal=temporal)
    v2p = torch.tensor([2, 3, 0, 1])
    pool = SimpleNamespace(
        mamba_pool=SimpleNamespace(mamba_cache=cache),
        get_mamba_indices=lambda req_idx: req_idx,
        translate_mamba_indices=lambda virtual: v2p[virtual],
    )
    before, runner = temporal.clone(), SimpleNamespace(req_to_token_pool=pool)
    with plugin.mamba_state_guard(None, runner, SimpleNamespace(req_pool_indices=torch.tensor([0]))):
        temporal.add_(1.0)
    torch.testing.assert_close(temporal[:, 2], before[:, 2])  # the request's physical slot is restored
    torch.testing.assert_close(temporal[:, 0], before[:, 0] + 1.0)


class StandInDllmConfig:
    """DllmConfig's constructor signature (0.5.23)."""

    def __init__(
        self,
        algorithm,
        algorithm_config,
        block_size,
        mask_id,
        max_running_requests,
        first_done_first_out_mode=False,
        requires_separate_context_encoding=False,
        capture_input_preparation=False,
        delete_token_id=None,
        split_token_id=None,
    ):
        self.__dict__.update({k: v for k, v in locals().items() if k != "self"})


def test_stand_in_matches_the_recorded_signature():
    assert list(inspect.signature(StandInDllmConfig).parameters) == DLLM_CONFIG_PARAMS


def test_config_factory_serves_ours_and_defers_the_rest(ckpt, tmp_path):
    settings = bdstack_settings(ckpt, "diffusion", threshold=0.8)
    path = tmp_path / "d.yaml"
    path.write_text(yaml.safe_dump(settings.to_dict()))
    calls = []
    factory = plugin.wrap_config_factory(lambda args: calls.append(args) or "theirs", StandInDllmConfig, lambda a: a)
    view = SimpleNamespace(
        model_path=str(ckpt), dllm_algorithm=DIFFUSION, dllm_algorithm_config=str(path), max_running_requests=None
    )
    cfg = factory(view)
    assert (cfg.block_size, cfg.mask_id, cfg.max_running_requests) == (4, settings.mask_id, 1)
    assert cfg.requires_separate_context_encoding and not cfg.first_done_first_out_mode
    assert DecodeSettings.from_dict(cfg.algorithm_config) == settings
    assert factory(SimpleNamespace(dllm_algorithm="LowConfidence")) == "theirs" and len(calls) == 1


class StandInAlgorithmBase:
    """DllmAlgorithm.__init__ (0.5.23) reads these three fields of the config."""

    def __init__(self, config):
        self.block_size, self.mask_id, self.fdfo = config.block_size, config.mask_id, config.first_done_first_out_mode

    def run(self, *args):  # SGLang's own loop: must lose to the core's run in the MRO
        raise AssertionError("SGLang's base run was called")


def test_registered_class_decodes_like_causal(ckpt):
    loaded = load_checkpoint(ckpt)
    settings = bdstack_settings(ckpt, "self-spec")
    decided = []
    cls = plugin.make_algorithm_class(
        SELF_SPEC, StandInAlgorithmBase, EmulatedAttention.set_attention, lambda c, a: decided.append(c)
    )
    assert cls.__name__ == SELF_SPEC and cls.requires_separate_context_encoding
    assert cls.required_attention_backend == "triton"  # what SGLang forces where no listed backend is named
    assert cls.supported_attention_backends == ("triton", "torch_native")  # torch_native: the CPU engine, ours
    cls.configure_server_args(None)
    assert decided == [cls]
    config = StandInDllmConfig(SELF_SPEC, settings.to_dict(), settings.block_size, settings.mask_id, 1)
    assert cls.recurrent_state_guard is plugin.mamba_state_guard  # SGLang's pool; tested on its own below
    algo = type("Emulated", (cls,), {"recurrent_state_guard": EmulatedAttention.recurrent_state_guard})(config)
    prompts = _prompts(loaded.tokenizer, 4, seed=7)
    params = [SamplingParams(max_tokens=16)] * 4
    got, _ = emulate(loaded, algo, prompts, params, max_running_requests=4)
    causal = Engine(loaded, DecodeConfig(mode="causal"))
    assert got == [causal.generate(p, q).tokens for p, q in zip(prompts, params)]


def test_attention_switch_sets_every_attention_layer():
    class AttentionType(enum.Enum):
        DECODER = "decoder"
        DECODER_BIDIRECTIONAL = "decoder_bidirectional"

    class RadixAttention(torch.nn.Module):
        attn_type = AttentionType.DECODER

    class LogitsProcessor(torch.nn.Module):
        return_full_logits = False

    head = LogitsProcessor()
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), RadixAttention(), torch.nn.Sequential(RadixAttention()), head)
    holder = SimpleNamespace()
    switch = plugin.attention_switch(RadixAttention, AttentionType)
    switch(holder, SimpleNamespace(model=model), bidirectional=True)
    assert head.return_full_logits, "canvas forwards need every row's logits"
    kinds = [m.attn_type for m in model.modules() if isinstance(m, RadixAttention)]
    assert kinds == [AttentionType.DECODER_BIDIRECTIONAL] * 2
    switch(holder, SimpleNamespace(model=model), bidirectional=False)
    assert all(m.attn_type is AttentionType.DECODER for m in model.modules() if isinstance(m, RadixAttention))
    with pytest.raises(plugin.PluginError, match="no RadixAttention"):
        switch(SimpleNamespace(), SimpleNamespace(model=torch.nn.Linear(2, 2)), bidirectional=True)
    with pytest.raises(plugin.PluginError, match="no LogitsProcessor"):
        switch(SimpleNamespace(), SimpleNamespace(model=torch.nn.Sequential(RadixAttention())), bidirectional=True)


def test_unsupported_request_features_are_named():
    def req(return_logprob=False, **sp):
        return SimpleNamespace(sampling_params=SimpleNamespace(**sp), return_logprob=return_logprob)

    assert plugin.unsupported_request(req(temperature=0.7, top_p=0.9, repetition_penalty=1.0)) is None
    error = plugin.unsupported_request(req(True, repetition_penalty=1.2, regex="a+", logit_bias={"1": 2}))
    assert "repetition_penalty" in error and "regex" in error and "logit_bias" in error and "logprobs" in error
    # What SGLang's own dLLM algorithms also refuse (Gemma4Renoise.validate_request, 0.5.23)
    r = req(sampling_seed=7)
    r.logprob, r.custom_logit_processor = SimpleNamespace(top_logprobs_num=3, token_ids_logprob=None), "f"
    error = plugin.unsupported_request(r)
    assert "sampling_seed" in error and "top_logprobs_num" in error and "custom_logit_processor" in error


def test_server_arg_decisions():
    fixed = {"disable_radix_cache": True, "chunked_prefill_size": -1}
    cuda = dict(device="cuda", attention_backend="triton")
    assert plugin.server_arg_decisions(SimpleNamespace(dllm_fdfo=False, **cuda)) == fixed
    # SGLang 0.5.23's default (exec_.py: dllm_fdfo = True), e.g. under stock `sglang serve`
    assert plugin.server_arg_decisions(SimpleNamespace(dllm_fdfo=True, **cuda)) == fixed | {"dllm_fdfo": False}
    # the CPU engine only with our torch_native canvas (test_sglang_canvas_attention.py has every pair)
    cpu = SimpleNamespace(dllm_fdfo=False, device="cpu", attention_backend="torch_native")
    assert plugin.server_arg_decisions(cpu) == fixed
    with pytest.raises(plugin.PluginError, match="need --attention-backend torch_native"):
        plugin.server_arg_decisions(SimpleNamespace(dllm_fdfo=False, device="cpu", attention_backend="triton"))


def test_end_of_turn_must_be_an_sglang_stop(ckpt, tmp_path, monkeypatch):
    """The algorithms report a filler as end-of-turn; SGLang stops only at its own stop set."""
    from inference import backend_command
    from inference.backend_command import engine_stop_ids

    changed = tmp_path / "ckpt"
    changed.mkdir()
    for f in ckpt.iterdir():
        if f.is_file():
            (changed / f.name).write_bytes(f.read_bytes())
    settings = bdstack_settings(changed, "diffusion")
    tokenizer = SimpleNamespace(eos_token_id=settings.filler_id)  # an eos that is not end-of-turn
    (changed / "generation_config.json").write_text(json.dumps({"eos_token_id": [settings.end_of_turn_id, 7]}))
    assert engine_stop_ids(changed, tokenizer) >= {settings.end_of_turn_id, 7, settings.filler_id}
    (changed / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert settings.end_of_turn_id not in engine_stop_ids(changed, tokenizer)
    monkeypatch.setattr(backend_command, "engine_stop_ids", lambda model_dir, tok: frozenset({7}))
    with pytest.raises(ValueError, match="would not stop at end-of-turn"):
        bdstack_settings(changed, "diffusion")


@pytest.mark.skipif(__import__("importlib").util.find_spec("sglang") is not None, reason="SGLang is installed here")
def test_launcher_without_sglang_names_the_fix():
    r = subprocess.run(
        [sys.executable, "-m", "inference.sglang_backend.launch", "--help"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0 and "SGLang is not installed in this interpreter" in r.stderr


@pytest.mark.parametrize("mode", ["causal", "diffusion", "self-spec", "sdar"])
def test_served_model_name_and_max_batch_reach_sglang(ckpt, capsys, mode):
    """serve.py flags that mean something to SGLang are passed on, never dropped; stock causal serving keeps
    SGLang's own batching (no --max-running-requests cap)."""
    cmd = _dry_run(capsys, str(ckpt), "--mode", mode, "--served-model-name", "my-model", "--max-batch", "3")
    assert cmd[cmd.index("--served-model-name") + 1] == "my-model"
    if mode == "causal":
        assert "--max-running-requests" not in cmd
    else:
        assert cmd[cmd.index("--max-running-requests") + 1] == "3"


def test_launcher_imports_only_the_listed_modules():
    """The launcher runs in SGLang's environment (other torch and transformers pins): the bdstack modules it
    imports are those README.md lists, and none brings in transformers, safetensors or peft."""
    code = (
        "import sys; import inference.sglang_backend.plugin; "
        "print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('bdcore', 'inference', 'train', 'data', 'transformers', 'safetensors', 'peft'))))"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    modules = r.stdout.split()
    readme = (REPO_ROOT / "inference" / "sglang_backend" / "README.md").read_text()
    listed = readme[readme.index("The launcher imports only") : readme.index("## Launch")]
    assert not [m for m in modules if m.split(".")[0] in ("transformers", "safetensors", "peft", "train", "data")]
    packages = {"bdcore", "bdcore.decode", "inference", "inference.sglang_backend"}
    files = [m.replace(".", "/") + ".py" for m in modules if m not in packages]
    backend = "inference/sglang_backend/"  # README names these by file name under the folder's own line
    missing = [f for f in files if f"`{f.removeprefix(backend)}`" not in listed]
    assert not missing, f"the launcher imports modules README.md does not list: {missing}"
