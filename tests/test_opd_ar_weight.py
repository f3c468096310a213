"""OPD's objective is the KL at the revisited canvas slots plus `ar_weight` times the KL on the clean
stream's AR rows (`train.opd.opd_loss`), in its value and in its gradient. The OPD tests use a student
whose clean stream is the teacher (AR-row KL 0), so a loss that ignored `ar_weight` passed them; here
the student has moved away from the teacher everywhere."""

import copy

import pytest
import torch

from bdcore.loading import load_checkpoint
from tests.test_opd import _filler, _setup
from tests.tiny import tiny_checkpoint
from train.opd import opd_loss, teacher_logprobs


def test_the_ar_rows_kl_enters_the_loss_and_its_gradient_by_its_weight(tmp_path):
    loaded = load_checkpoint(tiny_checkpoint(tmp_path, bd_size=4))
    student = copy.deepcopy(loaded.model)
    with torch.no_grad():  # the student's AR head too differs from the teacher's
        gen = torch.Generator().manual_seed(0)
        for p in student.parameters():
            p.add_(0.05 * p.norm() / p.numel() ** 0.5 * torch.randn(p.shape, generator=gen))
    _, chosen, lm = _setup(student, loaded)
    teacher_logp = teacher_logprobs(loaded.model, chosen, mask_id=loaded.mask_id)
    parts, grads = {}, {}
    for w in (0.0, 0.3, 1.0):
        lm.zero_grad(set_to_none=True)
        parts[w] = opd_loss(lm, chosen, teacher_logp, mask_id=loaded.mask_id, filler_id=_filler(loaded), ar_weight=w)
        parts[w].loss.backward()
        grads[w] = [p.grad.clone() for p in lm.parameters()]
    kl, ar_kl = float(parts[0.0].kl), float(parts[0.0].ar_kl)
    assert kl > 0.01 and ar_kl > 0.01, "both terms are non-zero (the test can tell them apart)"
    for w, part in parts.items():
        assert float(part.kl) == pytest.approx(kl, rel=1e-5) and float(part.ar_kl) == pytest.approx(ar_kl, rel=1e-5)
        assert float(part.loss) == pytest.approx(kl + w * ar_kl, rel=1e-5)
    # linear in the weight: grad(0.3) = grad(0) + 0.3 * (grad(1) - grad(0)), and the AR rows move the weights
    for g0, g3, g1 in zip(grads[0.0], grads[0.3], grads[1.0]):
        torch.testing.assert_close(g3, g0 + 0.3 * (g1 - g0), atol=1e-6, rtol=1e-4)
    assert any(not torch.allclose(g0, g1) for g0, g1 in zip(grads[0.0], grads[1.0]))
