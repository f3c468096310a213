"""Packed bf16 linears (`bdcore.decode.packed_linear`): what a served bf16 model on the CPU runs its projections on.
They compute what `F.linear` computes (to bf16 rounding: oneDNN's own kernel, the weight reordered ahead), follow
their weight when it is written or replaced, leave gradients to `F.linear`, and `load_checkpoint` packs every
linear of a bf16 model (a draft adapter's base projections too) and nothing of an fp32 one."""

import types

import pytest
import torch
import torch.nn.functional as F

from bdcore.decode.packed_linear import PackedLinear, is_packed, pack_linears, packing_works
from bdcore.draft_adapter import draft_rows
from bdcore.loading import cpu_has_bf16, load_checkpoint
from benchmark.tiny import draft_checkpoint

ATOL = RTOL = 2e-2  # bf16 rounding of outputs of magnitude ~1-10


def _packed(linear: torch.nn.Linear) -> torch.nn.Linear:
    holder = torch.nn.Sequential(linear)
    assert pack_linears(holder) == 1
    return holder[0]


def test_packing_works_on_a_cpu_with_native_bf16():
    if not cpu_has_bf16():
        pytest.skip("no native bf16 here: the server serves fp32, which does not pack")
    assert packing_works(), "a CPU with native bf16 (CI's Xeon and EPYC both) runs the packed linear"


needs_packing = pytest.mark.skipif(not packing_works(), reason="this CPU or torch build runs no packed bf16 linear")


@needs_packing
@pytest.mark.parametrize("rows", [1, 2, 7, 16, 33, 130])
@pytest.mark.parametrize("bias", [True, False])
def test_a_packed_linear_computes_what_linear_computes(rows, bias):
    torch.manual_seed(rows)
    plain = torch.nn.Linear(96, 80, bias=bias).to(torch.bfloat16)
    w, b = plain.weight.detach().clone(), None if plain.bias is None else plain.bias.detach().clone()
    packed = _packed(plain)
    assert type(packed) is PackedLinear
    x = torch.randn(3, rows, 96).to(torch.bfloat16)
    with torch.inference_mode():
        got = packed(x)
    want = F.linear(x, w, b)
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), atol=ATOL, rtol=RTOL)


@needs_packing
def test_a_packed_linear_follows_its_weight_written_in_place_or_replaced():
    torch.manual_seed(0)
    packed = _packed(torch.nn.Linear(64, 48, bias=False).to(torch.bfloat16))
    x = torch.randn(4, 64).to(torch.bfloat16)
    with torch.no_grad():
        packed.weight.mul_(-2.0)  # in place: the weight's version moves on
    with torch.inference_mode():
        torch.testing.assert_close(packed(x).float(), F.linear(x, packed.weight).float(), atol=ATOL, rtol=RTOL)
    packed.weight = torch.nn.Parameter(torch.randn(48, 64).to(torch.bfloat16))  # replaced: another tensor
    with torch.inference_mode():
        torch.testing.assert_close(packed(x).float(), F.linear(x, packed.weight).float(), atol=ATOL, rtol=RTOL)


@needs_packing
def test_gradients_and_other_dtypes_run_plain_linear():
    torch.manual_seed(0)
    packed = _packed(torch.nn.Linear(32, 16).to(torch.bfloat16))
    x = torch.randn(2, 32).to(torch.bfloat16)
    y = packed(x)  # grad mode, the weight trains: the packed op has no backward
    assert y.grad_fn is not None
    y.float().sum().backward()
    assert packed.weight.grad is not None and packed.weight.grad.abs().sum() > 0
    packed.float()
    assert torch.equal(packed(x.float()), F.linear(x.float(), packed.weight, packed.bias))


@needs_packing
def test_another_device_runs_plain_linear():
    """A packed module moved off the CPU (here to `meta`, where no data exists) runs `F.linear` there, never
    its CPU packed copy."""
    packed = _packed(torch.nn.Linear(32, 16).to(torch.bfloat16)).to("meta")
    with torch.inference_mode():
        y = packed(torch.empty(2, 32, dtype=torch.bfloat16, device="meta"))
    assert y.device.type == "meta" and y.shape == (2, 16)


def test_fp32_models_are_left_plain():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8).to(torch.bfloat16))
    packed = pack_linears(model)
    assert type(model[0]) is torch.nn.Linear
    assert packed == (1 if packing_works() else 0) and is_packed(model) == packing_works()


def _linears(model):
    return [m for m in model.modules() if isinstance(m, torch.nn.Linear)]


@needs_packing
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_a_loaded_bf16_checkpoint_packs_every_linear_and_computes_what_the_plain_one_does(tmp_path, arch):
    """Dense and hybrid, with a draft adapter (its served projections run their base layer's packed forward):
    every row's logits, drafting rows and clean ones, equal the unpacked model's to bf16 rounding."""
    ckpt = draft_checkpoint(tmp_path / "draft", arch)
    packed = load_checkpoint(ckpt, dtype="bf16")
    plain = load_checkpoint(ckpt, dtype="bf16", packed=False)
    assert _linears(packed.model) and all(type(m) is PackedLinear for m in _linears(packed.model))
    assert not is_packed(plain.model)
    assert not is_packed(load_checkpoint(ckpt).model), "fp32 stays plain"
    ids = torch.tensor([[5, 9, 11, 3, packed.mask_id, packed.mask_id, packed.mask_id, 7]])
    drafting = ids == packed.mask_id
    logits = []
    for loaded in (packed, plain):
        with torch.inference_mode(), draft_rows(loaded.model, drafting):
            logits.append(loaded.model(input_ids=ids).logits.float())
    torch.testing.assert_close(logits[0], logits[1], atol=ATOL * 5, rtol=RTOL)
    assert (logits[0][drafting] - logits[0][~drafting][:3]).abs().max() > 0  # the rows differ: a real check


@needs_packing
def test_row_cost_measurements_of_packed_and_plain_models_are_kept_apart(tmp_path, monkeypatch):
    from bdcore.decode.policy import cost

    monkeypatch.setenv("BDSTACK_CACHE_DIR", str(tmp_path / "cache"))
    measured = []
    monkeypatch.setattr(
        cost, "calibrate", lambda runner: measured.append(1) or cost.ForwardCost({1: {1: float(len(measured))}})
    )
    (tmp_path / "ckpt").mkdir()
    plain = types.SimpleNamespace(
        model=torch.nn.Linear(4, 4).to(torch.bfloat16), device=torch.device("cpu"), compiled=None
    )
    packed = types.SimpleNamespace(
        model=torch.nn.Sequential(torch.nn.Linear(4, 4).to(torch.bfloat16)), device=plain.device, compiled=None
    )
    pack_linears(packed.model)
    assert cost.load_or_calibrate(plain, tmp_path / "ckpt").points == {1: {1: 1.0}}
    assert cost.load_or_calibrate(packed, tmp_path / "ckpt").points == {1: {1: 2.0}}, "measured again when packed"
    assert cost.load_or_calibrate(plain, tmp_path / "ckpt").points == {1: {1: 1.0}}
