"""`serve.py --backend sglang` on a live SGLang: SGLang 0.5.23's own CPU engine (`make sglang-cpu`:
`.venv-sglang-live`, over torch 2.13.0+cpu with its stand-ins) serving a bdstack checkpoint in all three modes,
held to our native engine.

A tiny Qwen3 from the demo kit, converted for 500 steps with 8-slot blocks: its greedy answers follow the prompts,
its diffusion answers differ from its causal ones, and from those of the same diffusion attending its canvases
causally (the native engine told the canvas is causal), on some prompts each (asserted: at 300 steps with 4-slot
blocks a causal canvas changed no answer, and the diffusion check could not see the mask it exists for).
Served through `serve.py --backend sglang --device cpu` (SGLang's CPU engine: its environment variable,
`--device cpu --attention-backend torch_native`), fp32 after `--` (a tiny model's greedy margins are small), the
prompts sent together so SGLang batches them.
Checked over the OpenAI API, greedy, token for token as text:
- causal (stock SGLang) == the native engine's causal answers;
- diffusion (our BdstackDiffusion, its canvases through the plugin's torch_native extend,
  `inference/sglang_backend/canvas_attention.py`) == the native engine's `--no-fuse-commit` diffusion, the
  decode SGLang's one-attention-kind-per-forward allows (inference/sglang_backend/README.md);
- self-spec (our BdstackSelfSpec) == the native engine's causal answers (lossless);
- another attention backend on the CPU engine is refused in one line at start.
Skipped where `.venv-sglang-live` was not built; about 2.5 minutes on 2 cores (three SGLang starts of ~35 s).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.conftest import free_port, live_engine, run_train

REPO = Path(__file__).resolve().parents[1]
SGLANG_VENV = Path(os.environ.get("SGLANG_CPU_VENV", REPO / ".venv-sglang-live"))
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        not (SGLANG_VENV / ".sglang-cpu-installed").is_file(),
        reason="no live SGLang here: `make sglang-cpu` builds it",
    ),
]
MAX_TOKENS = 24
PROMPTS = 10
# SGLang's own flags after serve.py's --device cpu: fp32, the KV budget bounded (else 15 GB)
CPU_ENGINE = ["--dtype", "float32", "--max-total-tokens", "65536"]


@pytest.fixture(scope="module")
def checkpoint(demo_kit, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("sglang_live") / "run"
    args = ["--model_id", str(demo_kit / "base_model"), "--dataset", str(demo_kit / "train.jsonl"), "--bd_size", "8"]
    args += ["--ar_loss_weight", "0.5", "--pack", "--max_length", "512", "--max_steps", "500", "--lr", "3e-3"]
    run_train([*args, "--save_dir", str(run)])
    return run / "final"


def _command(checkpoint, mode: str, port: int, engine: list[str]) -> list[str]:
    cmd = [sys.executable, str(REPO / "inference" / "serve.py"), str(checkpoint), "--mode", mode]
    cmd += ["--backend", "sglang", "--sglang-python", str(SGLANG_VENV / "bin" / "python"), "--port", str(port)]
    return [*cmd, "--device", "cpu", "--", *engine]


def _environment() -> dict:
    # the stand-ins for sgl_kernel and torchvision (build_venv.sh); one thread each, as the suite runs
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SGLANG_VENV / "stubs"), env.get("PYTHONPATH")) if p)
    return env


@contextlib.contextmanager
def _serving(checkpoint, mode: str, log: Path):
    """serve.py --backend sglang on `checkpoint` in `mode` on the CPU engine, in its own process group; yields
    its base URL."""
    port = free_port()
    cmd = _command(checkpoint, mode, port, CPU_ENGINE)
    with live_engine(cmd, _environment(), log, f"http://127.0.0.1:{port}/v1", name="SGLang", deadline_s=600) as url:
        yield url


def _prompts(demo_kit) -> list[list[dict]]:
    lines = (demo_kit / "eval.jsonl").read_text().splitlines()[:PROMPTS]
    return [json.loads(line)["messages"][:1] for line in lines]


def _causal_canvas_twin(checkpoint, out: Path) -> Path:
    """The checkpoint with a sidecar saying its canvas is causal: the native engine then attends canvases as a
    torch_native extend without our rule would (and SGLang's gate would refuse it, so it is never served)."""
    shutil.copytree(checkpoint, out)
    sidecar = json.loads((out / "block_diffusion.json").read_text())
    (out / "block_diffusion.json").write_text(json.dumps(sidecar | {"within_block_causal": True}))
    return out


@pytest.fixture(scope="module")
def native(checkpoint, demo_kit, tmp_path_factory) -> dict[str, list[str]]:
    """The native engine's greedy fp32 answers: causal, diffusion unfused (SGLang's decode of it), and that
    diffusion with causal canvases."""
    from transformers import AutoTokenizer

    from bdcore.decode.config import DecodeConfig
    from bdcore.decode.sampling import SamplingParams
    from bdcore.loading import load_checkpoint, serving_dtype
    from inference.native.engine import Engine

    tok = AutoTokenizer.from_pretrained(checkpoint)
    loaded = load_checkpoint(checkpoint, dtype=serving_dtype("fp32", "cpu"))
    ids = [
        list(tok.apply_chat_template(m, add_generation_prompt=True, return_dict=True)["input_ids"])
        for m in _prompts(demo_kit)
    ]
    out = {}
    twin_dir = _causal_canvas_twin(checkpoint, tmp_path_factory.mktemp("twin") / "c")
    twin = load_checkpoint(twin_dir, dtype=serving_dtype("fp32", "cpu"))
    # diffusion unfused: one attention kind per SGLang forward, so a block's commit is its own forward there
    unfused = DecodeConfig("diffusion", fuse_commit=False)
    for name, model, config in [
        ("causal", loaded, DecodeConfig(mode="causal")),
        ("diffusion", loaded, unfused),
        ("causal canvas", twin, unfused),
    ]:
        engine = Engine(model, config)
        out[name] = [engine.generate(p, SamplingParams(max_tokens=MAX_TOKENS)).text for p in ids]
    return out


def test_the_checkpoint_tells_the_modes_apart(native):
    """Equality below means something: answers follow the prompts, and diffusion is not causal here."""
    assert len(set(native["causal"])) > PROMPTS // 2, native["causal"]
    assert native["diffusion"] != native["causal"], "diffusion equals causal on every prompt: no canvas test"
    assert native["diffusion"] != native["causal canvas"], "a causal canvas changes no answer: the mask is untested"


@pytest.mark.parametrize(("mode", "want"), [("causal", "causal"), ("diffusion", "diffusion"), ("self-spec", "causal")])
def test_greedy_answers_equal_the_native_engines(mode, want, checkpoint, demo_kit, native, tmp_path):
    from openai import OpenAI

    with _serving(checkpoint, mode, tmp_path / "serve.log") as url:
        client = OpenAI(base_url=url, api_key="none")
        model = client.models.list().data[0].id

        def ask(messages):
            reply = client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
            return reply.choices[0].message.content

        with ThreadPoolExecutor(4) as pool:  # together: SGLang batches their forwards (--max-running-requests 8)
            got = list(pool.map(ask, _prompts(demo_kit)))
    same = sum(a == b for a, b in zip(got, native[want]))
    assert got == native[want], f"{mode}: {same}/{PROMPTS} equal the native {want} answers\n{got}\n{native[want]}"


def test_another_attention_backend_on_the_cpu_engine_is_refused_in_one_line(checkpoint, tmp_path):
    """Any CPU attention but ours would not give a canvas its mask (Triton's needs a GPU; SGLang's own torch_native
    attends it causally): the plugin stops the start in one line, before a scheduler runs. (intel_amx is not the
    example: on a CPU without AMX SGLang itself falls back to torch_native, which is then ours.)"""
    engine = [*CPU_ENGINE, "--attention-backend", "triton"]  # after serve.py's: SGLang takes the last
    cmd = _command(checkpoint, "diffusion", free_port(), engine)
    out = subprocess.run(cmd, env=_environment(), capture_output=True, text=True, timeout=300, start_new_session=True)
    assert out.returncode != 0
    lines = [line for line in out.stderr.splitlines() if "error" in line.lower()]
    assert lines and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert "need --attention-backend torch_native" in lines[-1] and "got --attention-backend triton" in lines[-1]
