"""The capability value (bdcore/capabilities.py): what a checkpoint is, read off its sidecar and config.

Each expectation is written out by hand from docs/design.md (sections 5 and 6), not derived from the
object. What a backend serves on it is the serving gate's (tests/test_serving_gate.py). Production code
builds it in one place only, `Capabilities.from_sidecar` (checked here over the source tree).
"""

from __future__ import annotations

import ast
from pathlib import Path

from bdcore.capabilities import Capabilities, read_capabilities
from bdcore.decode.runner import ModelRunner
from bdcore.decode.sequence import Sequence
from bdcore.sidecar import Sidecar, write_sidecar
from tests.tiny import tiny_model

ROOT = Path(__file__).resolve().parents[1]
DENSE = Sidecar(bd_size=4, mask_id=7)
BLOCK_CAUSAL = Sidecar(bd_size=4, mask_id=7, clean_causal=False)
UNSHIFTED = Sidecar(bd_size=4, mask_id=7, shift=False, clean_causal=False, views=1)
ADAPTER = Sidecar(bd_size=4, mask_id=7, draft_adapter="draft")
LINEAR = ["linear_attention", "full_attention"]


def test_sidecar_facts_carry_over():
    caps = Capabilities.from_sidecar(
        Sidecar(bd_size=8, mask_id=3, within_block_causal=True), stop_ids=frozenset({1, 2})
    )
    assert (caps.bd_size, caps.mask_id, caps.stop_ids, caps.max_draft_len) == (8, 3, frozenset({1, 2}), 8)
    assert caps.block_diffusion and caps.ar_head and caps.within_block_causal and not caps.draft_adapter
    assert Capabilities.from_sidecar(ADAPTER).draft_adapter
    assert not Capabilities.from_sidecar(UNSHIFTED).ar_head and not Capabilities.from_sidecar(BLOCK_CAUSAL).ar_head
    assert Capabilities.from_sidecar(DENSE, mask_id=9).mask_id == 9  # the tokenizer's id, where the loader has it
    plain = Capabilities.from_sidecar(None)
    assert (plain.block_diffusion, plain.max_draft_len, plain.mask_id) == (False, 1, None)
    assert (plain.hybrid, plain.max_context, plain.architecture) == (None, None, None)  # no config read


def test_model_config_facts():
    """From config.json's dict (or an HF config): gated-delta layers (a vision-language checkpoint keeps them
    under text_config), the context and the architecture; a config naming no architecture says so ("")."""
    config = {"architectures": ["Qwen3ForCausalLM"], "max_position_embeddings": 1024}
    caps = Capabilities.from_sidecar(DENSE, config)
    assert (caps.hybrid, caps.max_context, caps.architecture) == (False, 1024, "Qwen3ForCausalLM")
    assert Capabilities.from_sidecar(DENSE, {"text_config": {"layer_types": LINEAR}}).hybrid
    assert Capabilities.from_sidecar(None, {"layer_types": LINEAR}).hybrid
    assert Capabilities.from_sidecar(DENSE, {}).architecture == ""
    hf = Capabilities.from_sidecar(DENSE, tiny_model().config)
    assert hf.hybrid is False and hf.max_context == tiny_model().config.max_position_embeddings


def test_read_off_a_directory(tmp_path):
    assert read_capabilities(tmp_path) is None  # not a model directory: the loader says why
    (tmp_path / "config.json").write_text('{"architectures": ["Qwen3ForCausalLM"], "max_position_embeddings": 64}')
    assert read_capabilities(tmp_path) == Capabilities.from_sidecar(None)
    write_sidecar(tmp_path, BLOCK_CAUSAL)
    caps = read_capabilities(tmp_path)
    assert caps == Capabilities.from_sidecar(
        BLOCK_CAUSAL, {"architectures": ["Qwen3ForCausalLM"], "max_position_embeddings": 64}
    )


def test_attention_per_forward():
    assert Capabilities.from_sidecar(None).attention("causal") == {"clean": "causal"}
    assert Capabilities.from_sidecar(DENSE).attention("diffusion") == {"clean": "causal", "canvas": "bidirectional"}
    within = Capabilities.from_sidecar(Sidecar(bd_size=4, mask_id=7, within_block_causal=True))
    assert within.attention("self-spec") == {"clean": "causal", "canvas": "causal within the block"}
    assert Capabilities.from_sidecar(BLOCK_CAUSAL).attention("diffusion")["clean"] == "block-causal"


def test_the_decode_objects_of_a_checkpoint_read_its_capabilities():
    caps = Capabilities.from_sidecar(Sidecar(bd_size=8, mask_id=3), stop_ids=frozenset({1, 2}))
    seq = Sequence.for_checkpoint(caps, (5, 6), None, None, None)
    assert (seq.prompt_ids, seq.mask_id, seq.stop_ids, seq.block_causal, seq.shift) == ([5, 6], 3, {1, 2}, False, True)
    assert Sequence.for_checkpoint(Capabilities.from_sidecar(BLOCK_CAUSAL), [5], None, None, None).block_causal
    assert Sequence.for_checkpoint(Capabilities.from_sidecar(UNSHIFTED), [5], None, None, None).shift is False
    within = Capabilities.from_sidecar(Sidecar(bd_size=4, mask_id=7, clean_causal=False, within_block_causal=True))
    runner = ModelRunner.for_checkpoint(tiny_model(), within)
    assert (runner.banned, runner.clean_causal, runner.within_block_causal) == (7, False, True)


def test_production_code_builds_capabilities_through_the_one_constructor():
    """`Capabilities(...)` by hand outside bdcore/capabilities.py would be a second definition of what a
    sidecar field means (four places did, each with a different subset)."""
    bad = []
    for package in ("bdcore", "train", "inference", "data", "benchmark"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path == ROOT / "bdcore" / "capabilities.py":
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Capabilities":
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not bad, "Capabilities built by hand (use Capabilities.from_sidecar):\n" + "\n".join(bad)
