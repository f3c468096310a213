"""`--canvas_fill noise`, the draft layout of SGLang's UNO (docs/design.md 8.21): every slot of a noised
block holds a uniform random id in training, self-spec's drafting slots hold fresh ones when served, the
sidecar says so in a version older readers refuse, and diffusion mode (which needs <|mask|> to mark an
undecided slot) is refused. Self-spec stays lossless: greedy output is the base model's."""

import random

import pytest
import torch

from bdcore.capabilities import Capabilities
from bdcore.decode.canvas_fill import CanvasFill
from bdcore.decode.config import DecodeConfig
from bdcore.decode.policy.draft_quality import canvas_forwards
from bdcore.decode.rows import Rows
from bdcore.decode.sampling import SamplingParams
from bdcore.loading import load_checkpoint
from bdcore.serving_gate import CannotServe, resolve
from bdcore.sidecar import Sidecar, SidecarError, read_sidecar, write_sidecar
from benchmark.tiny import draft_checkpoint
from inference.native.engine import Engine
from tests.test_invariant_4_self_spec import _prompts
from tests.tiny import FILLER_ID, MASK_ID, random_sample, tiny_checkpoint
from train.config import BlockDiffusionConfig
from train.noise import noise_generator
from train.rows import SpecialIds, build_batch

VOCAB = 97
NOISE = BlockDiffusionConfig(
    bd_size=4, views=1, ar_loss_weight=0.0, clean_causal=True, within_block_causal=True, canvas_fill="noise"
)


def _batch(cfg, seed=5):
    rng = random.Random(3)
    rows = [[random_sample(rng, max_prompt=10, max_resp=14)] for _ in range(3)]
    return build_batch(rows, cfg, SpecialIds(MASK_ID, FILLER_ID, noise_vocab=VOCAB), noise_generator(seed, 0, 0))


def test_noise_fills_every_slot_of_every_block_and_each_draft_is_a_target():
    batch, again, other = _batch(NOISE), _batch(NOISE), _batch(NOISE, seed=6)
    noised, clean = batch.meta.stream >= 1, batch.meta.stream == 0
    assert torch.equal(batch.masked, noised) and torch.equal(batch.input_ids, again.input_ids)  # replayable
    assert not torch.equal(batch.input_ids[noised], other.input_ids[noised]), "the draw follows the generator"
    slots = batch.input_ids[noised]
    assert int(slots.min()) >= 0 and int(slots.max()) < VOCAB and not (slots == MASK_ID).any()
    assert len(set(slots.tolist())) > slots.numel() // 2, "uniform ids, not one token"
    assert (slots != batch.clean_ids[noised]).float().mean() > 0.9, "the answer is not shown"
    assert torch.equal(batch.input_ids[clean], batch.clean_ids[clean]), "the clean stream is the data"
    # every noised row but each block's last predicts the next slot of its block: bd_size - 1 drafts a block
    blocks = int(noised.sum()) // NOISE.bd_size  # responses are laid out in whole blocks
    assert batch.diff_index.numel() == blocks * (NOISE.bd_size - 1)
    assert torch.equal(batch.diff_rate, torch.ones_like(batch.diff_rate))
    masked = _batch(BlockDiffusionConfig(bd_size=4, views=1, ar_loss_weight=0.0))
    assert (masked.input_ids == MASK_ID).any() and torch.equal(masked.clean_ids, batch.clean_ids)


def test_noise_needs_one_view_and_a_range():
    with pytest.raises(ValueError, match="views=1"):
        BlockDiffusionConfig(bd_size=4, views=2, ar_loss_weight=0.0, canvas_fill="noise")
    with pytest.raises(ValueError, match="canvas_fill"):
        BlockDiffusionConfig(bd_size=4, canvas_fill="zeros")
    rng = random.Random(0)
    with pytest.raises(ValueError, match="noise_vocab"):
        build_batch([[random_sample(rng)]], NOISE, SpecialIds(MASK_ID, FILLER_ID), noise_generator(0, 0, 0))


def test_the_sidecar_writes_a_version_older_readers_refuse():
    mask, noise = NOISE.sidecar(MASK_ID, draft_adapter="draft_adapter"), None
    noise = Sidecar(**{**mask.__dict__, "canvas_fill": "noise"})
    mask = Sidecar(**{**mask.__dict__, "canvas_fill": "mask"})
    assert '"format_version": 2' in mask.to_json() and "canvas_fill" not in mask.to_json()
    assert '"format_version": 3' in noise.to_json() and '"canvas_fill": "noise"' in noise.to_json()
    import json

    for sc in (mask, noise):
        assert Sidecar.from_dict(json.loads(sc.to_json())).canvas_fill == sc.canvas_fill
    with pytest.raises(SidecarError, match="format_version 3"):
        Sidecar.from_dict({**json.loads(noise.to_json()), "format_version": 2})
    with pytest.raises(SidecarError, match="canvas_fill"):
        Sidecar.from_dict({**json.loads(mask.to_json()), "canvas_fill": "zeros"})


def test_the_gate_serves_self_spec_and_causal_only():
    caps = Capabilities(bd_size=4, mask_id=MASK_ID, draft_adapter=True, canvas_fill="noise", vocab_size=VOCAB)
    for mode in ("causal", "self-spec"):
        resolve(caps, DecodeConfig(mode=mode), "native")
    with pytest.raises(CannotServe, match="<\\|mask\\|> to mark"):
        resolve(caps, DecodeConfig(mode="diffusion"), "native")
    plain = Capabilities(bd_size=4, mask_id=MASK_ID, canvas_fill="noise", vocab_size=VOCAB)
    for backend in ("sglang", "vllm"):
        with pytest.raises(CannotServe, match="canvas_fill"):
            resolve(plain, DecodeConfig(mode="self-spec"), backend)


def test_a_fill_draws_in_range_and_is_the_same_for_the_same_seed():
    assert CanvasFill(MASK_ID)(3) == [MASK_ID] * 3
    a, b = CanvasFill(MASK_ID, noise_vocab=VOCAB, seed=1), CanvasFill(MASK_ID, noise_vocab=VOCAB, seed=1)
    draws = [a(5) for _ in range(20)]
    assert draws == [b(5) for _ in range(20)] and len({tuple(d) for d in draws}) == 20
    assert all(0 <= t < VOCAB for d in draws for t in d)
    with pytest.raises(ValueError, match="vocab_size"):
        CanvasFill.for_checkpoint(Capabilities(bd_size=4, mask_id=MASK_ID, canvas_fill="noise"))
    rows = canvas_forwards(list(range(10)), 4, mask_id=MASK_ID, draft_len=4, max_rows=64, fill=a)[0]
    assert MASK_ID not in rows.tokens[10:] and len(rows.tokens) > 10


@pytest.fixture(scope="module")
def noise_checkpoint(tmp_path_factory):
    directory = draft_checkpoint(tmp_path_factory.mktemp("noise"))
    sidecar = read_sidecar(directory)
    write_sidecar(directory, Sidecar(**{**sidecar.__dict__, "canvas_fill": "noise", "within_block_causal": True}))
    return directory


def test_served_self_spec_drafts_from_noise_and_is_the_base_models_output(noise_checkpoint, tmp_path, monkeypatch):
    plain = load_checkpoint(tiny_checkpoint(tmp_path / "plain", bd_size=4))
    ckpt = load_checkpoint(noise_checkpoint)
    assert ckpt.capabilities.canvas_fill == "noise" and ckpt.capabilities.within_block_causal
    vocab = ckpt.capabilities.vocab_size
    canvases = []
    real_canvas = Rows.canvas

    def spy(self, tokens, start, view=1, **where):
        canvases.append(list(tokens))
        return real_canvas(self, tokens, start, view, **where)

    monkeypatch.setattr(Rows, "canvas", spy)
    params = SamplingParams(max_tokens=16)
    want, engine = Engine(plain, DecodeConfig(mode="causal")), Engine(ckpt, DecodeConfig(mode="self-spec"))
    for ids in _prompts(ckpt.tokenizer, 4, seed=1):
        assert engine.generate(ids, params).tokens == want.generate(ids, params).tokens
    slots = [t for c in canvases for t in c]
    assert canvases and all(0 <= t < vocab for t in slots)
    assert slots.count(ckpt.mask_id) < len(slots) / 10, "drafting slots hold noise, not <|mask|>"
    with pytest.raises(CannotServe, match="canvas_fill: noise"):
        Engine(ckpt, DecodeConfig(mode="diffusion"))
