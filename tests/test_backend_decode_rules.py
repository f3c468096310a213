"""The decode modes are written once (issue 42, item 4): the SGLang and vLLM backends adapt bdcore's decoders.

Two checks. Over the source (ast, no imports run): no module of `inference/sglang_backend/` or
`inference/vllm_backend/` imports a decode rule or the sampler's token path, or defines a function of those
names; they reach them only through `bdcore.decode.modes`. By behaviour: with the shared decoder's rules
replaced by spies, the SGLang algorithms' commits and acceptances are exactly the spies' calls.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from bdcore.decode import modes
from bdcore.decode.sampling import SamplingParams
from bdcore.loading import load_checkpoint
from inference.sglang_backend.algorithms import SelfSpec, ShiftedDiffusion
from inference.sglang_backend.settings import DIFFUSION, SELF_SPEC
from tests.sglang_emulator import EmulatedModelRunner, emulated, serve
from tests.test_invariant_4_self_spec import _prompts
from tests.test_sglang_algorithms import _settings
from tests.tiny import tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]
BACKENDS = ("inference/sglang_backend", "inference/vllm_backend")
# What makes a decode mode: the commit rule and denoise step, acceptance, stops, and the logits -> token path.
RULES = {
    "commit_slots",
    "denoise_step",
    "block_decided",
    "greedy_accept",
    "speculative_accept",
    "first_stop",
    "pick",
    "probabilities",
    "draw",
    "greedy_tokens",
}
# A backend's token sink ends a round at the first stop token: the shared rule, called from its sink.
SINK_MAY_CALL = {("inference/sglang_backend/requests.py", "first_stop")}


def rule_uses(path: str, source: str) -> list[str]:
    """The decode rules `source` (the module at `path`) imports or defines itself."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("bdcore.decode"):
            names = [a.name for a in node.names if a.name in RULES and (path, a.name) not in SINK_MAY_CALL]
            found += [f"imports {name}" for name in names]
        elif isinstance(node, ast.Import):
            found += [f"imports {a.name}" for a in node.names if a.name == "bdcore.decode.rules"]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.lstrip("_") in RULES:
            found.append(f"defines {node.name}")
    return found


def test_backends_write_no_decode_rule():
    bad = []
    for backend in BACKENDS:
        for path in sorted((ROOT / backend).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            bad += [f"{rel}: {f}" for f in rule_uses(rel, path.read_text(encoding="utf-8"))]
    assert not bad, "a backend writes a decode mode again instead of adapting bdcore.decode.modes:\n" + "\n".join(bad)


@pytest.mark.parametrize(
    "source",
    [
        "from bdcore.decode.rules import denoise_step\n",
        "from bdcore.decode.rules import greedy_accept, first_stop\n",
        "from bdcore.decode.rules import first_stop\n",
        "from bdcore.decode.sampling import SamplingParams, pick\n",
        "def _denoise_step(canvas):\n    pass\n",
        "class A:\n    def speculative_accept(self):\n        pass\n",
        "import bdcore.decode.rules\n",
    ],
)
def test_a_rule_written_again_is_reported(source):
    assert rule_uses("inference/sglang_backend/algorithms.py", source)


def test_allowed_uses_pass():
    assert not rule_uses("inference/sglang_backend/requests.py", "from bdcore.decode.rules import first_stop\n")
    assert not rule_uses("x.py", "from bdcore.decode.sampling import SamplingParams, ban\nimport bdcore.decode.modes\n")


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return load_checkpoint(tiny_checkpoint(tmp_path_factory.mktemp("rules"), bd_size=4))


def _spy(monkeypatch, name: str) -> list:
    calls, real = [], getattr(modes, name)

    def spy(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(modes, name, spy)
    return calls


def test_sglang_diffusion_commits_through_the_shared_denoise_step(loaded, monkeypatch):
    calls = _spy(monkeypatch, "denoise_step")
    runner = EmulatedModelRunner(loaded)
    prompts = _prompts(loaded.tokenizer, 3, seed=3)
    algo = emulated(ShiftedDiffusion)(_settings(loaded, DIFFUSION, threshold=0.5))
    serve(loaded, algo, prompts, [SamplingParams(max_tokens=12)] * 3, max_running_requests=1, runner=runner)
    canvas_forwards = sum(1 for mode, _ in runner.modes if mode == "DLLM_EXTEND")
    assert canvas_forwards and len(calls) == canvas_forwards, "one shared denoise step per canvas forward"


def test_sglang_self_spec_accepts_through_the_shared_rule(loaded, monkeypatch):
    calls = _spy(monkeypatch, "greedy_accept")
    runner = EmulatedModelRunner(loaded)
    prompts = _prompts(loaded.tokenizer, 3, seed=3)
    algo = emulated(SelfSpec)(_settings(loaded, SELF_SPEC))
    serve(loaded, algo, prompts, [SamplingParams(max_tokens=12)] * 3, runner=runner)
    verifies = sum(1 for mode, bi in runner.modes if mode == "DLLM_EXTEND" and not bi)
    assert verifies and len(calls) == verifies, "one shared acceptance per verify forward"
