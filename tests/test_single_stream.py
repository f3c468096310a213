"""The single-stream masked-diffusion objective (`--objective single_stream`, train/single_stream.py): the
row, its noise and unshifted targets, its attention, its loss, invariant 3 for it (the engine's canvas
logits == the training forward's), and the trainer end to end into the engine's diffusion and causal modes."""

import json
import random

import pytest
import torch
import torch.nn.functional as F

from bdcore.attention_rule import dense_mask
from bdcore.capabilities import Capabilities
from bdcore.decode.config import DecodeConfig
from bdcore.decode.rows import Rows
from bdcore.serving_gate import CannotServe, resolve
from bdcore.sidecar import Sidecar
from tests.one_sequence import OneSequence
from tests.tiny import EOT_ID, FILLER_ID, MASK_ID, random_sample, tiny_model
from train.config import BlockDiffusionConfig
from train.model import TwoStreamLM
from train.noise import noise_generator
from train.rows import Sample, SpecialIds, build_batch
from train.single_stream import batch_builder, build_single_stream_batch, sample_length, single_stream_length

IDS = SpecialIds(mask_id=MASK_ID, filler_id=FILLER_ID)
CFG = BlockDiffusionConfig(bd_size=4, views=1, ar_loss_weight=0.0, objective="single_stream")


def _batch(seed: int, *, turns: int = 2, pack: int = 2, n_rows: int = 3, step: int = 0):
    rng = random.Random(seed)
    rows = [[random_sample(rng, turns=turns) for _ in range(pack)] for _ in range(n_rows)]
    return rows, build_single_stream_batch(rows, CFG, IDS, noise_generator(seed, 0, step))


def test_layout_of_a_two_turn_sample_by_hand():
    # prompt 3, response 5 (one block + 1 -> two blocks, 3 fillers), context 2, response 2 (one block, 2 fillers)
    s = Sample([10, 11, 12, 20, 21, 22, 23, EOT_ID, 30, 31, 40, EOT_ID], [(3, 8), (10, 12)])
    b = build_single_stream_batch([[s]], CFG, IDS, noise_generator(0, 0, 0))
    m = b.meta
    F_ = FILLER_ID
    clean = [10, 11, 12, 20, 21, 22, 23, EOT_ID, F_, F_, F_, 30, 31, 40, EOT_ID, F_, F_]
    assert b.clean_ids[0].tolist() == clean and single_stream_length(s, 4) == len(clean) == 17
    assert m.stream[0].tolist() == [0] * 17
    assert m.pos[0].tolist() == list(range(17)), "positions run on through the fillers"
    assert m.blk[0].tolist() == [-1] * 3 + [0] * 4 + [1] * 4 + [-1] * 2 + [2] * 4
    assert m.bstart[0].tolist() == [0, 1, 2] + [3] * 4 + [7] * 4 + [11, 12] + [13] * 4
    assert b.ar_index.numel() == 0, "no AR targets: the stream is not token-causal"


@pytest.mark.parametrize("seed", range(4))
def test_only_response_slots_are_masked_and_every_masked_slot_predicts_its_own_token(seed):
    _, b = _batch(seed)
    m, T = b.meta, b.input_ids.shape[1]
    response = m.blk >= 0
    assert not (b.masked & ~response).any(), "prompt, context and padding are never masked"
    assert torch.equal(b.input_ids == MASK_ID, b.masked)
    assert torch.equal(b.input_ids[~b.masked], b.clean_ids[~b.masked])
    # Unshifted targets: the scored rows are exactly the masked slots, each labelled with its own clean token.
    rows = torch.zeros(b.masked.numel(), dtype=torch.bool)
    rows[b.diff_index] = True
    assert torch.equal(rows.view_as(b.masked), b.masked) and b.diff_index.unique().numel() == b.diff_index.numel()
    assert torch.equal(b.diff_labels, b.clean_ids.flatten()[b.diff_index])
    # One rate per block: every target of a block carries the same rate, in (0, 1].
    blk = m.blk.flatten()[b.diff_index] + 1000 * (b.diff_index // T)
    for k in blk.unique():
        assert b.diff_rate[blk == k].unique().numel() == 1
    assert ((b.diff_rate > 0) & (b.diff_rate <= 1)).all()


def test_noise_is_deterministic_per_step_and_covers_rates():
    _, a = _batch(3)
    _, again = _batch(3)
    _, other = _batch(3, step=1)
    assert torch.equal(a.masked, again.masked) and torch.equal(a.diff_rate, again.diff_rate)
    assert not torch.equal(a.masked, other.masked)
    # Over many rows the masked share of response slots tracks the mean block rate (~0.5).
    rows = [[random_sample(random.Random(i), max_resp=30)] for i in range(200)]
    b = build_single_stream_batch(rows, CFG, IDS, noise_generator(0, 0, 0))
    share = float(b.masked.sum() / (b.meta.blk >= 0).sum())
    assert 0.4 < share < 0.6


def test_the_two_stream_path_is_unchanged_when_the_objective_is_off():
    two = BlockDiffusionConfig(bd_size=4)
    assert batch_builder(two) is build_batch and batch_builder(CFG) is build_single_stream_batch
    s = Sample([10, 11, 20, 21, 22, 23, EOT_ID], [(2, 7)])  # a response of 5: two blocks, 3 fillers
    assert sample_length(s, two) == 7 + 2 * 8 and sample_length(s, CFG) == 7 + 3
    with pytest.raises(ValueError, match="single_stream"):
        BlockDiffusionConfig(bd_size=4, views=2, ar_loss_weight=0.0, objective="single_stream")
    with pytest.raises(ValueError, match="single_stream"):
        BlockDiffusionConfig(bd_size=4, views=1, ar_loss_weight=0.2, objective="single_stream")


def test_attention_is_causal_for_context_and_block_bidirectional_for_responses():
    """The one attention rule, rendered for a single-stream row, against a loop written from the definition."""
    _, b = _batch(5, n_rows=2)
    m = b.meta
    got = dense_mask(m, clean_causal=CFG.clean_causal, within_block_causal=False)[:, 0]
    for r in range(m.pos.shape[0]):
        T = m.pos.shape[1]
        for q in range(T):
            for k in range(T):
                if m.stream[r, q] < 0:
                    want = q == k
                elif m.stream[r, k] < 0 or m.doc[r, q] != m.doc[r, k]:
                    want = False
                elif m.blk[r, q] < 0:  # prompt / context: causal
                    want = m.pos[r, k] <= m.pos[r, q]
                else:  # response: everything before its block, and its whole block
                    want = bool(m.pos[r, k] < m.bstart[r, q] or m.blk[r, k] == m.blk[r, q])
                assert bool(got[r, q, k]) == want, (r, q, k)


def test_loss_is_the_cross_entropy_of_masked_slots_against_their_own_tokens():
    model = tiny_model()
    _, b = _batch(2, n_rows=2)
    lm = TwoStreamLM(model, CFG, cpu_block_sparse=False)
    parts = lm(b)
    # Independently: a full forward with the rule's mask, logits at the masked slots, plain CE.
    mask = dense_mask(b.meta, clean_causal=False, within_block_causal=False)
    with torch.no_grad():
        logits = model(input_ids=b.input_ids, attention_mask=mask, position_ids=b.meta.pos).logits
    want = F.cross_entropy(logits[b.masked], b.clean_ids[b.masked])
    torch.testing.assert_close(parts.loss.detach(), want, atol=1e-5, rtol=1e-5)
    assert parts.num_ar_tokens == 0 and parts.num_diff_tokens == int(b.masked.sum())


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_engine_canvas_logits_equal_training_logits(arch):
    """Invariant 3 for this objective: for every block of a training row, the engine, holding that row's
    earlier tokens (noised as the row has them, each earlier block committed block-bidirectionally), returns
    for a canvas of the block's noised tokens the training forward's logits at the block."""
    model = tiny_model(arch)
    rng = random.Random(4)
    samples = [random_sample(rng, max_prompt=8, max_resp=16) for _ in range(4)]
    b = build_single_stream_batch([[s] for s in samples], CFG, IDS, noise_generator(1, 0, 0))
    m = b.meta
    with torch.no_grad():
        train_logits = TwoStreamLM(model, CFG).logits(b)
    checked = 0
    for r, s in enumerate(samples):
        resp = s.spans[0][0]
        for blk in m.blk[r][m.blk[r] >= 0].unique().tolist():
            idx = (m.blk[r] == blk).nonzero().flatten()
            start = int(m.bstart[r, idx[0]])
            runner = OneSequence(model, clean_causal=False, within_block_causal=False)
            runner.forward(Rows().clean(b.input_ids[r, :resp].tolist(), 0), keep=resp)
            for b0 in range(resp, start, CFG.bd_size):
                runner.forward(Rows().commit(b.input_ids[r, b0 : b0 + 4].tolist(), b0, block_causal=True), keep=4)
            got = runner.forward(Rows().canvas(b.input_ids[r, idx].tolist(), start), keep=0)
            torch.testing.assert_close(got, train_logits[r, idx], atol=2e-5, rtol=1e-5)
            checked += 1
    assert checked >= 6


def test_self_spec_is_refused_for_an_unshifted_checkpoint():
    unshifted = Capabilities.from_sidecar(Sidecar(bd_size=4, mask_id=0, shift=False, clean_causal=False))
    with pytest.raises(CannotServe, match="AR head"):
        resolve(unshifted, DecodeConfig(mode="self-spec"), "native")
    assert resolve(unshifted, DecodeConfig(mode="diffusion"), "native").budget == 4, "every slot is predicted"
    shifted = Capabilities.from_sidecar(Sidecar(bd_size=4, mask_id=0))
    assert resolve(shifted, DecodeConfig(mode="diffusion"), "native").budget == 3


@pytest.mark.e2e
def test_train_single_stream_then_serve_diffusion_and_causal(demo_kit, tmp_path):
    from bdcore.decode.sampling import SamplingParams
    from bdcore.loading import load_checkpoint
    from bdcore.sidecar import read_sidecar
    from inference.native.engine import Engine
    from tests.conftest import run_train
    from tests.train_args import train_args

    run = tmp_path / "run"
    run_train(train_args(demo_kit, run, objective="single_stream", max_steps=2, lr="1e-3", log_every=1, pack=True))
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(r["diff_tokens"] > 0 and r["ar_tokens"] == 0 for r in records)
    sc = read_sidecar(run / "final")
    assert (sc.shift, sc.clean_causal, sc.views, sc.ar_loss_weight) == (False, False, 1, 0.0)
    loaded = load_checkpoint(run / "final")
    engine = Engine(loaded)
    tok = loaded.tokenizer
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Add 3 and 4."}], add_generation_prompt=True, tokenize=False
    )
    prompt = tok(text, add_special_tokens=False)["input_ids"]
    for mode in ("diffusion", "causal"):
        g = engine.generate(prompt, SamplingParams(max_tokens=12), DecodeConfig(mode=mode))
        assert g.stats.generated > 0 and g.stats.forwards > 0
    causal = engine.generate(prompt, SamplingParams(max_tokens=12), DecodeConfig(mode="causal"))
    assert causal.stats.forwards == causal.stats.generated, "causal mode: one token a forward"
    with pytest.raises(CannotServe, match="self-spec needs a token-causal AR head"):
        Engine(loaded, DecodeConfig(mode="self-spec"))


@pytest.mark.parametrize(
    "flags, named",
    [
        ({"ar_loss_weight": "0.2"}, "--ar_loss_weight"),
        ({"views": "2"}, "--views"),
        ({"within_block_causal": True}, "--within_block_causal"),
        ({"ar_only": True}, "--ar_only"),
        ({"lora_rank": "4", "draft_adapter": True}, "--draft_adapter"),
        ({"opd_on_policy": True}, "--opd_on_policy"),
    ],
)
def test_flags_that_need_two_streams_are_refused_by_name(flags, named, tmp_path):
    from train.cli import parse_args
    from train.config import FlagError

    argv = ["--model_id", "x", "--dataset", "d.jsonl", "--save_dir", str(tmp_path), "--objective", "single_stream"]
    for k, v in flags.items():
        argv += [f"--{k}"] if v is True else [f"--{k}", v]
    with pytest.raises(FlagError, match=f"^{named}: does not apply to --objective single_stream"):
        parse_args(argv)


def test_every_engine_forward_equals_the_reference_forward(tmp_path):
    """Logit for logit, not only token for token: each forward of an unshifted diffusion decode (the prefill
    with its canvas, denoise steps, block commits with the next canvas) gives the canvas logits that one
    full-sequence forward over [prompt + committed blocks (block-bidirectional), canvas] gives."""
    from bdcore.decode.sampling import SamplingParams
    from bdcore.loading import load_checkpoint
    from inference.native.engine import Engine
    from tests.reference_decoder import ReferenceModel
    from tests.test_invariant_4_self_spec import _prompts
    from tests.tiny import tiny_checkpoint

    path = tiny_checkpoint(tmp_path, bd_size=4, clean_causal=False, shift=False)
    loaded = load_checkpoint(path)
    engine = Engine(loaded)
    reference = ReferenceModel(path, mask_id=loaded.mask_id, clean_causal=False, within_block_causal=False)
    after_a_commit = 0
    for prompt in _prompts(loaded.tokenizer, 2, seed=3):
        decoder, out = engine.start(
            prompt, SamplingParams(max_tokens=14), DecodeConfig(mode="diffusion", threshold=0.5)
        )
        while not decoder.finished:
            fwd = decoder.next_forward()
            (logits,) = engine.runner.forward([(decoder.seq.cache, fwd)])
            n = fwd.rows.n_clean
            P, done = len(prompt), len(out.tokens)  # every decided block is in the answer until it stops
            blocks = [(P + i, P + i + 4) for i in range(0, done, 4)]
            want = reference(list(prompt) + out.tokens, blocks, fwd.rows.tokens[n:])[1]
            torch.testing.assert_close(logits[n:], want, atol=2e-5, rtol=1e-5)
            after_a_commit += done > 0
            decoder.take(logits)
    assert after_a_commit >= 4
