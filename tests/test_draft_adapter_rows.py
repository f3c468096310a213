"""A draft-only adapter computes its low-rank term at drafting rows only (issue 41): a forward with no
drafting row runs no LoRA product at all, one with some runs it on those rows alone, and what each row gets
is what peft's own LoRA forward gives there (drafting rows) or the base projection itself (the rest)."""

import copy

import pytest
import torch

from bdcore.draft_adapter import ADAPTER_NAME, LoraSpec, add_lora, draft_rows
from tests.test_draft_adapter import randomize_adapter
from tests.tiny import MASK_ID, tiny_model


def _adapted(draft_only=True):
    model = add_lora(tiny_model(), LoraSpec(rank=4, alpha=8, draft_only=draft_only), MASK_ID)
    randomize_adapter(model, seed=2)
    return model


def _lora_rows_seen(model):
    """Rows that reached each LoRA A projection, per forward call, in call order."""
    seen = []
    for name, module in model.named_modules():
        if name.endswith(f"lora_A.{ADAPTER_NAME}"):
            module.register_forward_hook(
                lambda m, args, out: seen.append(args[0].reshape(-1, args[0].shape[-1]).shape[0])
            )
    return seen


def _projections(model):
    return [m for m in model.modules() if hasattr(m, "lora_A") and ADAPTER_NAME in m.lora_A]


def test_a_forward_without_drafting_rows_runs_no_lora_product():
    model = _adapted()
    seen = _lora_rows_seen(model)
    ids = torch.randint(0, 90, (2, 9))
    with torch.no_grad(), draft_rows(model, torch.zeros_like(ids, dtype=torch.bool)):
        model(input_ids=ids)
    assert seen == []


def test_a_mixed_forward_runs_the_product_on_its_drafting_rows_only():
    model = _adapted()
    seen = _lora_rows_seen(model)
    ids = torch.randint(0, 90, (2, 9))
    rows = torch.zeros_like(ids, dtype=torch.bool)
    rows[0, 5:], rows[1, 7:] = True, True
    with torch.no_grad(), draft_rows(model, rows):
        model(input_ids=ids)
    assert seen and set(seen) == {int(rows.sum())}


@pytest.mark.parametrize("drafting", ["none", "some", "run", "all"])
def test_each_row_gets_peft_lora_or_the_base_projection(drafting):
    """Per projection, on random inputs: drafting rows equal peft's own LoRA forward (the same weights, an
    adapter that is not draft-only), the other rows equal the base layer's output bit for bit. "run": one
    sequence whose drafting rows follow its clean rows (a decode step's slice, added in place)."""
    gated, plain = _adapted(), _adapted(draft_only=False)
    x = torch.randn(1 if drafting == "run" else 3, 6, gated.config.hidden_size)
    rows = {
        "none": torch.zeros(3, 6, dtype=torch.bool),
        "all": torch.ones(3, 6, dtype=torch.bool),
        "run": torch.tensor([[False, False, True, True, True, True]]),
    }.get(drafting, torch.rand(3, 6, generator=torch.Generator().manual_seed(0)) < 0.4)
    for g, p in zip(_projections(gated), _projections(plain)):
        if g.in_features != x.shape[-1]:
            continue
        with torch.no_grad(), draft_rows(gated, rows):
            got = g(x)
        with torch.no_grad():
            lora, base = p(x), p.base_layer(x)
        assert torch.equal(got[~rows], base[~rows])
        torch.testing.assert_close(got[rows], lora[rows], atol=1e-6, rtol=1e-5)
        assert not torch.equal(lora[rows], base[rows]) or not rows.any(), "the adapter changes drafting rows"


def test_gradients_reach_the_adapter_from_drafting_rows_only():
    """Under grad a forward without drafting rows still gives the adapter zero gradients (not None: FSDP
    reduces every trainable parameter), and a mixed one the gradient of a plain LoRA restricted to its rows."""
    model = _adapted()
    proj = _projections(model)[0]
    x = torch.randn(2, 5, proj.in_features)
    for p in model.parameters():
        p.requires_grad_(False)
    weights = [proj.lora_A[ADAPTER_NAME].weight, proj.lora_B[ADAPTER_NAME].weight]
    for w in weights:
        w.requires_grad_(True)
    with draft_rows(model, torch.zeros(2, 5, dtype=torch.bool)):
        proj(x).sum().backward()
    assert all(w.grad is not None and not w.grad.any() for w in weights)
    rows = torch.zeros(2, 5, dtype=torch.bool)
    rows[1, 2:] = True
    for w in weights:
        w.grad = None
    with draft_rows(model, rows):
        proj(x).pow(2).sum().backward()
    got = [w.grad.clone() for w in weights]
    a, b = (copy.deepcopy(w.detach()).requires_grad_(True) for w in weights)
    scale = proj.scaling[ADAPTER_NAME]
    out = proj.base_layer(x[rows]) + x[rows] @ a.t() @ b.t() * scale
    out.pow(2).sum().backward()
    torch.testing.assert_close(got[0], a.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1], b.grad, atol=1e-5, rtol=1e-5)


def test_copies_keep_the_gated_forward():
    """Tests and the trainer deep-copy adapted models: the copy gates by its own switch."""
    model = copy.deepcopy(_adapted())
    seen = _lora_rows_seen(model)
    ids = torch.randint(0, 90, (1, 4))
    with torch.no_grad(), draft_rows(model, torch.zeros_like(ids, dtype=torch.bool)):
        model(input_ids=ids)
    assert seen == []


def test_a_served_bf16_model_drafts_with_fp32_factors_and_verifies_with_the_base():
    """`prepare_serving`: a bf16 model drafts with fp32 copies of its factors (a CPU's bf16 matmul costs ~5x
    fp32 at a decode step's few rows); drafting rows stay peft's LoRA (to bf16 rounding), the others the bf16
    base projection bit for bit; the trained weights themselves are left as they were."""
    from bdcore.draft_adapter_serving import prepare_serving

    gated, plain = _adapted(), _adapted(draft_only=False)
    gated.to(torch.bfloat16)
    prepare_serving(gated)
    assert all(p.dtype == torch.bfloat16 for p in gated.parameters())
    assert all(g._bd_served.b.dtype == torch.float32 for g in _projections(gated))
    x = torch.randn(1, 6, gated.config.hidden_size)
    rows = torch.tensor([[False, False, True, True, True, True]])
    for g, p in zip(_projections(gated), _projections(plain)):
        if g.in_features != x.shape[-1]:
            continue
        with torch.inference_mode(), draft_rows(gated, rows):
            got = g(x.bfloat16())
        with torch.no_grad():
            lora = p(x)
        assert got.dtype == torch.bfloat16
        assert torch.equal(got[~rows], g.base_layer(x.bfloat16())[~rows])
        torch.testing.assert_close(got[rows].float(), lora[rows], atol=0.05, rtol=0.02)


@pytest.mark.parametrize("drafting", ["run of 3", "run of 7", "scattered in a batch"])
def test_a_served_model_shares_the_products_of_one_input_and_keeps_each_projections_own(drafting):
    """A whole served forward (q/k/v share one input and one A product, o_proj beside them reads another, as
    gate/up and down do) equals the unprepared gated model's: at the drafting rows, and at the rows that attend
    to one, to rounding; at the rows before any drafting row of their sequence bit for bit (the same kernels
    on the same values). A shared product reused for a projection that reads another input, or columns taken
    from the wrong member, would be off by the size of the LoRA term. "scattered in a batch": three sequences
    draft (the second's last two rows are clean rows after its drafting rows: they see the drafting rows'
    keys, so they inherit their rounding, 2e-6 on an AMD EPYC and 0 on an Intel AMX machine), and the served
    path serves them itself: the general forward (the full LoRA in the model's dtype) cost a batch of 2 twice
    its forward."""
    from bdcore.draft_adapter_serving import prepare_serving

    gated = _adapted()
    served = copy.deepcopy(gated)
    prepare_serving(served)
    groups = {id(g._bd_served.group) for g in _projections(served)}
    assert len(groups) < len(_projections(served))  # some projections do share a product
    if drafting.startswith("run"):
        last = int(drafting.split()[-1])
        ids = torch.randint(0, 90, (1, 8))
        rows = torch.zeros_like(ids, dtype=torch.bool)
        rows[0, 8 - last :] = True
    else:
        ids = torch.randint(0, 90, (3, 8))
        rows = torch.zeros_like(ids, dtype=torch.bool)
        rows[0, 5:], rows[1, 2:6], rows[2, 7] = True, True, True
    with torch.inference_mode(), draft_rows(gated, rows):
        want = gated(input_ids=ids).logits
    with torch.inference_mode(), draft_rows(gated, torch.zeros_like(rows)):
        base = gated(input_ids=ids).logits
    seen = _lora_rows_seen(served)  # peft's own LoRA modules run only on the general path
    with torch.inference_mode(), draft_rows(served, rows):
        got = served(input_ids=ids).logits
    assert seen == []
    assert not torch.allclose(want[rows], base[rows], atol=1e-3)  # the adapter does act at drafting rows
    after = rows.cummax(dim=1).values  # a drafting row or a row that attends to one
    torch.testing.assert_close(got[after], want[after], atol=1e-4, rtol=1e-4)
    assert torch.equal(got[~after], want[~after])
    assert (after & ~rows).any() == drafting.startswith("scattered")  # the batch does have clean rows after drafts
