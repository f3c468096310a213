"""The serving gate (bdcore/serving_gate.py): which backend serves which mode on which checkpoint, with which
settings, and what it says when it does not.

The table is written out by hand from docs/design.md (sections 5, 6, 8.11, 8.13, 8.14), not derived from the
gate: the native engine decodes causal everywhere it decodes at all, diffusion on block-diffusion checkpoints
and self-spec where a token-causal AR head verifies drafts; SGLang and vLLM serve causal on anything (their
stock engine) and our decodes only on shifted, causal-clean checkpoints, draft adapters included (each
engine's LoRA routed per token), SGLang hybrids only with a within-block-causal canvas and without a draft
adapter, vLLM no hybrid and only the architectures its plugin extends.
That each backend's entry point asks the gate (and nothing else) is tests/test_serving_gate_entry_points.py.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from bdcore.capabilities import MODES, Capabilities
from bdcore.decode.config import DecodeConfig
from bdcore.decode.tree import TreeShape
from bdcore.serving_gate import BACKENDS, VLLM_ARCHITECTURES, CannotServe, resolve, served_modes, serves
from bdcore.sidecar import Sidecar

QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "max_position_embeddings": 1024}
LLAMA = {"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 1024}
HYBRID = {"architectures": ["Qwen3_5ForCausalLM"], "layer_types": ["linear_attention", "full_attention"]}


def sidecar(**kw) -> Sidecar:
    return Sidecar(bd_size=4, mask_id=7, **kw)


# kind -> (sidecar, config.json)
CHECKPOINTS = {
    "plain": (None, QWEN3),
    "dense": (sidecar(), QWEN3),
    "dense, within-block-causal canvas": (sidecar(within_block_causal=True), QWEN3),
    "dense, block-causal clean stream": (sidecar(clean_causal=False, ar_loss_weight=0.0), QWEN3),
    "unshifted": (sidecar(shift=False, clean_causal=False, views=1), QWEN3),
    "unshifted with a causal clean stream": (sidecar(shift=False), QWEN3),  # no training run writes it
    "draft adapter": (sidecar(draft_adapter="draft_adapter"), QWEN3),
    "hybrid": (sidecar(), HYBRID),
    "hybrid, within-block-causal canvas": (sidecar(within_block_causal=True), HYBRID),
    "hybrid draft adapter, within-block-causal canvas": (
        sidecar(within_block_causal=True, draft_adapter="draft_adapter"),
        HYBRID,
    ),
    "hybrid, block-causal clean stream": (sidecar(clean_causal=False), HYBRID),
    "unshifted hybrid": (sidecar(shift=False, clean_causal=False, views=1), HYBRID),
    "dense, another architecture": (sidecar(), LLAMA),
}
C, D, S = "causal", "diffusion", "self-spec"
# kind -> the modes each backend serves: native, sglang, vllm
TABLE = {
    "plain": ((C,), (C,), (C,)),
    "dense": ((C, D, S), (C, D, S), (C, D, S)),
    "dense, within-block-causal canvas": ((C, D, S), (C, D, S), (C, D, S)),
    "dense, block-causal clean stream": ((C, D), (C,), (C,)),
    "unshifted": ((C, D), (C,), (C,)),
    "unshifted with a causal clean stream": ((), (C,), (C,)),
    "draft adapter": ((C, D, S), (C, D, S), (C, D, S)),
    "hybrid": ((C, D, S), (C,), (C,)),
    "hybrid, within-block-causal canvas": ((C, D, S), (C, D, S), (C,)),
    "hybrid draft adapter, within-block-causal canvas": ((C, D, S), (C,), (C,)),
    "hybrid, block-causal clean stream": ((C, D), (C,), (C,)),
    "unshifted hybrid": ((), (C,), (C,)),
    "dense, another architecture": ((C, D, S), (C, D, S), (C,)),
}


def caps_of(kind: str) -> Capabilities:
    return Capabilities.from_sidecar(*CHECKPOINTS[kind])


@pytest.mark.parametrize("kind", TABLE)
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_table(kind, backend):
    want = TABLE[kind][BACKENDS.index(backend)]
    caps = caps_of(kind)
    assert served_modes(caps, backend) == want
    for mode in MODES:
        assert serves(caps, DecodeConfig(mode=mode), backend) == (mode in want), (kind, backend, mode)
        if mode not in want:
            with pytest.raises(CannotServe) as refused:
                resolve(caps, DecodeConfig(mode=mode), backend)
            assert refused.value.setting == "mode"


@pytest.mark.parametrize(
    ("kind", "backend", "mode", "says"),
    [
        ("plain", "native", D, "plain AR model: serve it with --mode causal, or convert it with train.py"),
        ("unshifted", "native", S, "unshifted .* has none: serve it with --mode diffusion"),
        ("dense, block-causal clean stream", "native", S, "clean_causal: true .* serve it with --mode diffusion"),
        ("unshifted with a causal clean stream", "native", C, "shift: false with clean_causal: true.*fix the sidecar"),
        ("unshifted hybrid", "native", D, "unshifted .* gated-delta hybrid; train.py writes none"),
        ("plain", "sglang", D, "no block_diffusion.json: it is not a bdstack .* serve it with --mode causal"),
        (
            "hybrid draft adapter, within-block-causal canvas",
            "sglang",
            S,
            "draft adapter on a hybrid .* fused input projection, which bypasses LoRA.* --backend native",
        ),
        ("dense, block-causal clean stream", "vllm", D, "clean_causal: false need --backend native"),
        ("unshifted with a causal clean stream", "sglang", D, r"unshifted \(shift: false\).*--backend native"),
        ("hybrid", "sglang", D, "bidirectional canvas .* --backend native .*--within_block_causal are served"),
        ("hybrid, within-block-causal canvas", "vllm", S, "hybrid .* vLLM plugin .* use --backend native"),
        ("dense, another architecture", "vllm", D, r"extends \['Qwen3ForCausalLM'\]; .* 'LlamaForCausalLM': use"),
    ],
)
def test_each_refusal_names_the_problem_and_the_fix(kind, backend, mode, says):
    with pytest.raises(CannotServe, match=says):
        resolve(caps_of(kind), DecodeConfig(mode=mode), backend)


def test_unknown_modes_and_backends():
    with pytest.raises(CannotServe, match="unknown mode 'fast'"):
        resolve(caps_of("dense"), DecodeConfig(mode="fast"), "native")
    with pytest.raises(CannotServe, match="unknown backend 'x'") as refused:
        resolve(caps_of("dense"), DecodeConfig(), "x")
    assert refused.value.setting == "backend"


def test_vllm_judges_the_architecture_only_where_the_config_was_read():
    assert serves(Capabilities.from_sidecar(sidecar()), DecodeConfig(mode=D), "vllm")  # the sampler's case
    with pytest.raises(CannotServe, match="this checkpoint is None"):  # config.json names no architecture
        resolve(Capabilities.from_sidecar(sidecar(), {}), DecodeConfig(mode=D), "vllm")


def test_vllm_architectures_are_the_plugins():
    from inference.vllm_backend.command import ARCHITECTURES

    assert set(ARCHITECTURES) == VLLM_ARCHITECTURES


def test_defaults_come_from_the_trained_block():
    r = resolve(caps_of("dense"), DecodeConfig(mode=S), "native")
    assert (r.draft_len, r.block, r.budget, r.canvases, r.auto_draft_len) == (4, 4, 3, "last", False)
    assert resolve(caps_of("unshifted"), DecodeConfig(mode=D), "native").budget == 4  # every slot is predicted
    auto = resolve(caps_of("dense"), DecodeConfig(mode=S, draft_len="auto"), "native")
    assert auto.draft_len == 4 and auto.auto_draft_len
    assert resolve(caps_of("plain"), DecodeConfig(), "native").block == 1  # causal: no canvas


@pytest.mark.parametrize(
    ("settings", "setting", "says"),
    [
        (
            DecodeConfig(mode=S, draft_len=5),
            "draft_len",
            "draft_len 5 exceeds the trained block size 4; give at most 4",
        ),
        (
            DecodeConfig(mode=D, block_size=1025),
            "block_size",
            "block_size 1025 exceeds the model's context length 1024",
        ),
        (DecodeConfig(mode=D, block_size=1), "block_size", "block_size and draft_len must be >= 2"),
        (DecodeConfig(mode=D, steps=0), "steps", "steps must be >= 1, got 0"),
        (DecodeConfig(mode=C, threshold=-1.0), "threshold", "threshold must be a number >= 0"),
        (DecodeConfig(mode=C, draft_len="many"), "draft_len", "draft_len must be an integer >= 2 or 'auto'"),
        (DecodeConfig(mode=C, self_spec_canvases="some"), "self_spec_canvases", "self_spec_canvases must be one of"),
        (DecodeConfig(mode=C, tree="5,2"), "tree", r"--tree: tree '5,2': widths lie in 1..4 .*; or off, or auto"),
    ],
)
def test_settings_are_refused_by_name(settings, setting, says):
    with pytest.raises(CannotServe, match=says) as refused:
        resolve(caps_of("dense"), settings, "native")
    assert refused.value.setting == setting


def test_canvases_are_bounded_by_the_model_context():
    """A canvas longer than the context was decoded, and allocated its block_size-squared mask per request
    (a 500 at 100000, a killed server at 10**9); all-canvases self-spec holds draft_len squared rows."""
    caps = Capabilities.from_sidecar(Sidecar(bd_size=40, mask_id=7), {"max_position_embeddings": 1024})
    assert resolve(caps, DecodeConfig(mode=D, block_size=1024), "native").block == 1024
    with pytest.raises(CannotServe, match="draft_len 40: 1600 rows a forward exceed .* at most 32") as refused:
        resolve(caps, DecodeConfig(mode=S, self_spec_canvases="all"), "native")
    assert refused.value.setting == "self_spec_canvases"
    assert resolve(caps, DecodeConfig(mode=S, draft_len=32, self_spec_canvases="all"), "native").draft_len == 32
    assert resolve(caps, DecodeConfig(mode=S, self_spec_canvases="last"), "native").draft_len == 40
    unread = Capabilities.from_sidecar(Sidecar(bd_size=40, mask_id=7))  # no model config: nothing to bound by
    assert resolve(unread, DecodeConfig(mode=D, block_size=10**6), "native").block == 10**6


@pytest.mark.parametrize("backend", ["sglang", "vllm"])
def test_sglang_and_vllm_run_fixed_layouts(backend):
    caps = caps_of("dense")
    with pytest.raises(CannotServe, match="--self-spec-canvases all is a native-engine decode .* --backend native"):
        resolve(caps, DecodeConfig(mode=S, self_spec_canvases="all"), backend)
    with pytest.raises(CannotServe, match="--draft-len auto is a native-engine decode") as refused:
        resolve(caps, DecodeConfig(mode=S, draft_len="auto"), backend)
    assert refused.value.setting == "draft_len"
    with pytest.raises(CannotServe, match="draft_len 5 exceeds the trained block size 4"):
        resolve(caps, DecodeConfig(mode=S, draft_len=5), backend)
    assert resolve(caps, DecodeConfig(mode=S, draft_len=3), backend).draft_len == 3
    # draft trees (issue 44): refused by reason, in the one gate
    for tree in ("auto", "spine:2,2"):
        with pytest.raises(CannotServe, match=f"--tree {tree} is a native-engine decode: .* ancestor mask") as refused:
            resolve(caps, DecodeConfig(mode=S, draft_len=3, tree=tree), backend)
        assert refused.value.setting == "tree"
    assert resolve(caps, DecodeConfig(mode=S, draft_len=3, tree="off"), backend).tree == "off"
    # causal mode is their stock engine on the HF weights: none of our settings reach it
    assert resolve(caps, DecodeConfig(mode=C, self_spec_canvases="all", draft_len="auto"), backend).mode == C


def test_native_draft_trees_resolve():
    caps = caps_of("dense")
    r = resolve(caps, DecodeConfig(mode=S, draft_len="auto", tree="auto"), "native")
    assert r.tree == "auto" and r.auto_draft().trees == "auto" and r.tree_shape is None
    r = resolve(caps, DecodeConfig(mode=S, draft_len=4, tree="spine:2,2"), "native")
    assert r.auto_draft() is None and r.tree_shape == TreeShape((2, 2), spine=True)  # parsed once, at resolve
    assert replace(r, mode=C).tree_shape is None  # the shape follows the settings it was parsed from
    r = resolve(caps, DecodeConfig(mode=S, draft_len="auto", tree="4,2"), "native")
    assert r.auto_draft().trees == r.tree_shape == TreeShape((4, 2))  # the policy is handed the parsed shape
    for tree in ("auto", "2,2"):  # self-spec only
        assert resolve(caps, DecodeConfig(mode=C, tree=tree), "native").tree_shape is None
    fixed = resolve(caps, DecodeConfig(mode=S, draft_len=4, tree="auto"), "native")  # no policy: chains
    assert fixed.auto_draft() is None and fixed.tree_shape is None
