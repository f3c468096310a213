"""A request's memory is bounded before it is allocated (bdcore/decode/memory.py): the floor against what a real
cache holds, the process's room under an address-space limit, a checkpoint whose smallest request cannot fit
refused at start, and a request that cannot fit refused as a 400 naming what to change."""

import json
import subprocess
import sys

import pytest
import torch

from bdcore.decode.memory import RequestFloor
from tests.conftest import REPO
from tests.test_serve_cli import _refused_at_start
from tests.test_server_hardening import call, running
from tests.tiny import tiny_checkpoint, tiny_hybrid_model, tiny_model


def _cache_bytes(cache) -> int:
    tensors = []
    for layer in getattr(cache, "layers", []):
        tensors += [t for t in vars(layer).values() if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kv_floor_per_token_is_what_a_real_cache_holds_per_token(arch, dtype):
    """The floor's KV bytes per token equal a real cache's growth per token (a hybrid's gated-delta state is
    per request, not per token: only its full-attention layers grow)."""
    model = (tiny_hybrid_model() if arch == "qwen3_5" else tiny_model()).to(dtype)
    held = []
    for n in (6, 12):
        with torch.inference_mode():
            out = model(input_ids=torch.randint(0, 90, (1, n)), use_cache=True)
        held.append(_cache_bytes(out.past_key_values))
    assert held[0] > 0
    assert RequestFloor.of(model.config, dtype).kv_per_token == (held[1] - held[0]) // 6


def test_the_room_left_under_an_address_space_limit_is_what_the_process_can_get():
    """`prlimit --as`: the room is the limit less what the process already maps, not the machine's memory."""
    code = (
        "import resource\n"
        "from bdcore.decode.memory import available_bytes, _read_kib\n"
        "used = _read_kib('/proc/self/status', 'VmSize:')\n"
        "resource.setrlimit(resource.RLIMIT_AS, (used + (300 << 20), resource.RLIM_INFINITY))\n"
        "print(available_bytes())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert 0 < int(out.stdout) <= 300 << 20, out.stdout


def _huge_context(ckpt, bd_size: int):
    """A checkpoint whose config claims a context of 2 * 10**9 positions, so that no context check stops it."""
    for name, field, value in (
        ("block_diffusion.json", "bd_size", bd_size),
        ("config.json", "max_position_embeddings", 2 * 10**9),
    ):
        path = ckpt / name
        path.write_text(json.dumps({**json.loads(path.read_text()), field: value}))
    return ckpt


@pytest.mark.parametrize("mode", ["causal", "diffusion", "self-spec"])
def test_a_block_no_request_can_hold_is_refused_at_start_in_one_line(monkeypatch, tmp_path, mode):
    """A sidecar block of 10**9 under a context of 2 * 10**9 started; a diffusion request got a MemoryError 500
    and a self-spec one grew to 3 GB after its client left."""
    ckpt = _huge_context(tiny_checkpoint(tmp_path / "ckpt"), 10**9)
    line = _refused_at_start(monkeypatch, [str(ckpt), "--mode", mode, "--backend", "native", "--device", "cpu"])
    assert "a one-token request needs at least" in line and "more than the" in line, line
    assert ("which a request may pick" in line) == (mode == "causal"), line


@pytest.mark.e2e
def test_a_request_that_cannot_fit_is_a_400_naming_what_to_change(tmp_path):
    """A reply of 10**9 tokens passes the context check of a model claiming 2 * 10**9 positions; its KV cache
    alone is tens of GiB: refused before any forward, naming max_tokens. Settings of the same request that fit
    are served."""
    ckpt = _huge_context(tiny_checkpoint(tmp_path / "ckpt"), 4)
    body = {"model": "tiny", "prompt": "abc", "mode": "diffusion"}
    with running(ckpt) as (url, _app, _loaded):
        status, text = call(url, "/v1/completions", {**body, "max_tokens": 10**9}, key=None)
        assert status == 400, text
        error = json.loads(text)["error"]
        assert error["param"] == "max_tokens" and error["code"] == "request_too_large", error
        assert "ask for fewer max_tokens" in error["message"], error
        status, text = call(url, "/v1/completions", {**body, "max_tokens": 4}, key=None)
        assert status == 200, text
