"""Shared fixtures: the offline demo kit (tiny Qwen3 + char tokenizer + synthetic chats)."""

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def _private_tempdir(tmp_path, monkeypatch):
    """Temporary files a test's code makes (e.g. serve.py's SGLang settings) and the engine's row-cost
    cache (measured at start-up by auto self-spec) land in its tmp_path, never in the user's ~/.cache."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("BDSTACK_CACHE_DIR", str(tmp_path / "bdstack-cache"))


REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _shaken_inputs(request):
    """`BDSTACK_TEST_SEED` set (`python -m tests.shake`): each test's global random draws (random ids, which rows
    draft, how a batch is made up) come from another seed, its own per test; unset, the tests draw as always."""
    seed = os.environ.get("BDSTACK_TEST_SEED")
    if seed:
        import random
        import zlib

        import torch

        n = zlib.crc32(f"{seed}:{request.node.nodeid}".encode())
        torch.manual_seed(n)
        random.seed(n)


if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs two workers on two cores: one thread each (and in the programs they start), or the
    # workers' thread pools oversubscribe the cores and every forward waits on the other worker's.
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)

# Tests build models and run forwards outside the loaders that settle MKL's vector math: settle it in every
# test process first (bdcore/vector_math.py; without it one Intel process in ~20 got a wrong rotary cos).
from bdcore.vector_math import settle_vector_math  # noqa: E402

settle_vector_math()


def _make_kit(out: Path, *extra: str) -> Path:
    cmd = [sys.executable, "-m", "data.make_demo", str(out), "--train", "160", "--eval", "10", "--hidden", "64"]
    subprocess.run([*cmd, *extra], cwd=REPO, check=True, capture_output=True)
    return out


@pytest.fixture(scope="session")
def demo_kit(tmp_path_factory) -> Path:
    return _make_kit(tmp_path_factory.mktemp("kit"), "--layers", "2")


@pytest.fixture(scope="session")
def hybrid_kit(tmp_path_factory) -> Path:
    """Tiny Qwen3.5 text model: three gated-delta layers, one full-attention layer."""
    return _make_kit(tmp_path_factory.mktemp("hybrid_kit"), "--layers", "4", "--arch", "qwen3_5")


def run_train(args: list[str], *, nproc: int = 1, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run train.py as users do: plain python for one process, torchrun for several."""
    if nproc == 1:
        cmd = [sys.executable, "train.py", *args]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            "train.py",
            *args,
        ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"train.py failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


@contextlib.contextmanager
def in_process_trainer(args: list[str]):
    """A `train.trainer.Trainer` built in this process from train.py's argv (a one-rank gloo group, torn
    down after, with the environment variables it set)."""
    import torch.distributed as dist

    from train.cli import parse_args
    from train.config import JobConfig
    from train.trainer import Trainer

    env = dict(os.environ)
    try:
        yield Trainer(JobConfig.from_args(parse_args(args)))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(env)


def train_py_error(args: list[str], capfd, status: int | None = None) -> list[str]:
    """train.py's main() in this process, on argv that must stop with its one-line error; returns the lines
    of stderr as `python train.py` would print them (the process's own output, then its error line).

    What it saves is a fresh interpreter and its torch import (about 4 CPU seconds a run). A success would end
    in main()'s os._exit and take pytest down with status 0 and no summary (a regression that passed CI
    unseen): os._exit raises SystemExit here instead, which fails the test. Process group and environment are
    restored.
    `status`: the exit status it must end with (2 for a bad flag, 1 for what stops a started run).
    """
    import torch.distributed as dist

    from train.main import main

    env = dict(os.environ)

    def exit_here(code):
        raise SystemExit(code)

    try:
        with pytest.raises(SystemExit) as stopped, pytest.MonkeyPatch.context() as patch:
            patch.setattr(os, "_exit", exit_here)
            main(args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(env)
    code = stopped.value.code
    assert code not in (None, 0), "train.py did not fail"
    if status is not None:
        assert code == status, f"exit status {code}, not {status}"
    err = capfd.readouterr().err
    return (err + (f"{code}\n" if isinstance(code, str) else "")).splitlines()


def read_metrics(run: Path) -> dict[int, dict]:
    """metrics.jsonl of a run directory, keyed by step."""
    return {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


@contextlib.contextmanager
def serve_app(app):
    """Any ASGI app on a free localhost port, in a thread; yields its base URL."""
    import socket
    import threading
    import time

    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    for _ in range(200):
        if srv.started:
            break
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        thread.join(timeout=10)


@contextlib.contextmanager
def native_server(checkpoint, *, api_key=None, mode="self-spec", max_tokens=16):
    """The OpenAI-compatible server for a checkpoint; yields (base_url, app)."""
    from bdcore.loading import load_checkpoint
    from inference.native.engine import DecodeConfig
    from inference.server import create_app

    app = create_app(
        load_checkpoint(checkpoint),
        DecodeConfig(mode=mode),
        model_name="tiny",
        api_key=api_key,
        default_max_tokens=max_tokens,
    )
    with serve_app(app) as url:
        yield url, app


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def live_engine(cmd: list[str], env: dict, log: Path, url: str, *, name: str, deadline_s: float):
    """A live engine's server (`cmd`, e.g. serve.py on SGLang or vLLM) in its own process group, its output in
    `log`; yields once `url`/models answers, fails the test with the log's tail if it exits or `deadline_s`
    passes first, and stops the whole group afterwards."""
    import signal
    import time
    import urllib.request

    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + deadline_s
        while True:
            try:
                urllib.request.urlopen(f"{url}/models", timeout=2)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"{name} did not come up (status {proc.poll()}): {log.read_text()[-3000:]}")
                time.sleep(2)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
