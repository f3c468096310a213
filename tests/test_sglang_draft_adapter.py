"""Draft-adapter checkpoints on our SGLang algorithms, on CPU (no SGLang needed): the command serve.py builds,
the adapters SGLang's loader would not load as trained, the per-token routing the algorithms hand SGLang's LoRA
manager (canvas rows the adapter, every other row none), and decodes under the emulated SGLang
(tests/sglang_emulator.py) against the native engine: diffusion greedy and sampled token for token, self-spec
greedy the base model's causal output and sampled the base model's AR law. The same routing through SGLang's own
loader and token-segment code is `make sglang-contract`'s (tests/contracts/sglang/lora.py)."""

from collections import Counter
from dataclasses import replace

import pytest
import yaml

from bdcore.decode.sampling import SamplingParams
from bdcore.draft_adapter_files import DraftAdapterError
from bdcore.loading import load_checkpoint
from inference import serve as serve_cli
from inference.native.engine import DecodeConfig, Engine
from inference.sglang_backend import command as sc
from inference.sglang_backend.algorithms import SelfSpec, ShiftedDiffusion
from inference.sglang_backend.draft_adapter import check_adapter, token_segments
from inference.sglang_backend.draft_lora import DraftLoRA
from inference.sglang_backend.plugin import PluginError, load_settings
from inference.sglang_backend.requests import request_seed
from inference.sglang_backend.settings import DIFFUSION, SELF_SPEC
from tests.sglang_emulator import EmulatedModelRunner, emulated, serve
from tests.test_draft_adapter import draft_checkpoint
from tests.test_invariant_4_self_spec import _prompts, ar_law_case, total_variation
from tests.tiny import tiny_checkpoint
from tests.vllm_emulator import vllm_view

pytestmark = pytest.mark.e2e  # decodes under the emulator

GREEDY = SamplingParams(max_tokens=16)
SAMPLED = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, max_tokens=16)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return draft_checkpoint(tmp_path_factory.mktemp("sgl-drafted") / "c", "qwen3")


@pytest.fixture(scope="module")
def models(ckpt, tmp_path_factory):
    """(the native engine's checkpoint, the checkpoint as the plugin serves it, its base model alone). Both plugins
    read and attach the trained `<|mask|>` row alike (`bdcore.draft_adapter_files.load_mask_row`, `attach_mask_row`),
    so the vLLM tests' view of the served model is SGLang's too."""
    native = load_checkpoint(ckpt, draft_energy=1.0)  # SGLang's loader serves the adapter uncut
    served = replace(load_checkpoint(ckpt, draft_energy=1.0), model=vllm_view(ckpt, native.mask_id))
    base = load_checkpoint(tiny_checkpoint(tmp_path_factory.mktemp("sgl-base"), arch="qwen3", bd_size=4))
    return native, served, base  # draft_checkpoint's base is tiny_checkpoint's, the adapter beside it


def settings(ckpt, mode, **kw):
    return sc.bdstack_settings(ckpt, mode, **kw)


@pytest.mark.parametrize("mode", ["diffusion", "self-spec"])
def test_serve_builds_the_launcher_command_for_a_draft_adapter(ckpt, mode, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    assert serve_cli.main([str(ckpt), "--backend", "sglang", "--mode", mode, "--dry-run"]) == 0
    argv = capsys.readouterr().out.split()
    assert argv[1:3] == ["-m", "inference.sglang_backend.launch"]
    assert "--enable-lora" not in argv, "SGLang's dLLM path turns it off; the plugin builds its own LoRA manager"
    written = yaml.safe_load(open(argv[argv.index("--dllm-algorithm-config") + 1]).read())
    assert written["draft_adapter"] == "draft_adapter" and written["algorithm"] in (DIFFUSION, SELF_SPEC)
    path = argv[argv.index("--dllm-algorithm-config") + 1]
    assert load_settings(str(ckpt), written["algorithm"], path).draft_adapter == "draft_adapter"
    with open(path, "w") as f:  # a hand-written config that drops the adapter would draft with the base model
        yaml.safe_dump({**written, "draft_adapter": None}, f)
    with pytest.raises(PluginError, match="draft_adapter disagrees with the checkpoint's sidecar"):
        load_settings(str(ckpt), written["algorithm"], path)


def test_adapters_sglang_would_load_otherwise_are_refused(ckpt, tmp_path):
    import json
    import shutil

    good = json.loads((ckpt / "draft_adapter" / "adapter_config.json").read_text())
    assert check_adapter(ckpt / "draft_adapter")["r"] == 4
    cases = [
        ({"target_modules": ["model.layers.0.mlp.gate"]}, r"adapts \['gate'\]; SGLang's LoRA wraps"),
        ({"target_modules": ["model.layers.0.self_attn.q_proj"]}, r"without \['v_proj'\]; .* into qkv_proj"),
        ({"target_modules": ["model.layers.0.mlp.up_proj"]}, r"without \['gate_proj'\]; .* gate_up_proj"),
        ({"rank_pattern": {"q_proj": 8}}, "per-module ranks"),
        ({"alpha_pattern": {"q_proj": 8}}, "per-module alphas"),
        ({"use_rslora": True}, "use_rslora; SGLang's LoRA serves plain LoRA only"),
        ({"target_modules": "all-linear"}, "no resolved target modules"),
        ({"target_modules": ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj"]}, None),
    ]
    for change, says in cases:
        bad = tmp_path / "a"
        shutil.rmtree(bad, ignore_errors=True)
        shutil.copytree(ckpt / "draft_adapter", bad)
        (bad / "adapter_config.json").write_text(json.dumps({**good, **change}))
        if says is None:  # k alone may be missing: SGLang stacks zeros in its place
            check_adapter(bad)
            continue
        with pytest.raises(DraftAdapterError, match=says):
            check_adapter(bad)


def test_token_segments_are_runs_of_rows():
    assert token_segments([False, True, True, False, False, True], "d") == ([None, "d", None, "d"], [1, 2, 2, 1])
    assert token_segments([False] * 3, "d") == ([None], [3])

    class Recording:
        calls: list = []

        def prepare_lora_token_segments(self, *, lora_ids, segment_lens):
            self.calls.append((lora_ids, segment_lens))

        def reset_lora_batch(self):
            self.calls.append("reset")

    router = DraftLoRA(Recording(), "d")
    router.route([True, True, False])
    router.reset()
    assert Recording.calls == [(["d", None], [2, 1]), "reset"]


@pytest.mark.parametrize("cls", [ShiftedDiffusion, SelfSpec])
def test_every_forward_routes_the_adapter_to_canvas_rows_only(ckpt, models, cls):
    """Three requests, two at a time: context passes run without LoRA batch info (the base model); a diffusion
    denoise forward or a self-spec drafting forward (the seeded canvas) takes the adapter at every canvas row of
    the requests it plans, requests riding along at none; a self-spec verify forward, with no row drafting, runs
    without LoRA batch info at all."""
    _, served, _ = models
    s = settings(ckpt, "diffusion" if cls is ShiftedDiffusion else "self-spec", threshold=0.1)
    runner = EmulatedModelRunner(served)
    prompts = _prompts(served.tokenizer, 3, seed=3)
    params = [SamplingParams(max_tokens=m) for m in (14, 5, 14)]
    serve(served, emulated(cls)(s), prompts, params, max_running_requests=2, runner=runner)
    B, canvas = s.block_size, []
    for mode, routing in runner.routed:
        if mode == "EXTEND":
            assert routing is None, "a context pass runs the base weights"
            continue
        if routing is None:  # no row drafts: the forward runs without LoRA batch info (a verify forward)
            canvas.append([False])
            continue
        assert any(routing), "a forward with no drafting row installs no routing"
        per_request = [routing[i : i + B] for i in range(0, len(routing), B)]
        assert all(set(r) <= {True} or set(r) <= {False} for r in per_request), "a canvas takes it at every row"
        canvas.append([all(r) for r in per_request])
    assert any(any(c) for c in canvas), "the adapter is routed"
    if cls is SelfSpec:  # rounds: a drafting forward, then a verify forward that takes the adapter nowhere
        assert all(not any(c) for c in canvas[1::2]) and all(any(c) for c in canvas[0::2])
    else:
        assert any(not all(c) for c in canvas), "a request riding along a denoise forward takes no adapter"


@pytest.mark.parametrize("threshold", [0.05, 0.5])
def test_diffusion_equals_the_native_engine_with_the_adapter(ckpt, models, threshold):
    native, served, base = models
    s = settings(ckpt, "diffusion", threshold=threshold)
    prompts = _prompts(served.tokenizer, 4, seed=7)
    engine = Engine(native, DecodeConfig(mode="diffusion", threshold=threshold, fuse_commit=False))
    for params in (GREEDY, SAMPLED):
        rids = [f"draft-{threshold}-{params.greedy}-{i}" for i in range(len(prompts))]
        algo = emulated(ShiftedDiffusion)(s)
        batched, _ = serve(served, algo, prompts, [params] * 4, max_running_requests=3, rids=rids)
        one_by_one, forwards = serve(served, algo, prompts, [params] * 4, rids=[f"{r}-again" for r in rids])
        refs = [engine.generate(p, replace(params, seed=request_seed(r))) for p, r in zip(prompts, rids)]
        assert batched == [r.tokens for r in refs]
        again = [engine.generate(p, replace(params, seed=request_seed(f"{r}-again"))) for p, r in zip(prompts, rids)]
        assert one_by_one == [r.tokens for r in again] and forwards == sum(r.stats.forwards for r in again)
    plain = Engine(base, DecodeConfig(mode="diffusion", threshold=threshold, fuse_commit=False))
    assert [plain.generate(p, GREEDY).tokens for p in prompts] != serve(
        served, emulated(ShiftedDiffusion)(s), prompts, [GREEDY] * 4
    )[0], "the adapter changes the drafts"


@pytest.mark.parametrize("draft_len", [2, 4])
def test_self_spec_greedy_is_the_base_models_causal_output(ckpt, models, draft_len):
    _, served, base = models
    s = settings(ckpt, "self-spec", draft_len=draft_len)
    prompts = _prompts(served.tokenizer, 5, seed=8)
    params = [SamplingParams(max_tokens=m) for m in (20, 6, 20, 11, 20)]
    got, forwards = serve(served, emulated(SelfSpec)(s), prompts, params, max_running_requests=5)
    causal = Engine(base, DecodeConfig(mode="causal"))
    want = [causal.generate(p, q).tokens for p, q in zip(prompts, params)]
    assert got == want
    if draft_len > 2:
        assert forwards < sum(len(w) + 1 for w in want), "drafts are accepted"


def test_sampled_self_spec_follows_the_base_models_ar_law(ckpt, models):
    """Rejection sampling against the drafts the adapter proposes: the joint law of 4 sampled tokens (top-k 2) is
    the base model's exact AR law (enumerated on the native model's clean rows, which run the base weights)."""
    native, served, _ = models
    ids, params, exact = ar_law_case(native)
    n = 1200
    got, _ = serve(
        served,
        emulated(SelfSpec)(settings(ckpt, "self-spec")),
        [ids] * n,
        [SamplingParams(**params)] * n,
        max_running_requests=64,
    )
    tv = total_variation(Counter(tuple(g) for g in got), exact)
    assert tv < 0.08, tv
