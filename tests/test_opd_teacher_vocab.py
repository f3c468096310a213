"""OPD against a teacher whose vocabulary stops before `<|mask|>` (the base the student was converted
from: the student's output matrix grew a row for it): `train.opd._kl` compares the two id for id over
the teacher's vocabulary. The OPD tests distil from a copy of the student, whose vocabulary is the
student's, so reading the student's rows from the wrong end passed them. Checked on the AR rows against
plain causal forwards of both models."""

import copy

import pytest
import torch

from bdcore.loading import load_checkpoint
from tests.test_opd import _filler, _setup
from tests.tiny import tiny_checkpoint, tiny_model
from train.opd import opd_loss, teacher_logprobs


def _logp(model, ids, mask_id=None) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    if mask_id is not None:
        logits[:, mask_id] = float("-inf")
    return logits.log_softmax(-1)


def test_a_teacher_without_the_mask_row_is_compared_id_for_id(tmp_path):
    loaded = load_checkpoint(tiny_checkpoint(tmp_path, bd_size=4))
    teacher = tiny_model(vocab=len(loaded.tokenizer) - 1)  # the checkpoint's base, before <|mask|> was added
    V = teacher.get_output_embeddings().weight.shape[0]
    assert V == loaded.mask_id < loaded.model.get_output_embeddings().weight.shape[0]
    student = copy.deepcopy(loaded.model)
    with torch.no_grad():  # trained away from its base a little
        gen = torch.Generator().manual_seed(0)
        for p in student.parameters():
            p.add_(0.05 * p.norm() / p.numel() ** 0.5 * torch.randn(p.shape, generator=gen))
    _, chosen, lm = _setup(student, loaded)
    teacher_logp = teacher_logprobs(teacher, chosen, mask_id=loaded.mask_id)
    assert all(t.shape[-1] == V for t in teacher_logp)
    parts = opd_loss(lm, chosen, teacher_logp, mask_id=loaded.mask_id, filler_id=_filler(loaded), ar_weight=1.0)
    kls = []
    for ro in chosen:
        ids, P, n = ro.prompt_ids + ro.response, len(ro.prompt_ids), len(ro.response)
        t = _logp(teacher, ids)[P - 1 : P - 1 + n]
        s = _logp(student, ids, loaded.mask_id)[P - 1 : P - 1 + n, :V]
        kls.append((t.exp() * (t - s)).sum(-1))
    want = torch.cat(kls).mean()
    assert float(want) > 0.01, "the student has moved from its base (the rows are told apart)"
    assert float(parts.ar_kl) == pytest.approx(float(want), rel=1e-4)
