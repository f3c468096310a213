"""serve.py: backend choice and the command it builds for every mode and SGLang family."""

import subprocess
import sys

import pytest

from inference import serve
from inference.sglang_backend.command import FAMILIES, load_family_config
from tests.conftest import REPO

pytestmark = pytest.mark.e2e  # a whole program, server or long sweep: `pytest -m 'not e2e'` skips it


@pytest.mark.parametrize("family", FAMILIES)
def test_sglang_family_dry_run_prints_the_launch_command(family, capsys):
    assert (
        serve.main(
            [
                "some/model",
                "--mode",
                family,
                "--dry-run",
                "--port",
                "31000",
                "--sglang-python",
                "/opt/sg/bin/python",
                "--",
                "--tp",
                "2",
            ]
        )
        == 0
    )
    cmd = capsys.readouterr().out.split()
    cfg = load_family_config(family)
    assert cmd[:3] == ["/opt/sg/bin/python", "-m", "sglang.launch_server"]
    assert cmd[cmd.index("--model-path") + 1] == "some/model" and cmd[cmd.index("--port") + 1] == "31000"
    assert cmd[cmd.index("--dllm-algorithm") + 1] == cfg.algorithm
    assert cmd[-2:] == ["--tp", "2"] and "--" not in cmd
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1"


def test_model_from_environment_and_missing_model(monkeypatch, capsys):
    monkeypatch.setenv("BDSTACK_MODEL", "env/model")
    assert serve.main(["--mode", "sdar", "--dry-run"]) == 0
    assert "env/model" in capsys.readouterr().out
    monkeypatch.delenv("BDSTACK_MODEL")
    with pytest.raises(SystemExit, match="BDSTACK_MODEL"):
        serve.main(["--mode", "sdar", "--dry-run"])


def test_backend_choice():
    assert serve.pick_backend("auto", "self-spec") == "native"  # no GPU / no sglang here
    assert serve.pick_backend("auto", "llada2-0") == "sglang"
    with pytest.raises(SystemExit, match="--backend sglang"):
        serve.pick_backend("native", "sdar")
    assert serve.pick_backend("auto", "self-spec", "/opt/sg/bin/python") == "native"  # no GPU here
    with pytest.raises(SystemExit, match="not a model directory|no block_diffusion.json"):
        serve.main(["m", "--mode", "diffusion", "--backend", "sglang", "--dry-run"])


def test_native_errors_are_clear(tmp_path):
    proc = subprocess.run(
        [sys.executable, "inference/serve.py", str(tmp_path), "--mode", "causal"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0 and "no config.json" in proc.stderr


def test_native_refuses_self_spec_on_a_block_causal_checkpoint(tmp_path):
    from tests.tiny import tiny_checkpoint

    tiny_checkpoint(tmp_path, clean_causal=False)
    proc = subprocess.run(
        [sys.executable, "inference/serve.py", str(tmp_path), "--mode", "self-spec"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0 and "clean_causal" in proc.stderr


def test_help_lists_modes_and_families():
    out = subprocess.run(
        [sys.executable, "inference/serve.py", "--help"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    for name in ("causal", "diffusion", "self-spec", *FAMILIES, "--dry-run", "--log", "--api-key", "--tree"):
        assert name in out
    flat = " ".join(out.split())  # argparse wraps the help text
    assert "spine:W1" in flat and "SGLang and vLLM refuse it" in flat


def test_log_tees_the_child_output(tmp_path, capsys):
    """--log copies the SGLang process's output to a file (here the 'interpreter' is echo)."""
    log = tmp_path / "sglang.log"
    assert serve.main(["m", "--mode", "sdar", "--sglang-python", "/bin/echo", "--log", str(log)]) == 0
    line = log.read_text().strip()
    assert line.startswith("-m sglang.launch_server --model-path m") and "--dllm-algorithm" in line
    assert line in capsys.readouterr().out


def test_request_limits_reach_the_native_server(monkeypatch):
    """--max-request-bytes (default 4 MiB) and --allow-client-chat-template (default off) reach create_app."""
    import types

    from bdcore import loading
    from inference import server

    made = []
    monkeypatch.setattr(loading, "load_checkpoint", lambda *a, **k: types.SimpleNamespace(name="m"))
    monkeypatch.setattr(server, "create_app", lambda *a, **k: made.append(k) or "app")
    monkeypatch.setattr(server, "serve_app", lambda app, **k: True)
    assert serve.main(["m", "--mode", "causal", "--backend", "native"]) == 0
    assert made[-1]["max_request_bytes"] == 4 * 2**20 and made[-1]["allow_client_chat_template"] is False
    assert made[-1]["compiled"] is False, "eager unless --compile"
    argv = ["m", "--mode", "causal", "--backend", "native", "--max-request-bytes", "1000"]
    assert serve.main([*argv, "--allow-client-chat-template"]) == 0
    assert made[-1]["max_request_bytes"] == 1000 and made[-1]["allow_client_chat_template"] is True
    assert serve.main([*argv, "--compile"]) == 0 and made[-1]["compiled"] is True
    out = serve.build_parser().format_help()
    assert "--max-request-bytes" in out and "--allow-client-chat-template" in out and "--compile" in out


def test_native_self_spec_chooses_its_layout_by_default_and_sglang_drafts_fixed(monkeypatch, capsys, tmp_path):
    """The native engine's default is --draft-len auto --self-spec-canvases auto (docs/design.md 8.19); a
    fixed value given on the command line stays fixed; SGLang's self-spec drafts the trained block."""
    import types

    from bdcore import loading
    from benchmark.tiny import tiny_checkpoint
    from inference import server

    made = []
    monkeypatch.setattr(loading, "load_checkpoint", lambda *a, **k: types.SimpleNamespace(name="m"))
    monkeypatch.setattr(server, "create_app", lambda *a, **k: made.append(a[1]) or "app")
    monkeypatch.setattr(server, "serve_app", lambda app, **k: True)
    assert serve.main(["m", "--mode", "self-spec", "--backend", "native"]) == 0
    assert (made[-1].draft_len, made[-1].self_spec_canvases) == ("auto", "auto")
    assert made[-1].tree == "auto", "draft trees are weighed where the layout is chosen"
    assert serve.main(["m", "--mode", "self-spec", "--draft-len", "4", "--self-spec-canvases", "last"]) == 0
    assert (made[-1].draft_len, made[-1].self_spec_canvases, made[-1].tree) == (4, "last", "auto")
    assert serve.main(["m", "--mode", "self-spec", "--draft-len", "4", "--tree", "spine:2,2"]) == 0
    assert made[-1].tree == "spine:2,2"
    ckpt = tmp_path / "ckpt"
    tiny_checkpoint(ckpt)
    assert serve.main([str(ckpt), "--mode", "self-spec", "--backend", "sglang", "--dry-run"]) == 0
    assert "--dllm-algorithm" in capsys.readouterr().out
    for backend in ("sglang", "vllm"):  # trees refused by the gate's reason before any command is built
        with pytest.raises(serve.ServeError, match="--tree 2,2 is a native-engine decode"):
            serve.main([str(ckpt), "--mode", "self-spec", "--backend", backend, "--tree", "2,2", "--dry-run"])


def test_serving_dtype_auto_is_bf16_where_the_cpu_has_native_bf16(monkeypatch):
    from bdcore import loading

    monkeypatch.setattr(loading, "cpu_has_bf16", lambda: True)
    assert loading.serving_dtype("auto", "cpu") == "bf16" and loading.serving_dtype("fp32", "cpu") == "fp32"
    assert loading.serving_dtype("auto", "cuda") == "bf16"
    monkeypatch.setattr(loading, "cpu_has_bf16", lambda: False)
    assert loading.serving_dtype("auto", "cpu") == "fp32" and loading.serving_dtype("bf16", "cpu") == "bf16"


def _refused_at_start(monkeypatch, argv) -> str:
    """serve.py's main() expecting its one-line error before the server starts."""
    from inference import server

    monkeypatch.setattr(server, "serve_app", lambda app, **k: pytest.fail("the server started"))
    with pytest.raises(SystemExit) as stopped:
        serve.main(argv)
    line = str(stopped.value)  # a ServeError: its one line (status 2)
    assert stopped.value.code == 2, stopped.value.code
    assert line.startswith("serve.py: error: ") and "\n" not in line, line
    return line


def test_sizes_the_model_cannot_hold_are_refused_at_start(monkeypatch, tmp_path):
    """--block-size 100000 used to start and answer 500 (a 10 GB mask) in diffusion mode; a sidecar bd_size
    of 10**9 used to start and grow to 21 GB at the first request. Both are bounded by the model's context."""
    import json

    from tests.tiny import tiny_checkpoint

    ckpt = tiny_checkpoint(tmp_path / "ckpt")
    native = ["--backend", "native", "--device", "cpu"]
    line = _refused_at_start(monkeypatch, [str(ckpt), "--mode", "diffusion", "--block-size", "100000", *native])
    assert "--block-size 100000 exceeds the model's context length 1024" in line, line
    sidecar = ckpt / "block_diffusion.json"
    sidecar.write_text(json.dumps({**json.loads(sidecar.read_text()), "bd_size": 10**9}))
    for mode in ("diffusion", "self-spec", "causal"):
        line = _refused_at_start(monkeypatch, [str(ckpt), "--mode", mode, *native])
        assert "bd_size 1000000000 exceeds the model's context length 1024" in line, line
    for backend in ("sglang", "vllm"):  # the commands they would run are refused alike
        line = _refused_at_start(monkeypatch, [str(ckpt), "--mode", "diffusion", "--backend", backend, "--dry-run"])
        assert "bd_size 1000000000 exceeds the model's context length 1024" in line, line
    sidecar.write_text(json.dumps({**json.loads(sidecar.read_text()), "bd_size": 4}))
    line = _refused_at_start(
        monkeypatch, [str(ckpt), "--mode", "diffusion", "--block-size", "100000", "--backend", "vllm", "--dry-run"]
    )
    assert "block_size 100000 exceeds the model's context length 1024" in line, line


@pytest.mark.parametrize("damage", ["cut_in_tensors", "malformed_config", "no_tokenizer"])
def test_every_backend_refuses_a_damaged_checkpoint_in_one_line(monkeypatch, tmp_path, damage):
    """The SGLang and vLLM commands are built from the checkpoint's sidecar and tokenizer in our environment:
    the same checks as the native loader (a malformed config.json was an OSError traceback on SGLang)."""
    from tests.damaged_checkpoints import damaged_copy
    from tests.tiny import tiny_checkpoint

    ckpt, phrase = damaged_copy(tiny_checkpoint(tmp_path / "ckpt"), tmp_path / "bad", damage)
    for backend in ("native", "sglang", "vllm"):
        argv = [str(ckpt), "--mode", "self-spec", "--draft-len", "4", "--backend", backend, "--dry-run"]
        assert phrase in _refused_at_start(monkeypatch, argv)


def test_the_default_reply_length_is_refused_at_start_when_it_is_not_positive(monkeypatch, tmp_path):
    """--max-tokens 0 used to start, then answer 500 to every request that gave no max_tokens."""
    line = _refused_at_start(
        monkeypatch, [str(tmp_path), "--mode", "causal", "--backend", "native", "--max-tokens", "0"]
    )
    assert "--max-tokens must be >= 1" in line, line


def run_serve_py(*argv: str) -> subprocess.CompletedProcess:
    """`python inference/serve.py ARGV` from the shell, its output captured."""
    cmd = [sys.executable, "inference/serve.py", *argv]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)


def test_a_damaged_checkpoint_is_one_line_from_the_program(tmp_path):
    """The real process: a truncated model.safetensors used to end in a 23-line SafetensorError traceback."""
    from tests.damaged_checkpoints import damaged_copy
    from tests.tiny import tiny_checkpoint

    ckpt, phrase = damaged_copy(tiny_checkpoint(tmp_path / "ckpt"), tmp_path / "cut", "cut_in_tensors")
    proc = run_serve_py(str(ckpt), "--mode", "diffusion", "--backend", "native")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("serve.py: error: "), proc.stderr[-3000:]
    assert phrase in errors[0] and "re-save or re-download the checkpoint" in errors[0], errors


@pytest.fixture(scope="module")
def block4(tmp_path_factory):
    from tests.tiny import tiny_checkpoint

    return str(tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), bd_size=4))


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--mode", "diffusion", "--steps", "0"], "--steps must be >= 1, got 0; give a positive count"),
        (["--mode", "diffusion", "--threshold", "nan"], "--threshold must be a number >= 0, got nan; give one in"),
        (["--mode", "diffusion", "--draft-len", "100"], "--draft-len 100 exceeds the trained block size 4; give at"),
        (["--mode", "self-spec", "--draft-len", "100"], "--draft-len 100 exceeds the trained block size 4; give at"),
        (["--mode", "causal", "--draft-len", "5"], "block size 4; give at most 4 (the default) (for diffusion mode"),
        (["--mode", "self-spec", "--draft-len", "0"], "--draft-len must be >= 2, got 0; give at least 2"),
        (["--mode", "self-spec", "--tree", "2,9"], "--tree: tree '2,9': widths lie in 1..4"),
        (["--mode", "diffusion", "--block-size", "0"], "--block-size must be >= 2, got 0; give at least 2"),
        (["--mode", "causal", "--max-tokens", "-1"], "--max-tokens must be >= 1, got -1; give a positive count"),
        (["--mode", "causal", "--max-batch", "0"], "--max-batch must be >= 1, got 0; give a positive count"),
        (["--mode", "causal", "--port", "99999"], "--port 99999 is not a TCP port; give one in 1-65535"),
    ],
)
def test_settings_are_checked_at_start_before_the_model_loads(block4, argv, says, monkeypatch, capsys):
    """A setting every request would fail on (a 500 each) stops serve.py at once: one line, exit status 2."""
    from bdcore import loading

    def load(*_a, **_k):
        raise AssertionError("the model was loaded before the settings were checked")

    monkeypatch.setattr(loading, "load_checkpoint", load)
    with pytest.raises(SystemExit) as stopped:
        serve.main([block4, "--backend", "native", *argv])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and err.count("\n") == 1 and err.startswith("serve.py: error: "), err
    assert says in err, err


def test_a_bad_setting_is_one_line_and_status_2_from_the_shell(block4):
    proc = subprocess.run(
        [sys.executable, "inference/serve.py", block4, "--mode", "self-spec", "--steps", "0", "--port", "1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stderr.splitlines() == [
        "serve.py: error: --steps must be >= 1, got 0; give a positive count, or none for --block-size - 1"
    ], proc.stderr


def test_serve_app_reports_a_port_it_cannot_listen_on(tmp_path):
    """HTTP runs on its own thread (inference/server/run.py): a bind failure there must end the decode loop
    on the main thread and come back as False (serve.py's one-line error), not hang the process."""
    import socket

    from bdcore.decode.config import DecodeConfig
    from bdcore.loading import load_checkpoint
    from inference.server import create_app, serve_app
    from tests.tiny import tiny_checkpoint

    app = create_app(load_checkpoint(tiny_checkpoint(tmp_path)), DecodeConfig(mode="causal"), model_name="t")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        assert serve_app(app, host="127.0.0.1", port=taken.getsockname()[1]) is False


def test_sglang_on_device_cpu_runs_its_cpu_engine_with_our_canvas_attention(capsys, tmp_path):
    """serve.py --backend sglang --device cpu: SGLang's CPU engine (its environment variable, torch_native
    attention, which our plugin gives the canvas rule) for our modes and stock causal; never Triton there; the
    caller's own flags after `--` still come last; SGLang's dLLM families and other devices refused."""
    from benchmark.tiny import tiny_checkpoint

    ckpt = tmp_path / "ckpt"
    tiny_checkpoint(ckpt)
    for mode, launcher in (("diffusion", "inference.sglang_backend.launch"), ("causal", "sglang.launch_server")):
        argv = [str(ckpt), "--mode", mode, "--backend", "sglang", "--device", "cpu", "--dry-run", "--", "--x", "1"]
        assert serve.main(argv) == 0
        cmd = capsys.readouterr().out.split()
        assert cmd[:2] == ["env", "SGLANG_USE_CPU_ENGINE=1"] and cmd[3:5] == ["-m", launcher]
        assert cmd[cmd.index("--device") + 1] == "cpu" and "--disable-cuda-graph" in cmd
        assert cmd[cmd.index("--attention-backend") + 1] == "torch_native" and "triton" not in cmd
        assert cmd[-2:] == ["--x", "1"]
    assert serve.main([str(ckpt), "--mode", "diffusion", "--backend", "sglang", "--dry-run"]) == 0
    cmd = capsys.readouterr().out.split()  # no device: SGLang's GPU default, Triton attention, no CPU engine
    assert cmd[0] != "env" and cmd[cmd.index("--attention-backend") + 1] == "triton" and "--device" not in cmd
    with pytest.raises(serve.ServeError, match="run on a GPU only"):
        serve.main(["m", "--mode", "sdar", "--backend", "sglang", "--device", "cpu", "--dry-run"])
    with pytest.raises(serve.ServeError, match="--device xpu"):
        serve.main([str(ckpt), "--mode", "diffusion", "--backend", "sglang", "--device", "xpu", "--dry-run"])
