"""Draft-OPD (`train/draft_opd.py`): self-spec rollouts record every verify; a training forward revisits each
verify's canvas exactly (it drafts what the rollout drafted); the loss is the forward KL from the verifier's
row at every accepted slot and the reverse KL at the first rejected one, against an independent slow
computation (teacher from a separate frozen model, by hand); its gradient reaches the drafter only; a
draft adapter continues from the checkpoint it was trained in."""

import copy
import dataclasses

import pytest
import torch
from safetensors.torch import load_file

from bdcore.decode.config import DecodeConfig
from bdcore.decode.modes import CommitStep
from bdcore.decode.runner import ModelRunner
from bdcore.decode.sampling import SamplingParams
from bdcore.draft_adapter import ADAPTER_DIR, LoraSpec, add_lora
from bdcore.loading import load_checkpoint
from bdcore.tokens import end_of_turn_id, filler_id
from benchmark.tiny import draft_checkpoint, randomize_adapter
from tests.test_invariant_4_self_spec import _prompts
from tests.tiny import tiny_checkpoint
from train.build import continue_draft_adapter
from train.config import BlockDiffusionConfig, FlagError
from train.draft_opd import draft_opd_loss, verify_states, walk_verdicts, walked_rollouts
from train.model import TwoStreamLM
from train.rollout import rollout
from train.rows import Sample
from train.trajectory import trajectory_rows


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return load_checkpoint(tiny_checkpoint(tmp_path_factory.mktemp("dopd"), bd_size=4))


def _biased(model, stop_ids):
    """A model whose output layer has a bias strong enough that drafts and the AR head agree now and then:
    verifies with every count of accepted drafts, rejections included."""
    model = copy.deepcopy(model)
    head = model.get_output_embeddings()
    biased = torch.nn.Linear(head.in_features, head.out_features, bias=True)
    with torch.no_grad():
        biased.weight.copy_(head.weight)
        biased.bias.copy_(2.0 * torch.randn(head.out_features, generator=torch.Generator().manual_seed(0)))
        biased.bias[sorted(stop_ids)] = -10.0  # answers run to max_tokens
    model.lm_head = biased
    return model


def _filler(loaded):
    return filler_id(loaded.tokenizer, end_of_turn_id(loaded.tokenizer))


def _setup(loaded, *, adapter=True, max_tokens=22):
    base = _biased(loaded.model, loaded.stop_ids)
    student = copy.deepcopy(base)
    if adapter:
        add_lora(student, LoraSpec(rank=4, alpha=8), loaded.mask_id)
        randomize_adapter(student, 0)
    rollouts = rollout(
        student,
        _prompts(loaded.tokenizer, 3, seed=4),
        caps=loaded.capabilities,
        decode=DecodeConfig(mode="self-spec"),
        params=SamplingParams(max_tokens=max_tokens),
    )
    cfg = BlockDiffusionConfig(
        bd_size=loaded.sidecar.bd_size, ar_loss_weight=0.0 if adapter else 0.2, clean_causal=True
    )
    return base, rollouts, TwoStreamLM(student, cfg, mask_id=loaded.mask_id)


def test_verdicts_follow_the_answer(loaded):
    _, rollouts, _ = _setup(loaded)
    counts = [v.accepted for ro in rollouts for v in ro.verdicts]
    assert 0 in counts and 3 in counts and {1, 2} & set(counts), "rejections and acceptances both happen"
    for ro in rollouts:
        P, resp = len(ro.prompt_ids), ro.response
        assert ro.verdicts and ro.verdicts[0].start == P  # the prefill drafted at the first answer token's place
        for v, after in zip(ro.verdicts, ro.verdicts[1:] + [None]):
            at = v.start + 1 - P  # the first drafted position, in the answer
            inside = min(v.accepted, len(resp) - at)  # an answer cut at max_tokens drops what is past it
            assert v.drafts[:inside] == resp[at : at + inside]
            if v.accepted < v.verified and at + v.accepted < len(resp):
                assert v.drafts[v.accepted] != resp[at + v.accepted]  # the AR head's correction replaced it
            if after is not None:  # a rejection leaves stale drafts: a cold step drafts one place further on
                assert after.start == v.start + v.accepted + 1 + (v.accepted < v.verified)


def test_a_training_forward_drafts_what_the_rollout_drafted(loaded):
    """Each verify's canvas, revisited in the training row (its masks at its place, the answer before it),
    drafts the rollout's tokens at every slot inside the answer: the state is the one the drafts came from."""
    _, rollouts, lm = _setup(loaded)
    states, drafted = [], []
    for ro in rollouts:
        end = len(ro.prompt_ids) + len(ro.response)
        steps = []
        for v in ro.verdicts:
            slots = [s for s in range(1, len(v.drafts) + 1) if v.start + s < end]
            steps.append(CommitStep(v.start, [loaded.mask_id] * v.canvas, slots, [0] * len(slots), []))
            drafted += [v.drafts[s - 1] for s in slots]
        states.append(dataclasses.replace(ro, steps=steps))
    scored = trajectory_rows(states, block=lm.cfg.bd_size, filler_id=_filler(loaded))
    with torch.no_grad():
        logits = lm(scored.batch, rows=scored.rows)
    logits[:, loaded.mask_id] = float("-inf")
    assert len(drafted) > 30
    assert logits.argmax(-1).tolist() == drafted


def _reference(base, student_lm, rollouts, loaded, reject_weight):
    """The loss slot by slot: the verifier from a separate frozen model's causal forward over [prompt, answer]
    (no grad), the drafter from the training row of each verify's canvas, the KLs written out."""
    mask = loaded.mask_id
    terms = []
    for ro in rollouts:
        P, resp = len(ro.prompt_ids), ro.response
        with torch.no_grad():
            teacher = base(input_ids=torch.tensor([ro.prompt_ids + resp])).logits[0].float()
        teacher[:, mask] = float("-inf")
        for v in ro.verdicts:
            slots = [s for s in range(1, v.verified + 1) if s <= v.accepted + 1 and v.start + s < P + len(resp)]
            if not slots:
                continue
            step = CommitStep(v.start, [mask] * v.canvas, slots, [0] * len(slots), [])
            scored = trajectory_rows([dataclasses.replace(ro, steps=[step])], block=4, filler_id=_filler(loaded))
            drafter = student_lm(scored.batch, rows=scored.rows)
            drafter[:, mask] = float("-inf")
            real = torch.arange(drafter.shape[-1]) != mask  # <|mask|> has no mass on either side
            for row, s in zip(drafter.log_softmax(-1), slots):
                p = teacher[v.start + s - 1].log_softmax(-1)  # the row that predicts position start + s
                q, p = row[real], p[real]
                if s <= v.accepted:
                    terms.append((p.exp() * (p - q)).sum())
                else:
                    terms.append(reject_weight * (q.exp() * (q - p)).sum())
    return torch.stack(terms).sum() / len(terms), len(terms)


@pytest.mark.parametrize("reject_weight", [1.0, 0.25])
def test_loss_equals_an_independent_computation(loaded, reject_weight):
    base, rollouts, lm = _setup(loaded)
    kwargs = dict(mask_id=loaded.mask_id, filler_id=_filler(loaded), reject_weight=reject_weight)
    parts = draft_opd_loss(lm, rollouts, **kwargs)
    want, n = _reference(base, lm, rollouts, loaded, reject_weight)
    assert parts.accepted_slots > 10 and parts.rejected_slots > 5
    assert parts.accepted_slots + parts.rejected_slots == n
    torch.testing.assert_close(parts.loss, want, rtol=1e-5, atol=1e-6)
    assert float(parts.kl) > 0.01 and float(parts.reverse_kl) > 0.01


def test_gradients_reach_the_drafter_only(loaded):
    """A full fine-tune (no adapter): the verifier rows come from the same forward and parameters as the
    drafter; detached, the gradient equals the reference's, whose verifier is a frozen copy."""
    base, rollouts, lm = _setup(loaded, adapter=False)
    kwargs = dict(mask_id=loaded.mask_id, filler_id=_filler(loaded))
    draft_opd_loss(lm, rollouts, **kwargs).loss.backward()
    got = [p.grad.clone() for p in lm.parameters()]
    lm.zero_grad(set_to_none=True)
    want, _ = _reference(copy.deepcopy(lm.model), lm, rollouts, loaded, 1.0)
    want.backward()
    assert any(g.abs().sum() > 0 for g in got)
    for g, p in zip(got, lm.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-6)


def test_a_frozen_teachers_ar_term_is_added(loaded):
    base, rollouts, lm = _setup(loaded, adapter=False)
    kwargs = dict(mask_id=loaded.mask_id, filler_id=_filler(loaded))
    plain = draft_opd_loss(lm, rollouts, **kwargs)
    teacher_logp = []
    for ro in rollouts:
        with torch.no_grad():
            logits = loaded.model(input_ids=torch.tensor([ro.prompt_ids + ro.response])).logits[0].float()
        logits[:, loaded.mask_id] = float("-inf")
        P = len(ro.prompt_ids)
        teacher_logp.append(logits[P - 1 : P - 1 + len(ro.response)].log_softmax(-1))
    both = draft_opd_loss(lm, rollouts, **kwargs, teacher_logp=teacher_logp, ar_weight=0.5)
    assert float(both.ar_kl) > 0.01  # the biased student's AR head is not the unbiased teacher's
    torch.testing.assert_close(both.loss, plain.loss + 0.5 * both.ar_kl, rtol=1e-5, atol=1e-6)


def test_verify_states_score_the_accepted_slots_and_the_first_rejection(loaded):
    _, rollouts, _ = _setup(loaded)
    for ro in rollouts:
        states, rejected = verify_states(ro, loaded.mask_id)
        end = len(ro.prompt_ids) + len(ro.response)
        flags = iter(rejected)
        for v, st in zip([v for v in ro.verdicts if v.start + 1 < end], states):
            assert st.start == v.start and st.canvas == [loaded.mask_id] * v.canvas
            want = [s for s in range(1, min(v.accepted + 1, v.verified) + 1) if v.start + s < end]
            assert st.slots == want
            assert [next(flags) for _ in want] == [s > v.accepted for s in want]
        assert next(flags, None) is None


def test_a_draft_adapter_continues_from_its_checkpoint(tmp_path):
    ckpt = draft_checkpoint(tmp_path / "sft")
    loaded = load_checkpoint(ckpt)
    model = copy.deepcopy(load_checkpoint(tiny_checkpoint(tmp_path / "plain", bd_size=4)).model)
    spec = LoraSpec(rank=4, alpha=8)
    add_lora(model, spec, loaded.mask_id)
    continue_draft_adapter(model, str(ckpt), spec)
    saved = load_file(str(ckpt / ADAPTER_DIR / "adapter_model.safetensors"))
    mine = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    assert len(mine) == len(saved) > 0
    for key, value in saved.items():
        ours = [v for k, v in mine.items() if k.replace(".default", "") == key]
        assert len(ours) == 1 and torch.equal(ours[0], value), key
    with pytest.raises(FlagError, match="pass --lora_rank 4 --lora_alpha 8"):
        continue_draft_adapter(copy.deepcopy(model), str(ckpt), LoraSpec(rank=8, alpha=16))


def test_the_walk_replays_the_decoders_verifies_by_hand():
    # N 4, answer positions [10, 22): anchor 10 (the prefill's canvas of 4) accepts all 3 and drafts on; 14
    # accepts 1, so a cold step puts the next canvas at 17; 17 accepts none (cold again: 19); 19 reaches the end
    accepted = {10: 3, 14: 1, 17: 0, 19: 2}
    table = [accepted.get(a, -100) for a in range(10, 22)]
    got = [(v.start, v.canvas, v.verified, v.accepted) for v in walk_verdicts(table, 10, 22, 4)]
    assert got == [(10, 4, 3, 3), (14, 3, 3, 1), (17, 3, 3, 0), (19, 3, 3, 2)]


def test_the_walk_makes_the_verifies_the_decoder_makes(loaded):
    """Along the model's own greedy answers, the walk (one scoring forward a sample) gives the verifies the
    served self-spec decoder made while decoding them."""
    _, rollouts, lm = _setup(loaded)
    eot = end_of_turn_id(loaded.tokenizer)
    samples = []
    for ro in rollouts:  # the decoded answers as dataset samples, closed by the end-of-turn token
        P = len(ro.prompt_ids)
        samples.append(Sample(ro.prompt_ids + ro.response + [eot], [(P, P + len(ro.response) + 1)]))
    runner = ModelRunner.for_checkpoint(lm.model, loaded.capabilities)
    walked = walked_rollouts(runner, samples, mask_id=loaded.mask_id, draft_len=lm.cfg.bd_size)
    compared = 0
    for ro, w in zip(rollouts, walked):
        assert w.prompt_ids == ro.prompt_ids and w.response == ro.response + [eot]
        end = len(ro.prompt_ids) + len(ro.response)  # the decode was cut there: compare verifies inside it

        def inside(verdicts, end=end):
            return [(v.start, v.canvas, v.verified, v.accepted) for v in verdicts if v.start + v.verified < end]

        assert inside(w.verdicts) == inside(ro.verdicts)
        compared += len(inside(ro.verdicts))
    assert compared > 10
