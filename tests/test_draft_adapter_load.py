"""A damaged draft adapter is refused at load in one line naming the file, the field and the fix (issue 54,
hostile inputs 4-6): a missing mask row (was a FileNotFoundError traceback), a NaN or inf weight (was the served
adapter's SVD failing with a traceback), a non-finite or absurd rank or alpha in adapter_config.json (lora_alpha
Infinity was served, and self-spec answered one empty token where causal gave eight). Through the loader, through
serve.py's every backend in-process, and from the shell (status 2, one line, no traceback)."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from bdcore.checkpoint_files import CheckpointError
from bdcore.draft_adapter import ADAPTER_DIR, MASK_ROW, MASK_ROW_FILE
from bdcore.loading import load_checkpoint
from benchmark.tiny import draft_checkpoint
from tests.test_serve_cli import _refused_at_start, run_serve_py

WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return draft_checkpoint(tmp_path_factory.mktemp("draft") / "ckpt")


def _damaged(ckpt, tmp_path, damage):
    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    damage(bad / ADAPTER_DIR)
    return bad


def _no_mask_row(adapter):
    (adapter / MASK_ROW_FILE).unlink()


def _poison(file: str, which: str, value: float):
    def damage(adapter):
        tensors = load_file(str(adapter / file))
        name = next(k for k in sorted(tensors) if which in k)
        tensors[name].view(-1)[3] = value
        save_file(tensors, str(adapter / file))

    return damage


def _config(**change):
    def damage(adapter):
        config = json.loads((adapter / CONFIG).read_text())
        (adapter / CONFIG).write_text(json.dumps({**config, **change}))  # json writes inf and NaN as Infinity, NaN

    return damage


def _refused(path) -> str:
    with pytest.raises(CheckpointError) as refused:
        load_checkpoint(path)
    line = str(refused.value)
    assert "\n" not in line, line
    return line


def test_the_undamaged_adapter_loads(ckpt):
    assert load_checkpoint(ckpt).sidecar.draft_adapter == ADAPTER_DIR


def test_a_missing_mask_row_is_refused_naming_the_file(ckpt, tmp_path):
    line = _refused(_damaged(ckpt, tmp_path, _no_mask_row))
    assert f"{ADAPTER_DIR}/{MASK_ROW_FILE} is missing: copy the whole checkpoint directory" in line, line


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize(("file", "which"), [(WEIGHTS, "lora_A"), (WEIGHTS, "lora_B"), (MASK_ROW_FILE, MASK_ROW)])
def test_a_non_finite_weight_is_refused_before_any_svd(ckpt, tmp_path, file, which, value):
    line = _refused(_damaged(ckpt, tmp_path, _poison(file, which, value)))
    assert f"{file}: " in line and which in line and "holds 1 non-finite value (NaN or inf)" in line, line
    assert "serve an earlier checkpoint, or retrain" in line, line


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"lora_alpha": float("inf")}, "lora_alpha must be a finite number > 0, got inf"),
        ({"lora_alpha": float("nan")}, "lora_alpha must be a finite number > 0, got nan"),
        ({"lora_alpha": float("-inf")}, "lora_alpha must be a finite number > 0, got -inf"),
        ({"lora_alpha": 0}, "lora_alpha must be a finite number > 0, got 0"),
        ({"lora_alpha": -8}, "lora_alpha must be a finite number > 0, got -8"),
        ({"lora_alpha": "8"}, "lora_alpha must be a finite number > 0, got '8'"),
        ({"lora_alpha": True}, "lora_alpha must be a finite number > 0, got True"),
        ({"lora_alpha": 1e300}, "scale a LoRA term by 2.5e+299 (lora_alpha / r), past the 1024"),
        ({"lora_alpha": 4 * 1024 + 4}, "scale a LoRA term by 1025 (lora_alpha / r)"),
        ({"use_rslora": True, "lora_alpha": 2 * 1024 + 2}, "by 1025 (lora_alpha / sqrt(r) (use_rslora))"),
        ({"use_rslora": "yes"}, "use_rslora must be true or false, got 'yes'"),
        ({"r": 0}, "r must be a positive integer (the LoRA rank), got 0"),
        ({"r": -4}, "r must be a positive integer (the LoRA rank), got -4"),
        ({"r": 4.0}, "r must be a positive integer (the LoRA rank), got 4.0"),
        ({"r": float("nan")}, "r must be a positive integer (the LoRA rank), got nan"),
        ({"r": None}, "r must be a positive integer (the LoRA rank), got None"),
        ({"r": 10**9}, "lora_A.weight has rank 4, but adapter_config.json says r 1000000000"),
        ({"rank_pattern": {"q_proj": 0}}, "rank_pattern must map each module name to a positive integer"),
        ({"alpha_pattern": {"q_proj": float("inf")}}, "alpha_pattern must map each module name to a finite number > 0"),
    ],
)
def test_a_non_finite_or_absurd_lora_config_is_refused(ckpt, tmp_path, change, says):
    line = _refused(_damaged(ckpt, tmp_path, _config(**change)))
    named = WEIGHTS if "has rank" in says else CONFIG  # an r the saved weights do not have: both files named
    assert f"{ADAPTER_DIR}/{named}: " in line and says in line, line


def test_the_scale_bound_admits_what_adapters_are_trained_with():
    """alpha = r (scale 1), the trainer's 2r (2), 16 at r = 1, rsLoRA at r = 256 and 2r (32), the bound itself."""
    from bdcore.draft_adapter_files import MAX_LORA_SCALING, check_lora_config

    assert MAX_LORA_SCALING == 1024  # the figure the refusals above name
    for r, alpha, rslora in [(4, 4, False), (16, 32, False), (1, 16, False), (256, 512, True), (1, 1024, False)]:
        check_lora_config({"r": r, "lora_alpha": alpha, "use_rslora": rslora})


@pytest.mark.parametrize("key", ["use_rslora", "use_dora"])
def test_the_native_engine_refuses_a_scale_it_would_not_compute(ckpt, tmp_path, key):
    """It rebuilds plain LoRA (lora_alpha / r) from r and lora_alpha: an rsLoRA config (lora_alpha / sqrt(r))
    would be served at another scale than it was trained at."""
    line = _refused(_damaged(ckpt, tmp_path, _config(**{key: True})))
    assert f"{CONFIG} sets {key}; the native engine serves the plain LoRA" in line, line


DAMAGES = {
    "no_mask_row": (_no_mask_row, f"{MASK_ROW_FILE} is missing"),
    "nan_weight": (_poison(WEIGHTS, "lora_B", float("nan")), "non-finite value"),
    "infinite_alpha": (_config(lora_alpha=float("inf")), "lora_alpha must be a finite number > 0, got inf"),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_every_backend_of_serve_py_refuses_it_in_one_line(ckpt, tmp_path, monkeypatch, damage):
    """The SGLang and vLLM commands are built after the same checks (`check_checkpoint`); their engines would
    load the damaged adapter with their own LoRA loaders."""
    do, phrase = DAMAGES[damage]
    bad = _damaged(ckpt, tmp_path, do)
    for backend in ("native", "sglang", "vllm"):
        argv = [str(bad), "--mode", "self-spec", "--draft-len", "4", "--backend", backend, "--dry-run"]
        line = _refused_at_start(monkeypatch, argv)
        assert phrase in line, (backend, line)


@pytest.mark.e2e
@pytest.mark.parametrize("damage", DAMAGES)
def test_serve_py_refuses_it_from_the_shell(ckpt, tmp_path, damage):
    do, phrase = DAMAGES[damage]
    bad = _damaged(ckpt, tmp_path, do)
    proc = run_serve_py(str(bad), "--mode", "self-spec", "--backend", "native")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("serve.py: error: ") and phrase in lines[0], proc.stderr[-3000:]


def test_a_live_model_with_a_non_finite_term_is_refused_by_name_at_the_cut():
    """`truncate_adapter` on a model that never went through a loader (a benchmark's in-process adapter)."""
    from bdcore.draft_adapter import LoraSpec, add_lora
    from bdcore.draft_adapter_serving import truncate_adapter
    from benchmark.tiny import randomize_adapter
    from tests.tiny import MASK_ID, tiny_model

    model = add_lora(tiny_model(), LoraSpec(rank=4, alpha=8), MASK_ID)
    randomize_adapter(model)
    name, weight = next((n, p) for n, p in model.named_parameters() if "lora_B" in n)
    with torch.no_grad():
        weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="the LoRA term holds non-finite values"):
        truncate_adapter(model, 0.99)
