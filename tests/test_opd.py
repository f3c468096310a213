"""On-policy distillation: the loss is a KL at the revisited committed slots (and the AR rows), zero when
the student's distributions equal the teacher's, and gradients reach the student only through its
training forward (the rollout and the teacher are stop-gradient)."""

import copy

import pytest
import torch

from bdcore.decode.config import DecodeConfig
from bdcore.decode.sampling import SamplingParams
from bdcore.loading import load_checkpoint
from bdcore.tokens import end_of_turn_id, filler_id
from tests.test_invariant_4_self_spec import _prompts
from tests.tiny import tiny_checkpoint
from train.config import BlockDiffusionConfig
from train.model import TwoStreamLM
from train.opd import choose_states, opd_loss, teacher_logprobs
from train.rollout import rollout


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return load_checkpoint(tiny_checkpoint(tmp_path_factory.mktemp("opd"), bd_size=4))


def _setup(model, loaded, *, per_block=1, seed=0):
    sc = loaded.sidecar
    rollouts = rollout(
        model,
        _prompts(loaded.tokenizer, 3, seed=4),
        caps=loaded.capabilities,
        decode=DecodeConfig(mode="diffusion", threshold=0.3),
        params=SamplingParams(max_tokens=14),
    )
    gen = torch.Generator().manual_seed(seed)
    chosen = [choose_states(r, per_block, gen) for r in rollouts]
    cfg = BlockDiffusionConfig(bd_size=sc.bd_size, ar_loss_weight=0.2)
    return rollouts, chosen, TwoStreamLM(model, cfg)


def _filler(loaded):
    return filler_id(loaded.tokenizer, end_of_turn_id(loaded.tokenizer))


def test_kl_is_taken_at_the_committed_slots_of_the_chosen_states(loaded):
    student = copy.deepcopy(loaded.model)
    rollouts, chosen, lm = _setup(student, loaded)
    teacher_logp = teacher_logprobs(loaded.model, chosen, mask_id=loaded.mask_id)
    parts = opd_loss(lm, chosen, teacher_logp, mask_id=loaded.mask_id, filler_id=_filler(loaded), ar_weight=0.1)
    expected = 0
    for full, ro in zip(rollouts, chosen):
        end = len(ro.prompt_ids) + len(ro.response)
        canvases = [s for s in ro.steps if s.canvas is not None]
        assert len({s.start for s in canvases}) == len(canvases), "one state per block"
        assert {s.start for s in canvases} == {s.start for s in full.steps if s.canvas is not None}
        expected += sum(1 for s in canvases for slot in s.slots if s.start + slot < end)
    assert parts.kl_tokens == expected > 0
    assert parts.ar_tokens == sum(len(r.response) for r in chosen)
    assert parts.kl > 0.01  # the student (an unconverted copy) drafts unlike the AR teacher ...
    assert float(parts.ar_kl) == pytest.approx(0.0, abs=1e-5)  # ... but its clean stream is the teacher


def test_kl_is_zero_when_the_student_equals_the_teacher(loaded):
    """A model whose final norm is zero and whose output layer has a bias gives the same distribution at
    every row, so its canvas rows and its AR rows agree with a teacher that is the same model."""
    teacher = copy.deepcopy(loaded.model)
    head = teacher.get_output_embeddings()
    biased = torch.nn.Linear(head.in_features, head.out_features, bias=True)
    with torch.no_grad():
        teacher.get_decoder().norm.weight.zero_()
        biased.weight.copy_(head.weight)
        biased.bias.copy_(torch.randn(head.out_features, generator=torch.Generator().manual_seed(0)))
        biased.bias[sorted(loaded.stop_ids)] = -10.0  # answers run on, with canvas commits
    teacher.lm_head = biased
    student = copy.deepcopy(teacher)
    _, chosen, lm = _setup(student, loaded, per_block=0)
    teacher_logp = teacher_logprobs(teacher, chosen, mask_id=loaded.mask_id)
    parts = opd_loss(lm, chosen, teacher_logp, mask_id=loaded.mask_id, filler_id=_filler(loaded), ar_weight=0.5)
    assert parts.kl_tokens > 0
    assert float(parts.kl) == pytest.approx(0.0, abs=1e-6) and float(parts.ar_kl) == pytest.approx(0.0, abs=1e-6)
    # ... and it is the distributions that make it zero: another teacher's bias gives a positive KL
    other = copy.deepcopy(teacher)
    with torch.no_grad():
        other.lm_head.bias.add_(torch.randn(head.out_features, generator=torch.Generator().manual_seed(1)))
    parts = opd_loss(
        lm,
        chosen,
        teacher_logprobs(other, chosen, mask_id=loaded.mask_id),
        mask_id=loaded.mask_id,
        filler_id=_filler(loaded),
        ar_weight=0.5,
    )
    assert float(parts.kl) > 0.1 and float(parts.ar_kl) > 0.1


def test_gradients_come_only_from_the_students_training_forward(loaded):
    student, teacher = copy.deepcopy(loaded.model), copy.deepcopy(loaded.model)
    rollouts, chosen, lm = _setup(student, loaded)
    assert all(p.grad is None for p in student.parameters()), "the rollout left no gradient"
    teacher_logp = teacher_logprobs(teacher, chosen, mask_id=loaded.mask_id)
    assert not any(t.requires_grad for t in teacher_logp)
    parts = opd_loss(lm, chosen, teacher_logp, mask_id=loaded.mask_id, filler_id=_filler(loaded), ar_weight=0.1)
    parts.loss.backward()
    assert all(p.grad is None for p in teacher.parameters())
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in student.parameters())
    # The same loss from detached copies of everything the rollout and teacher produced gives the same
    # gradient: nothing else is in the graph.
    grads = [p.grad.clone() for p in student.parameters()]
    student.zero_grad(set_to_none=True)
    again = opd_loss(
        lm,
        copy.deepcopy(chosen),
        [t.clone() for t in teacher_logp],
        mask_id=loaded.mask_id,
        filler_id=_filler(loaded),
        ar_weight=0.1,
    )
    again.loss.backward()
    for g, p in zip(grads, student.parameters()):
        torch.testing.assert_close(p.grad, g)


def test_chosen_states_are_reproducible(loaded):
    rollouts, _, _ = _setup(copy.deepcopy(loaded.model), loaded)
    pick = [[choose_states(r, 1, torch.Generator().manual_seed(7)).steps for r in rollouts] for _ in range(2)]
    assert pick[0] == pick[1]


@pytest.mark.parametrize("slots", ["committed", "masked"])
def test_kl_equals_an_independent_computation_slot_by_slot(loaded, slots):
    """Each revisited slot's KL, recomputed from a plain forward of [prompt, answer before the block, the
    canvas the state saw] (the student) and a plain causal forward of [prompt, answer] (the teacher). The
    slots: those the state committed, or every one it still masked (those it committed and those it left
    for later steps)."""
    from tests.test_invariant_2_noised_blocks import single_stream_reference
    from train.rows import Sample

    reference_student = copy.deepcopy(loaded.model)
    _, chosen, lm = _setup(copy.deepcopy(loaded.model), loaded)
    teacher = copy.deepcopy(loaded.model)
    parts = opd_loss(
        lm, chosen, teacher_logprobs(teacher, chosen, mask_id=loaded.mask_id), mask_id=loaded.mask_id,
        filler_id=_filler(loaded), ar_weight=0.0, slots=slots,
    )  # fmt: skip

    def banned_logp(logits):
        logits = logits.float().clone()
        logits[..., loaded.mask_id] = float("-inf")
        return logits.log_softmax(-1)

    kls, later = [], 0
    with torch.no_grad():
        for ro in chosen:
            P, ids = len(ro.prompt_ids), ro.prompt_ids + ro.response
            teacher_rows = banned_logp(teacher(input_ids=torch.tensor([ids])).logits[0])
            sample = Sample(ids, [(P, len(ids))])
            for step in ro.steps:
                if step.canvas is None:
                    continue
                student_rows = banned_logp(
                    single_stream_reference(reference_student, sample, step.start, step.canvas, 4, True, False)
                )
                if slots == "masked":
                    revisit = [s for s in range(1, len(step.canvas)) if step.canvas[s] == loaded.mask_id]
                    later += len(set(revisit) - set(step.slots))
                else:
                    revisit = step.slots
                for s in revisit:
                    if step.start + s >= len(ids):
                        continue
                    t, q = teacher_rows[step.start + s - 1], student_rows[s - 1]
                    p = t.exp()
                    kls.append(float(torch.where(p > 0, p * (t - q), torch.zeros_like(p)).sum()))
    assert parts.kl_tokens == len(kls) > 0
    assert float(parts.kl) == pytest.approx(sum(kls) / len(kls), rel=1e-4, abs=1e-5)
    assert later > 0 if slots == "masked" else later == 0  # the states left slots masked for later steps


def test_a_draft_adapters_clean_stream_is_the_teacher(loaded):
    """With a draft-only adapter the student's clean stream is the base model: the targets it gives in the
    same forward (teacher None) are the base model's causal distributions."""
    from tests.test_draft_adapter import adapted

    base = copy.deepcopy(loaded.model)
    student = adapted(copy.deepcopy(loaded.model), mask_id=loaded.mask_id)
    _, chosen, lm = _setup(student, loaded, per_block=0)
    kwargs = dict(mask_id=loaded.mask_id, filler_id=_filler(loaded), ar_weight=1.0, slots="masked")
    free = opd_loss(lm, chosen, None, **kwargs)
    with_base = opd_loss(lm, chosen, teacher_logprobs(base, chosen, mask_id=loaded.mask_id), **kwargs)
    assert free.kl_tokens == with_base.kl_tokens > 0
    assert float(free.kl) == pytest.approx(float(with_base.kl), rel=1e-4) and float(free.kl) > 0.01
    assert float(free.ar_kl) == 0.0 and float(with_base.ar_kl) == pytest.approx(0.0, abs=1e-5)
    for a, b in zip(free.teacher_logp, with_base.teacher_logp):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
