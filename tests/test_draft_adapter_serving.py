"""A served draft adapter cut to the directions that carry its energy (`truncate_adapter`): the cut is the
best approximation of its rank, the served path leaves the cut directions out, and what is served is the
cut adapter's forward (drafting rows) and the base's (every other row)."""

import copy

import pytest
import torch

from bdcore.draft_adapter import ADAPTER_NAME, LoraSpec, add_lora, draft_rows
from bdcore.draft_adapter_serving import prepare_serving, truncate_adapter
from tests.test_draft_adapter import randomize_adapter
from tests.tiny import MASK_ID, tiny_model


def _adapted():
    model = add_lora(tiny_model(), LoraSpec(rank=4, alpha=8), MASK_ID)
    randomize_adapter(model, seed=3)
    return model


def _terms(model):
    return {
        n: (m.lora_B[ADAPTER_NAME].weight @ m.lora_A[ADAPTER_NAME].weight).detach().double()
        for n, m in model.named_modules()
        if hasattr(m, "lora_A") and ADAPTER_NAME in m.lora_A
    }


@pytest.mark.parametrize("energy", [0.5, 0.9, 0.99])
def test_the_cut_keeps_the_fewest_directions_that_carry_the_energy_and_is_the_best_of_its_rank(energy):
    model = _adapted()
    before = _terms(model)
    kept = truncate_adapter(model, energy)
    after = _terms(model)
    assert set(kept) == set(before)
    for name, term in before.items():
        s = torch.linalg.svdvals(term)
        share = (s**2).cumsum(0) / (s**2).sum()
        r = kept[name]
        assert share[r - 1] >= energy - 1e-9 and (r == 1 or share[r - 2] < energy)
        # Eckart-Young: the best rank-r approximation's error is the energy of the dropped directions
        err = torch.linalg.matrix_norm(term - after[name]) ** 2
        torch.testing.assert_close(err, (s[r:] ** 2).sum(), rtol=1e-4, atol=1e-8)
        assert torch.linalg.matrix_rank(after[name].float(), rtol=1e-5) == r
    if energy <= 0.9:
        assert min(kept.values()) < 4  # the random adapter is cut somewhere


def test_energy_one_keeps_the_adapter_and_nonsense_is_refused():
    model = _adapted()
    before = {k: v.clone() for k, v in model.state_dict().items() if "lora_" in k}
    assert truncate_adapter(model, 1.0) == {}
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    for bad in (0.0, 1.5, -1):
        with pytest.raises(ValueError, match="energy"):
            truncate_adapter(model, bad)


def test_a_served_cut_adapter_drafts_as_the_cut_adapter_with_only_its_kept_directions():
    gated = _adapted()
    kept = truncate_adapter(gated, 0.9)
    served = copy.deepcopy(gated)
    prepare_serving(served)
    projections = {n: m for n, m in served.named_modules() if hasattr(m, "_bd_served")}
    assert {n: p._bd_served.b.shape[0] for n, p in projections.items()} == kept
    ids = torch.randint(0, 90, (1, 8))
    rows = torch.zeros_like(ids, dtype=torch.bool)
    rows[0, 3:] = True
    with torch.inference_mode(), draft_rows(gated, rows):
        want = gated(input_ids=ids).logits
    with torch.inference_mode(), draft_rows(served, rows):
        got = served(input_ids=ids).logits
    torch.testing.assert_close(got[rows], want[rows], atol=1e-4, rtol=1e-4)
    assert torch.equal(got[~rows], want[~rows])
