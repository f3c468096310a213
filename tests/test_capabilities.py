"""The capability object (bdcore/capabilities.py): what a checkpoint can run, derived from its sidecar.

Each expectation is written out by hand from docs/design.md (sections 5 and 6), not derived from the
object: a plain AR checkpoint decodes causally only; self-spec needs a token-causal AR head (shifted,
causal clean stream); a draft is at most one trained block; SGLang serves only shifted, causal-clean,
adapter-free checkpoints, and hybrids only with a within-block-causal canvas.
"""

from __future__ import annotations

import pytest

from bdcore.capabilities import BACKENDS, MODES, Capabilities, CapabilityError, register_backend
from bdcore.decode.config import DecodeConfig, DecodeSettingsError
from bdcore.sidecar import Sidecar

DENSE = Sidecar(bd_size=4, mask_id=7)
BLOCK_CAUSAL = Sidecar(bd_size=4, mask_id=7, clean_causal=False)
UNSHIFTED = Sidecar(bd_size=4, mask_id=7, shift=False, clean_causal=False, views=1)
ADAPTER = Sidecar(bd_size=4, mask_id=7, draft_adapter="draft")
LINEAR = ["linear_attention", "full_attention"]


@pytest.mark.parametrize(
    "caps, modes",
    [
        (Capabilities.plain_ar(), ("causal",)),
        (DENSE.capabilities(), ("causal", "diffusion", "self-spec")),
        (BLOCK_CAUSAL.capabilities(), ("causal", "diffusion")),
        (UNSHIFTED.capabilities(), ("causal", "diffusion")),
        (ADAPTER.capabilities(), ("causal", "diffusion", "self-spec")),
    ],
)
def test_native_modes_by_checkpoint(caps, modes):
    assert caps.modes == modes


def test_refusals_name_the_reason_and_the_fix():
    with pytest.raises(CapabilityError, match="plain AR model: serve it with --mode causal"):
        Capabilities.plain_ar().check_mode("diffusion")
    with pytest.raises(CapabilityError, match="unshifted .* serve it with --mode diffusion"):
        UNSHIFTED.capabilities().check_mode("self-spec")
    with pytest.raises(CapabilityError, match="clean_causal: true .* serve it with --mode diffusion"):
        BLOCK_CAUSAL.capabilities().check_mode("self-spec")
    with pytest.raises(ValueError, match="unknown mode 'fast'"):
        DENSE.capabilities().check_mode("fast", ValueError)


def test_sidecar_facts_carry_over():
    caps = Sidecar(bd_size=8, mask_id=3, within_block_causal=True).capabilities(stop_ids=frozenset({1, 2}))
    assert (caps.bd_size, caps.mask_id, caps.stop_ids, caps.max_draft_len) == (8, 3, frozenset({1, 2}), 8)
    assert caps.sequence([5, 6], None, None, None).block_causal is False
    assert BLOCK_CAUSAL.capabilities().sequence([5], None, None, None).block_causal is True
    assert UNSHIFTED.capabilities().sequence([5], None, None, None).shift is False
    assert DENSE.capabilities(mask_id=9).mask_id == 9  # the tokenizer's id, where the loader has it


def test_attention_per_forward():
    assert Capabilities.plain_ar().attention("causal") == {"clean": "causal"}
    assert DENSE.capabilities().attention("diffusion") == {"clean": "causal", "canvas": "bidirectional"}
    within = Sidecar(bd_size=4, mask_id=7, within_block_causal=True).capabilities()
    assert within.attention("self-spec") == {"clean": "causal", "canvas": "causal within the block"}
    assert BLOCK_CAUSAL.capabilities().attention("diffusion")["clean"] == "block-causal"


def test_draft_length_limit_is_the_trained_block():
    caps = DENSE.capabilities()
    assert caps.draft_len_refusal(4) is None
    assert caps.draft_len_refusal(5) == "draft_len 5 exceeds the trained block size 4; give at most 4 (the default)"
    with pytest.raises(DecodeSettingsError, match="draft_len 5 exceeds the trained block size 4"):
        DecodeConfig(mode="self-spec", draft_len=5).resolve(caps)
    assert DecodeConfig(mode="self-spec").resolve(caps).draft_len == 4


def test_canvases_are_bounded_by_the_model_context():
    """A canvas longer than the context was decoded, and allocated its block_size-squared mask per request
    (a 500 at 100000, a killed server at 10**9); all-canvases self-spec holds draft_len squared rows."""
    caps = Sidecar(bd_size=40, mask_id=7).capabilities(model_config={"max_position_embeddings": 1024})
    assert caps.max_context == 1024 and DecodeConfig(mode="diffusion", block_size=1024).resolve(caps).block == 1024
    with pytest.raises(DecodeSettingsError, match="block_size 1025 exceeds the model's context length 1024"):
        DecodeConfig(mode="diffusion", block_size=1025).resolve(caps)
    with pytest.raises(DecodeSettingsError, match="draft_len 40: 1600 rows a forward exceed .* at most 32"):
        DecodeConfig(mode="self-spec", self_spec_canvases="all").resolve(caps)
    assert DecodeConfig(mode="self-spec", draft_len=32, self_spec_canvases="all").resolve(caps).draft_len == 32
    assert DecodeConfig(mode="self-spec", self_spec_canvases="last").resolve(caps).draft_len == 40
    unread = Sidecar(bd_size=40, mask_id=7).capabilities()  # no model config: nothing to bound by
    assert DecodeConfig(mode="diffusion", block_size=10**6).resolve(unread).block == 10**6


@pytest.mark.parametrize(
    "caps, mode, refused",
    [
        (DENSE.capabilities(), "diffusion", None),
        (DENSE.capabilities(), "self-spec", None),
        (Capabilities.plain_ar(), "causal", None),  # stock SGLang on the HF weights
        (Capabilities.plain_ar(), "diffusion", "needs a bdstack checkpoint directory"),
        (ADAPTER.capabilities(), "self-spec", "draft-only adapter"),
        (ADAPTER.capabilities(), "causal", None),  # the directory holds the base model as is
        (BLOCK_CAUSAL.capabilities(), "diffusion", "clean_causal: false need --backend native"),
        (UNSHIFTED.capabilities(), "diffusion", "need --backend native"),  # its clean stream is block-causal
        (DENSE.capabilities(model_config={"text_config": {"layer_types": LINEAR}}), "diffusion", "hybrid"),
        (DENSE.capabilities().with_facts(model_config={"layer_types": LINEAR}), "diffusion", "hybrid"),
    ],
)
def test_what_sglang_serves(caps, mode, refused):
    why = caps.backend_refusal("sglang", mode)
    assert (why is None) if refused is None else (why is not None and refused in why), why


def test_sglang_serves_hybrids_with_a_within_block_causal_canvas():
    caps = Sidecar(bd_size=4, mask_id=7, within_block_causal=True).capabilities(
        model_config={"layer_types": ["linear_attention", "full_attention"]}
    )
    assert caps.hybrid and caps.serves("sglang", "diffusion")


def test_native_backend_is_the_mode_rule_and_another_backend_registers_its_own():
    assert [m for m in MODES if BLOCK_CAUSAL.capabilities().serves("native", m)] == ["causal", "diffusion"]
    assert "unknown backend 'x'" in DENSE.capabilities().backend_refusal("x", "causal")
    try:
        register_backend("toy", lambda caps, mode: None if mode == "causal" else "toy serves causal only")
        assert DENSE.capabilities().serves("toy", "causal")
        assert DENSE.capabilities().backend_refusal("toy", "diffusion") == "toy serves causal only"
    finally:
        BACKENDS.pop("toy", None)
