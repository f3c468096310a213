"""Linear layers whose bf16 weights are laid out once for the CPU's matmul kernels (`pack_linears`).

A bf16 `F.linear` on a CPU hands oneDNN a plain row-major weight, and oneDNN reorders it into its blocked
(VNNI / AMX tile) layout on every call: at the few rows of a decode forward that reorder is most of the
matmul. On SmolLM2-135M (2-core Xeon with AMX, one thread) a 576 x 1536 projection took ~185 us at 1-16 rows
and ~110 us with the weight reordered once (`torch.ops.mkldnn._reorder_linear_weight`, the layout PyTorch's
own compiler freezes weights into), and a whole decode forward 1.13-1.27x less (1-64 rows, 2 threads), its
logits bit for bit the same. fp32 gains nothing there (MKL's packed sgemm measured even), so only
bf16 packs.

The packed copy is a cache of the weight, never its owner: the parameter stays as it was (state dicts,
adapters and merges read it), a forward with gradients or another dtype or device runs `F.linear`, and a
weight replaced or written in place since it was packed is packed again before it is used.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

ROWS_HINT = 16  # the row count oneDNN picks the packed layout for; any row count runs on it


@functools.cache
def packing_works() -> bool:
    """Whether this torch build and CPU run a packed bf16 linear, and it computes what `F.linear` computes."""
    try:
        ops = torch.ops.mkldnn
        if not torch.backends.mkldnn.is_available():
            return False
        g = torch.Generator().manual_seed(0)
        w = torch.randn(32, 64, generator=g).to(torch.bfloat16)
        b = torch.randn(32, generator=g).to(torch.bfloat16)
        x = torch.randn(2, 3, 64, generator=g).to(torch.bfloat16)
        got = ops._linear_pointwise(x, ops._reorder_linear_weight(w, ROWS_HINT), b, "none", [], "")
        return bool(torch.allclose(got.float(), F.linear(x, w, b).float(), rtol=2e-2, atol=2e-2))
    except (RuntimeError, AttributeError):  # no oneDNN, no such op in this build, no bf16 on this CPU
        return False


@torch.library.custom_op("bdstack::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """The packed matmul as an op of its own, for compiled forwards: inductor lowers oneDNN's linear only over
    weights it froze itself (its lowering asserts the weight is a graph constant), so a compiled step calls this
    one as it is instead."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@packed_linear.register_fake
def _(x, packed, bias, out_features):
    return x.new_empty((*x.shape[:-1], out_features))


class PackedLinear(torch.nn.Linear):
    """An `nn.Linear` (its class swapped in place by `pack_linears`) that runs inference on its packed weight."""

    _packed: tuple | None = None  # (the weight it was made from, that weight's version, the packed tensor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if (
            x.dtype is not torch.bfloat16
            or w.dtype is not torch.bfloat16
            or not (x.is_cpu and w.is_cpu)
            or (torch.is_grad_enabled() and (w.requires_grad or x.requires_grad))  # the packed op has no backward
        ):
            return F.linear(x, w, self.bias)
        if torch.compiler.is_compiling() and self._packed is not None:
            # Only the serving engine compiles (compiled_step.py), and it never changes a weight: the pack made
            # at load is the weight's (a version check here would break the graph at every linear).
            return packed_linear(x, self._packed[2], self.bias, self.out_features)
        packed = self._packed
        if packed is None or packed[0] is not w or packed[1] != w._version:
            packed = self._packed = _pack(w)
        return torch.ops.mkldnn._linear_pointwise(x, packed[2], self.bias, "none", [], "")


def _pack(w: torch.Tensor) -> tuple:
    """`PackedLinear._packed` for weight `w`: the weight, its version now, its packed copy."""
    return w, w._version, torch.ops.mkldnn._reorder_linear_weight(w.detach(), ROWS_HINT)


def pack_linears(model: torch.nn.Module) -> int:
    """Turn every plain `nn.Linear` of a bf16 model on the CPU into a `PackedLinear` (weights packed now, not at
    the first forward) and return how many; none where packing does not work here (`packing_works`) or the
    model is not a CPU bf16 one. A draft adapter's base projections are plain linears and pack too."""
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    if not linears or not packing_works():
        return 0
    count = 0
    for m in linears:
        if m.weight.dtype is torch.bfloat16 and m.weight.is_cpu:
            m.__class__ = PackedLinear
            m._packed = _pack(m.weight)
            count += 1
    return count


def is_packed(model: torch.nn.Module) -> bool:
    return any(isinstance(m, PackedLinear) for m in model.modules())
