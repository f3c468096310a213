"""The engine equals the slow reference decoder (`tests/reference_decoder.py`) for greedy decoding:
the same tokens, the same finish reason, the same generated-token count (the stop token included),
the same number of forwards and, in self-spec, the same acceptance histogram (cold steps included),
in causal, diffusion (fused and unfused commits) and self-spec modes, dense and hybrid, with a
causal and a block-causal clean stream, for answers that end with a stop token and answers cut at
max_tokens."""

from collections import Counter

import pytest

from bdcore.decode.sampling import SamplingParams
from bdcore.decode.tree import parse_tree
from bdcore.loading import load_checkpoint
from inference.native.engine import DecodeConfig, Engine
from tests import reference_decoder as ref
from tests.test_invariant_4_self_spec import _prompts
from tests.tiny import agreeable, tiny_checkpoint

pytestmark = pytest.mark.e2e  # a whole program, server or long sweep: `pytest -m 'not e2e'` skips it

MAX_TOKENS = (24, 7, 24, 13, 24, 5)
# (arch, clean_causal, within_block_causal, end-of-turn boost, common-token boost): `tests.tiny.agreeable`'s
# two edits, so the comparison reaches every branch (stops within max_tokens, full acceptances and rejections).
CHECKPOINTS = [
    ("qwen3", True, False, 1.0, 0.0),
    ("qwen3", "unshifted", False, 3.0, 0.0),  # single-stream: shift false, block-causal
    ("qwen3_moe", True, False, 4.0, 0.7),  # mixture of experts
    ("qwen3", False, False, 1.0, 0.0),
    ("llama", True, True, 1.5, 2.0),
    ("qwen3_5", True, False, 1.5, 3.0),
    ("qwen3_5", False, False, 2.0, 3.0),
    ("qwen3_5", True, True, 1.5, 3.0),
]


@pytest.fixture(scope="module", params=CHECKPOINTS, ids=lambda c: "-".join(map(str, c[:3])))
def checkpoint(request, tmp_path_factory):
    arch, clean_causal, wbc, eot_boost, common_boost = request.param
    shift = clean_causal != "unshifted"
    clean_causal = clean_causal is True
    path = tiny_checkpoint(
        tmp_path_factory.mktemp(arch),
        arch=arch,
        bd_size=4,
        clean_causal=clean_causal,
        within_block_causal=wbc,
        shift=shift,
    )
    tok = load_checkpoint(path).tokenizer
    agreeable(path, tok, _prompts(tok, 4, seed=1), eot_boost=eot_boost, common_boost=common_boost)
    loaded = load_checkpoint(path)
    sc = loaded.sidecar
    reference = ref.ReferenceModel(
        path, mask_id=loaded.mask_id, clean_causal=sc.clean_causal, within_block_causal=sc.within_block_causal
    )
    return loaded, reference


def _decodes(loaded):
    decodes = [
        DecodeConfig(mode="causal"),
        DecodeConfig(mode="diffusion", threshold=0.9),
        DecodeConfig(mode="diffusion", threshold=0.3),
        DecodeConfig(mode="diffusion", threshold=0.5, fuse_commit=False),
        DecodeConfig(mode="diffusion", threshold=0.3, block_size=3, steps=1),
    ]
    if not loaded.sidecar.shift:
        decodes.append(DecodeConfig(mode="causal", fuse_commit=False))
    if loaded.sidecar.clean_causal:
        decodes += [DecodeConfig(mode="self-spec", draft_len=4), DecodeConfig(mode="self-spec", draft_len=2)]
        decodes += [DecodeConfig(mode="self-spec", draft_len=n, self_spec_canvases="all") for n in (4, 3)]
        decodes += [  # draft trees (issue 44): a spine, and a full tree with canvases after every spine row
            DecodeConfig(mode="self-spec", draft_len=4, tree="spine:2,2,2"),
            DecodeConfig(mode="self-spec", draft_len=4, self_spec_canvases="all", tree="3,2"),
        ]
    return decodes


def _reference(reference, loaded, decode: DecodeConfig, prompt, max_tokens):
    facts = dict(max_tokens=max_tokens, stop_ids=loaded.stop_ids)
    bd = loaded.sidecar.bd_size
    if not loaded.sidecar.shift:
        block = decode.block_size or bd
        return ref.unshifted_diffusion(
            reference,
            prompt,
            block=block,
            budget=decode.steps or block,
            threshold=decode.threshold,
            fuse_commit=decode.fuse_commit,
            left_to_right=decode.mode == "causal",
            mask_id=loaded.mask_id,
            **facts,
        )
    if decode.mode == "causal":
        return ref.causal(reference, prompt, **facts)
    if decode.mode == "diffusion":
        block = decode.block_size or bd
        return ref.diffusion(
            reference,
            prompt,
            block=block,
            budget=decode.steps or block - 1,
            threshold=decode.threshold,
            fuse_commit=decode.fuse_commit,
            mask_id=loaded.mask_id,
            **facts,
        )
    return ref.self_spec(
        reference,
        prompt,
        draft_len=decode.draft_len,
        mask_id=loaded.mask_id,
        canvases=decode.self_spec_canvases,
        tree=parse_tree(decode.tree) if decode.tree != "off" else None,
        **facts,
    )


def test_engine_equals_the_reference_decoder(checkpoint):
    loaded, reference = checkpoint
    engine = Engine(loaded)
    prompts = _prompts(loaded.tokenizer, len(MAX_TOKENS), seed=11)
    finishes, multi_token_steps, verify_outcomes = Counter(), 0, Counter()
    for decode in _decodes(loaded):
        for prompt, max_tokens in zip(prompts, MAX_TOKENS):
            got = engine.generate(prompt, SamplingParams(max_tokens=max_tokens), decode)
            want = _reference(reference, loaded, decode, prompt, max_tokens)
            where = f"{decode} max_tokens={max_tokens}"
            assert got.tokens == want.tokens, where
            assert got.finish_reason == want.finish_reason, where
            assert got.stats.generated == want.generated, where
            assert got.stats.forwards == want.forwards, where
            assert dict(got.stats.accepted) == dict(want.accepted), where
            finishes[want.finish_reason] += 1
            multi_token_steps += decode.mode == "diffusion" and want.generated > want.forwards
            if decode.mode == "self-spec":
                verify_outcomes.update(
                    ("full" if k == decode.draft_len - 1 else "rejected", decode.self_spec_canvases)
                    for k in want.accepted
                )
    # The comparison is only as good as what it exercises.
    assert finishes["stop"] >= 3 and finishes["length"] >= 3, finishes
    assert multi_token_steps > 0, "some diffusion steps committed several tokens"
    if loaded.sidecar.clean_causal:
        canvases = {c for _, c in verify_outcomes}
        assert all(verify_outcomes[(o, c)] > 0 for o in ("full", "rejected") for c in canvases), verify_outcomes


def test_causal_tokens_per_forward_is_exactly_one_with_the_stop_token_counted(checkpoint):
    """A causal answer that ends with end-of-turn produced one token per forward, that one included."""
    loaded, _ = checkpoint
    engine = Engine(loaded, DecodeConfig(mode="causal"))
    stopped = 0
    for prompt in _prompts(loaded.tokenizer, len(MAX_TOKENS), seed=11):
        g = engine.generate(prompt, SamplingParams(max_tokens=24))
        stopped += g.finish_reason == "stop"
        assert g.stats.generated == len(g.tokens) + (g.finish_reason == "stop")
        assert g.stats.forwards == g.stats.generated and g.stats.tokens_per_forward == 1.0
    assert stopped > 0
