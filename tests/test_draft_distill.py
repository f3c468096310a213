"""Drafts distilled from the verifier (`--draft_loss kl|mix`, `--chain_weights`; train/loss.py `draft_loss`,
`chain_weights`): each drafting row's teacher is the clean-stream row that predicts the same token (found here by
a brute-force search), detached; the loss equals KL(teacher || drafter) by hand; chain weights are the product
of the earlier slots' acceptance by hand, and they enter the loss."""

import copy
import random

import pytest
import torch

from tests.tiny import FILLER_ID, MASK_ID, random_sample, tiny_model
from train.config import BlockDiffusionConfig
from train.loss import chain_weights, draft_loss
from train.model import TwoStreamLM
from train.noise import noise_generator
from train.rows import SpecialIds, build_batch


def _batch(cfg, seed=3, packed=False):
    rng = random.Random(seed)
    samples = [random_sample(rng, turns=2 if i == 1 else 1, max_prompt=8, max_resp=11) for i in range(4)]
    rows = [samples[:2], samples[2:]] if packed else [[s] for s in samples]
    return build_batch(rows, cfg, SpecialIds(MASK_ID, FILLER_ID), noise_generator(5, 0, 0))


def _teacher_by_search(batch) -> list[int]:
    """For each drafting row, the clean row of the same document at the same position, or -1 where the document
    has no token after that position (a filler target): a plain loop over the rows."""
    T = batch.meta.pos.shape[1]
    m = batch.meta
    out = []
    for d in batch.diff_index.tolist():
        b, i = divmod(d, T)
        here = [
            j for j in range(T) if m.stream[b, j] == 0 and m.doc[b, j] == m.doc[b, i] and m.pos[b, j] == m.pos[b, i]
        ]
        after = [
            j for j in range(T) if m.stream[b, j] == 0 and m.doc[b, j] == m.doc[b, i] and m.pos[b, j] == m.pos[b, i] + 1
        ]
        out.append(b * T + here[0] if here and after else -1)
    return out


@pytest.mark.parametrize("packed", [False, True])
def test_each_drafting_row_is_taught_by_the_clean_row_that_predicts_the_same_token(packed):
    batch = _batch(BlockDiffusionConfig(bd_size=4, ar_loss_weight=0.5), packed=packed)
    teacher = batch.diff_teacher.tolist()
    assert teacher == _teacher_by_search(batch)
    taught = batch.diff_teacher >= 0
    # the teacher row is an AR row whose label is the drafting row's label; only fillers go without one
    ar = dict(zip(batch.ar_index.tolist(), batch.ar_labels.tolist()))
    assert all(ar[t] == y for t, y in zip(batch.diff_teacher[taught].tolist(), batch.diff_labels[taught].tolist()))
    assert (batch.diff_labels[~taught] == FILLER_ID).all() and taught.sum() > 0 and (~taught).sum() > 0


def _kl_by_hand(lm, batch, temperature=1.0):
    """KL(teacher || drafter) per drafting row from the model's full logits (the teacher's detached), <|mask|>
    banned on both sides; fillers get cross-entropy."""
    logits = lm.logits(batch).flatten(0, 1).float()
    s = logits[batch.diff_index].clone()
    t = logits[batch.diff_teacher.clamp_min(0)].detach().clone()
    s[:, MASK_ID] = t[:, MASK_ID] = float("-inf")
    ls, lt = (s / temperature).log_softmax(-1), (t / temperature).log_softmax(-1)
    kl = (lt.exp() * (lt - ls.masked_fill(lt.isinf(), 0))).nan_to_num().sum(-1) * temperature**2
    ce = torch.nn.functional.cross_entropy(s, batch.diff_labels, reduction="none")
    return torch.where(batch.diff_teacher >= 0, kl, ce), s, t


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_the_kl_loss_and_its_gradient_are_the_detached_teachers(temperature):
    """Loss and gradient against a hand computation whose teacher logits are detached: a teacher that is not
    detached sends gradient through the clean rows, and the gradients differ."""
    cfg = BlockDiffusionConfig(
        bd_size=4, ar_loss_weight=0.0, clean_causal=True, draft_loss="kl", draft_temperature=temperature
    )
    batch = _batch(cfg)
    lm = TwoStreamLM(tiny_model(), cfg, mask_id=MASK_ID, cpu_block_sparse=False)
    ref = copy.deepcopy(lm)
    parts = lm(batch)
    parts.loss.backward()
    want, _, _ = _kl_by_hand(ref, batch, temperature)
    want.mean().backward()
    torch.testing.assert_close(parts.loss, want.mean(), rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(lm.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_mix_weighs_kl_and_cross_entropy():
    cfg = BlockDiffusionConfig(bd_size=4, ar_loss_weight=0.0, clean_causal=True, draft_loss="mix", draft_kl_mix=0.25)
    batch = _batch(cfg)
    lm = TwoStreamLM(tiny_model(), cfg, mask_id=MASK_ID, cpu_block_sparse=False)
    with torch.no_grad():
        got = lm(batch).loss
        kl, s, _ = _kl_by_hand(lm, batch)
    ce = torch.nn.functional.cross_entropy(s, batch.diff_labels, reduction="none")
    want = torch.where(batch.diff_teacher >= 0, 0.25 * kl + 0.75 * ce, ce).mean()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def _chain_by_loop(accept, block, offset):
    """The product of the mean acceptance of each earlier offset of the same block, a slot no row drafts counting
    as accepted."""
    out = []
    for a_block, a_off in zip(block.tolist(), offset.tolist()):
        w = 1.0
        for k in range(a_off):
            same = [a for a, b, o in zip(accept.tolist(), block.tolist(), offset.tolist()) if b == a_block and o == k]
            if same:
                w *= float(torch.tensor(same, dtype=torch.float64).log().mean().exp())
        out.append(w)
    return torch.tensor(out)


def test_chain_weights_are_the_product_of_the_earlier_slots_acceptance():
    accept = torch.tensor([0.9, 0.5, 0.2, 0.7, 0.6, 0.4, 0.8, 0.3])
    block = torch.tensor([7, 7, 7, 2, 2, 2, 7, 9])
    offset = torch.tensor([0, 1, 2, 2, 0, 0, 1, 3])  # block 7 drafts offset 1 twice; block 2 skips offset 1
    got = chain_weights(accept, block, offset)
    torch.testing.assert_close(got, _chain_by_loop(accept, block, offset).float())
    # block 7: offset 0 -> 1; offset 1 -> 0.9; offset 2 -> 0.9 * geometric mean(0.5, 0.8)
    assert got[0] == 1 and abs(float(got[2]) - 0.9 * (0.5 * 0.8) ** 0.5) < 1e-6


def test_chain_weights_enter_the_loss():
    """With --chain_weights the loss is the chain-weighted mean (weights rescaled to the fixed weights' total),
    computed here from the hand KL and a hand acceptance (1 - total variation to the teacher)."""
    cfg = BlockDiffusionConfig(
        bd_size=4, ar_loss_weight=0.0, clean_causal=True, draft_loss="kl", chain_weights=True, prefix_gamma=4.0
    )
    batch = _batch(cfg)
    lm = TwoStreamLM(tiny_model(), cfg, mask_id=MASK_ID, cpu_block_sparse=False)
    with torch.no_grad():
        got = lm(batch).loss
        kl, s, t = _kl_by_hand(lm, batch)
    p = s.softmax(-1)
    accept = 1 - 0.5 * (p - t.softmax(-1)).abs().sum(-1)
    accept = torch.where(batch.diff_teacher >= 0, accept, p.gather(-1, batch.diff_labels[:, None]).squeeze(-1))
    chain = _chain_by_loop(accept, batch.diff_block, batch.diff_offset).float()
    fixed = torch.exp(-batch.diff_offset.float() / 4.0)
    w = fixed * chain * fixed.sum() / (fixed * chain).sum()
    assert not torch.allclose(w, fixed, rtol=1e-2), "the chain moves the weights"
    torch.testing.assert_close(got, (w * kl).sum() / fixed.sum(), rtol=1e-5, atol=1e-6)


def test_cross_entropy_is_unchanged_by_the_new_fields():
    """draft_loss ce without chain weights is the loss it always was (token_ce over the drafting rows)."""
    from train.loss import token_ce

    cfg = BlockDiffusionConfig(bd_size=4, ar_loss_weight=0.0, clean_causal=True)
    batch = _batch(cfg)
    lm = TwoStreamLM(tiny_model(), cfg, mask_id=MASK_ID, cpu_block_sparse=False)
    with torch.no_grad():
        hidden = lm.hidden_states(batch).flatten(0, 1)
        want = token_ce(hidden[batch.diff_index], lm.model.get_output_embeddings().weight, batch.diff_labels).mean()
        assert torch.equal(lm(batch).loss, want)  # the same kernels on the same rows


def test_draft_loss_without_a_teacher_row_anywhere_is_cross_entropy():
    hidden, weight = torch.randn(3, 8), torch.randn(11, 8)
    labels = torch.tensor([1, 2, 3])
    cfg = BlockDiffusionConfig(bd_size=4, ar_loss_weight=0.5, draft_loss="kl", chain_weights=True)
    got, accept = draft_loss(hidden, hidden.flip(0), weight, labels, torch.zeros(3, dtype=torch.bool), cfg)
    logits = hidden @ weight.t()
    torch.testing.assert_close(got, torch.nn.functional.cross_entropy(logits, labels, reduction="none"))
    torch.testing.assert_close(accept, logits.softmax(-1).gather(-1, labels[:, None]).squeeze(-1))


@pytest.mark.parametrize(
    "kwargs, says",
    [
        (dict(objective="single_stream", views=1, ar_loss_weight=0.0, draft_loss="kl"), "two-stream"),
        (dict(ar_loss_weight=0.0, draft_loss="kl"), "clean stream is causal"),
        (dict(draft_loss="kld"), "choose one of"),
        (dict(draft_loss="mix", draft_kl_mix=1.5), "draft_kl_mix"),
        (dict(draft_loss="kl", draft_temperature=0.0), "draft_temperature"),
    ],
)
def test_settings_without_a_teacher_are_refused(kwargs, says):
    with pytest.raises(ValueError, match=says):
        BlockDiffusionConfig(bd_size=4, **kwargs)


@pytest.mark.e2e
def test_train_py_distils_a_draft_adapter_from_its_base(demo_kit, tmp_path):
    """The recipe's path end to end (the draft adapter's cached clean stream is the teacher): trains, logs a
    finite KL, and the served checkpoint's greedy self-spec is still the base model's output."""
    from bdcore.decode.config import DecodeConfig
    from bdcore.decode.sampling import SamplingParams
    from bdcore.loading import load_checkpoint
    from inference.native.engine import Engine
    from tests.conftest import read_metrics, run_train
    from tests.test_invariant_4_self_spec import _prompts
    from tests.train_args import train_args

    run = tmp_path / "kl"
    flags = dict(lora_rank=4, lr="5e-3", draft_adapter=True, draft_loss="kl", chain_weights=True, log_every=1)
    run_train(train_args(demo_kit, run, max_steps=3, **flags))
    logged = read_metrics(run)
    assert sorted(logged) == [1, 2, 3] and all(0.0 < m["diff"] < 50.0 for m in logged.values()), logged
    ckpt, plain = load_checkpoint(run / "final"), load_checkpoint(demo_kit / "base_model")
    params = SamplingParams(max_tokens=12)
    want, got = Engine(plain, DecodeConfig(mode="causal")), Engine(ckpt, DecodeConfig(mode="self-spec"))
    for ids in _prompts(ckpt.tokenizer, 3, seed=1):
        assert got.generate(ids, params).tokens == want.generate(ids, params).tokens


def test_chain_weights_move_weight_within_a_micro_batch_but_keep_its_total():
    """The trainer divides by the fixed weights' sum over every micro-batch and rank, computed before the forward:
    a chain that changed a micro-batch's total weight would change its share of the step. With a unit loss per
    row, the micro-batch's loss is its fixed total over the global normaliser whatever the chain."""
    from train.loss import combine_losses, diffusion_weights

    cfg = BlockDiffusionConfig(bd_size=4, ar_loss_weight=0.0, clean_causal=True, prefix_gamma=2.0)
    rate, offset = torch.full((6,), 0.5), torch.tensor([0, 1, 2, 0, 1, 2])
    chain = torch.tensor([1.0, 0.5, 0.1, 1.0, 0.9, 0.8])
    fixed = diffusion_weights(rate, cfg, offset)
    norm = 3.0 * float(fixed.sum())  # this micro-batch is a third of the step
    parts = combine_losses(torch.ones(6), rate, torch.zeros(0), cfg, diff_norm=norm, diff_offset=offset, chain=chain)
    assert float(parts.loss) == pytest.approx(1 / 3, rel=1e-6)
    loss = torch.tensor([1.0, 2.0, 3.0, 1.0, 2.0, 3.0])
    weighted = combine_losses(loss, rate, torch.zeros(0), cfg, diff_norm=norm, diff_offset=offset, chain=chain)
    plain = combine_losses(loss, rate, torch.zeros(0), cfg, diff_norm=norm, diff_offset=offset)
    assert float(weighted.loss) < float(plain.loss)  # the chain moves weight off the later, costlier slots
