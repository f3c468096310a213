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
from bdcore.decode.sequence import Sequence
from bdcore.sidecar import Sidecar

DENSE = Sidecar(bd_size=4, mask_id=7)
BLOCK_CAUSAL = Sidecar(bd_size=4, mask_id=7, clean_causal=False)
UNSHIFTED = Sidecar(bd_size=4, mask_id=7, shift=False, clean_causal=False, views=1)
ADAPTER = Sidecar(bd_size=4, mask_id=7, draft_adapter="draft")
LINEAR = ["linear_attention", "full_attention"]


@pytest.mark.parametrize(
    "caps, modes",
    [
        (Capabilities.from_sidecar(None), ("causal",)),
        (Capabilities.from_sidecar(DENSE), ("causal", "diffusion", "self-spec")),
        (Capabilities.from_sidecar(BLOCK_CAUSAL), ("causal", "diffusion")),
        (Capabilities.from_sidecar(UNSHIFTED), ("causal", "diffusion")),
        (Capabilities.from_sidecar(ADAPTER), ("causal", "diffusion", "self-spec")),
    ],
)
def test_native_modes_by_checkpoint(caps, modes):
    assert caps.modes == modes


def test_refusals_name_the_reason_and_the_fix():
    with pytest.raises(CapabilityError, match="plain AR model: serve it with --mode causal"):
        Capabilities.from_sidecar(None).check_mode("diffusion")
    with pytest.raises(CapabilityError, match="unshifted .* serve it with --mode diffusion"):
        Capabilities.from_sidecar(UNSHIFTED).check_mode("self-spec")
    with pytest.raises(CapabilityError, match="clean_causal: true .* serve it with --mode diffusion"):
        Capabilities.from_sidecar(BLOCK_CAUSAL).check_mode("self-spec")
    with pytest.raises(ValueError, match="unknown mode 'fast'"):
        Capabilities.from_sidecar(DENSE).check_mode("fast", ValueError)


def test_sidecar_facts_carry_over():
    caps = Capabilities.from_sidecar(
        Sidecar(bd_size=8, mask_id=3, within_block_causal=True), stop_ids=frozenset({1, 2})
    )
    assert (caps.bd_size, caps.mask_id, caps.stop_ids, caps.max_draft_len) == (8, 3, frozenset({1, 2}), 8)
    assert Sequence.for_checkpoint(caps, [5, 6], None, None, None).block_causal is False
    assert Sequence.for_checkpoint(Capabilities.from_sidecar(BLOCK_CAUSAL), [5], None, None, None).block_causal is True
    assert Sequence.for_checkpoint(Capabilities.from_sidecar(UNSHIFTED), [5], None, None, None).shift is False
    assert Capabilities.from_sidecar(DENSE, mask_id=9).mask_id == 9  # the tokenizer's id, where the loader has it


def test_attention_per_forward():
    assert Capabilities.from_sidecar(None).attention("causal") == {"clean": "causal"}
    assert Capabilities.from_sidecar(DENSE).attention("diffusion") == {"clean": "causal", "canvas": "bidirectional"}
    within = Capabilities.from_sidecar(Sidecar(bd_size=4, mask_id=7, within_block_causal=True))
    assert within.attention("self-spec") == {"clean": "causal", "canvas": "causal within the block"}
    assert Capabilities.from_sidecar(BLOCK_CAUSAL).attention("diffusion")["clean"] == "block-causal"


def test_draft_length_limit_is_the_trained_block():
    caps = Capabilities.from_sidecar(DENSE)
    assert caps.draft_len_refusal(4) is None
    assert caps.draft_len_refusal(5) == "draft_len 5 exceeds the trained block size 4; give at most 4 (the default)"
    with pytest.raises(DecodeSettingsError, match="draft_len 5 exceeds the trained block size 4"):
        DecodeConfig(mode="self-spec", draft_len=5).resolve(caps)
    assert DecodeConfig(mode="self-spec").resolve(caps).draft_len == 4


def test_canvases_are_bounded_by_the_model_context():
    """A canvas longer than the context was decoded, and allocated its block_size-squared mask per request
    (a 500 at 100000, a killed server at 10**9); all-canvases self-spec holds draft_len squared rows."""
    caps = Capabilities.from_sidecar(Sidecar(bd_size=40, mask_id=7), {"max_position_embeddings": 1024})
    assert caps.max_context == 1024 and DecodeConfig(mode="diffusion", block_size=1024).resolve(caps).block == 1024
    with pytest.raises(DecodeSettingsError, match="block_size 1025 exceeds the model's context length 1024"):
        DecodeConfig(mode="diffusion", block_size=1025).resolve(caps)
    with pytest.raises(DecodeSettingsError, match="draft_len 40: 1600 rows a forward exceed .* at most 32"):
        DecodeConfig(mode="self-spec", self_spec_canvases="all").resolve(caps)
    assert DecodeConfig(mode="self-spec", draft_len=32, self_spec_canvases="all").resolve(caps).draft_len == 32
    assert DecodeConfig(mode="self-spec", self_spec_canvases="last").resolve(caps).draft_len == 40
    unread = Capabilities.from_sidecar(Sidecar(bd_size=40, mask_id=7))  # no model config: nothing to bound by
    assert DecodeConfig(mode="diffusion", block_size=10**6).resolve(unread).block == 10**6


@pytest.mark.parametrize(
    "caps, mode, refused",
    [
        (Capabilities.from_sidecar(DENSE), "diffusion", None),
        (Capabilities.from_sidecar(DENSE), "self-spec", None),
        (Capabilities.from_sidecar(None), "causal", None),  # stock SGLang on the HF weights
        (Capabilities.from_sidecar(None), "diffusion", "needs a bdstack checkpoint directory"),
        (Capabilities.from_sidecar(ADAPTER), "self-spec", "draft-only adapter"),
        (Capabilities.from_sidecar(ADAPTER), "causal", None),  # the directory holds the base model as is
        (Capabilities.from_sidecar(BLOCK_CAUSAL), "diffusion", "clean_causal: false need --backend native"),
        (
            Capabilities.from_sidecar(UNSHIFTED),
            "diffusion",
            "need --backend native",
        ),  # its clean stream is block-causal
        (Capabilities.from_sidecar(DENSE, {"text_config": {"layer_types": LINEAR}}), "diffusion", "hybrid"),
        (Capabilities.from_sidecar(DENSE, {"layer_types": LINEAR}), "diffusion", "hybrid"),
    ],
)
def test_what_sglang_serves(caps, mode, refused):
    why = caps.backend_refusal("sglang", mode)
    assert (why is None) if refused is None else (why is not None and refused in why), why


def test_sglang_serves_hybrids_with_a_within_block_causal_canvas():
    caps = Capabilities.from_sidecar(
        Sidecar(bd_size=4, mask_id=7, within_block_causal=True), {"layer_types": ["linear_attention", "full_attention"]}
    )
    assert caps.hybrid and caps.serves("sglang", "diffusion")


def test_native_backend_is_the_mode_rule_and_another_backend_registers_its_own():
    assert [m for m in MODES if Capabilities.from_sidecar(BLOCK_CAUSAL).serves("native", m)] == ["causal", "diffusion"]
    assert "unknown backend 'x'" in Capabilities.from_sidecar(DENSE).backend_refusal("x", "causal")
    try:
        register_backend("toy", lambda caps, mode: None if mode == "causal" else "toy serves causal only")
        assert Capabilities.from_sidecar(DENSE).serves("toy", "causal")
        assert Capabilities.from_sidecar(DENSE).backend_refusal("toy", "diffusion") == "toy serves causal only"
    finally:
        BACKENDS.pop("toy", None)
