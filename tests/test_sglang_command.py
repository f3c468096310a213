"""SGLang launch command for upstream dLLM families: config schema, argv layout, interpreter choice.

Pure CPU and sglang-free: these only check the YAML presets and the argv we hand to `sglang.launch_server`.
"""

import shutil
from pathlib import Path

import pytest
import yaml

from inference.sglang_backend.command import (
    CONFIG_DIR,
    FAMILIES,
    SGLANG_PYTHON_ENV,
    build_sglang_command,
    load_family_config,
    resolve_sglang_python,
    write_algorithm_config,
)

# The presets, as read from SGLang 0.5.23 and the LLaDA2.1 model card (see the comments in each YAML).
EXPECTED = {
    "sdar": ("LowConfidence", {"threshold": 0.95}),
    "llada2-0": ("LowConfidence", {"threshold": 0.95}),
    "llada2-1-speed": (
        "JointThreshold",
        {"threshold": 0.5, "edit_threshold": 0.0, "max_post_edit_steps": 16, "penalty_lambda": 0.0},
    ),
    "llada2-1-quality": (
        "JointThreshold",
        {"threshold": 0.7, "edit_threshold": 0.5, "max_post_edit_steps": 16, "penalty_lambda": 0.0},
    ),
}


def _config_copy(tmp_path: Path, family: str, changes: dict) -> Path:
    """Copy one shipped YAML into tmp_path, with top-level keys changed (value None deletes the key)."""
    data = yaml.safe_load((CONFIG_DIR / f"{family}.yaml").read_text())
    for key, value in changes.items():
        if value is None:
            data.pop(key)
        else:
            data[key] = value
    (tmp_path / f"{family}.yaml").write_text(yaml.safe_dump(data))
    return tmp_path


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_config_loads(family):
    cfg = load_family_config(family)
    algorithm, algo_cfg = EXPECTED[family]
    assert cfg.family == family
    assert cfg.description
    assert cfg.algorithm == algorithm
    assert cfg.algorithm_config == algo_cfg
    assert isinstance(cfg.server_args, tuple)
    assert "--trust-remote-code" in cfg.server_args


def test_configs_dir_holds_exactly_the_families():
    assert sorted(p.stem for p in CONFIG_DIR.glob("*.yaml")) == sorted(FAMILIES)


@pytest.mark.parametrize("family", FAMILIES)
def test_command_layout(family, tmp_path):
    cfg = load_family_config(family)
    algo = tmp_path / "algo.yaml"
    cmd = build_sglang_command("org/model", family=family, python="/env/bin/python", port=31000, algo_config_path=algo)
    assert cmd == [
        "/env/bin/python",
        "-m",
        "sglang.launch_server",
        "--model-path",
        "org/model",
        "--host",
        "127.0.0.1",
        "--port",
        "31000",
        "--dllm-algorithm",
        cfg.algorithm,
        "--dllm-algorithm-config",
        str(algo),
        *cfg.server_args,
    ]


def test_extra_args_go_last_and_api_key_before_them(tmp_path):
    extra = ["--tp", "2", "--mem-fraction-static", "0.8"]
    cmd = build_sglang_command(
        "m", family="llada2-1-quality", host="0.0.0.0", api_key="sk-x", extra_args=extra, algo_config_path=tmp_path
    )
    assert cmd[-len(extra) :] == extra
    assert cmd[-len(extra) - 2 : -len(extra)] == ["--api-key", "sk-x"]
    assert cmd[cmd.index("--host") + 1] == "0.0.0.0"


def test_max_running_requests_is_passed_on(tmp_path):
    """SGLang runs dLLM requests one at a time unless told (DllmConfig: max_running_requests or 1)."""
    cmd = build_sglang_command("m", family="sdar", algo_config_path=tmp_path, max_running_requests=8, extra_args=["-x"])
    assert cmd[-3:] == ["--max-running-requests", "8", "-x"]
    assert "--max-running-requests" not in build_sglang_command("m", family="sdar", algo_config_path=tmp_path)


def test_no_api_key_flag_without_a_key(tmp_path):
    assert "--api-key" not in build_sglang_command("m", family="sdar", algo_config_path=tmp_path)


@pytest.mark.parametrize("family", FAMILIES)
def test_written_algorithm_config_round_trips(family, tmp_path):
    cfg = load_family_config(family)
    path = write_algorithm_config(cfg, tmp_path / "sub")
    assert path.parent == tmp_path / "sub"
    assert yaml.safe_load(path.read_text()) == cfg.algorithm_config


def test_config_file_is_written_when_no_path_given():
    cmd = build_sglang_command("m", family="llada2-1-speed")
    path = Path(cmd[cmd.index("--dllm-algorithm-config") + 1])
    try:
        assert yaml.safe_load(path.read_text()) == EXPECTED["llada2-1-speed"][1]
    finally:
        shutil.rmtree(path.parent)


def test_empty_algorithm_config_omits_the_flag(tmp_path):
    d = _config_copy(tmp_path, "llada2-0", {"algorithm_config": {}})
    cmd = build_sglang_command("m", family="llada2-0", config_dir=d, algo_config_path=tmp_path / "unused.yaml")
    assert "--dllm-algorithm-config" not in cmd
    assert cmd[cmd.index("--dllm-algorithm") + 1] == "LowConfidence"


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"algorithm": None}, "algorithm"),
        ({"server_args": None}, "server_args"),
        ({"bogus": 1}, "bogus"),
        ({"description": 3}, "description"),
        ({"server_args": "--trust-remote-code"}, "server_args"),
        ({"server_args": ["--tp", 2]}, "server_args[1]"),
        ({"algorithm_config": ["threshold", 0.9]}, "algorithm_config"),
        ({"family": "sdar"}, "family"),
        ({"algorithm": "NoSuchAlgo"}, "algorithm"),
        # The model card's spelling; SGLang would silently ignore it.
        ({"algorithm_config": {"editing_threshold": 0.5}}, "algorithm_config.editing_threshold"),
        ({"algorithm_config": {"threshold": "high"}}, "algorithm_config.threshold"),
        ({"algorithm_config": {"max_post_edit_steps": 1.5}}, "algorithm_config.max_post_edit_steps"),
        ({"algorithm_config": {"threshold": True}}, "algorithm_config.threshold"),
    ],
)
def test_malformed_config_names_file_and_key(tmp_path, changes, needle):
    d = _config_copy(tmp_path, "llada2-1-quality", changes)
    with pytest.raises(ValueError) as err:
        load_family_config("llada2-1-quality", config_dir=d)
    assert needle in str(err.value)
    assert "llada2-1-quality.yaml" in str(err.value)


def test_non_mapping_and_missing_file(tmp_path):
    (tmp_path / "sdar.yaml").write_text("- just\n- a list\n")
    with pytest.raises(ValueError, match="sdar.yaml"):
        load_family_config("sdar", config_dir=tmp_path)
    with pytest.raises(ValueError, match="llada2-0.yaml"):
        load_family_config("llada2-0", config_dir=tmp_path)


def test_unknown_family_lists_the_families():
    with pytest.raises(ValueError) as err:
        build_sglang_command("m", family="dream")
    assert "dream" in str(err.value)
    for family in FAMILIES:
        assert family in str(err.value)


def test_resolve_sglang_python_precedence(monkeypatch):
    monkeypatch.delenv(SGLANG_PYTHON_ENV, raising=False)
    assert resolve_sglang_python(None) == "python"
    monkeypatch.setenv(SGLANG_PYTHON_ENV, "")
    assert resolve_sglang_python(None) == "python"
    monkeypatch.setenv(SGLANG_PYTHON_ENV, "/opt/sglang/bin/python")
    assert resolve_sglang_python(None) == "/opt/sglang/bin/python"
    assert resolve_sglang_python("/cli/python") == "/cli/python"
