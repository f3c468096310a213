"""Comparing two fp32 computations of the same function, the way tests/README.md ("Tolerances") says.

Two fp32 paths that are equal in exact arithmetic (a cached and a joint forward, a chunked and a plain
loss) differ by rounding, and how much depends on summation order, the kernels the CPU picks (MKL and
oneDNN choose by ISA, thread count and alignment) and how strongly the function amplifies a rounding
error. A fixed `atol` guesses all three; it passed on AMD and failed on Intel AMX for the same test
(issue 40). The fp64 evaluation of the same function is the truth both paths approximate: the path under
test must be about as close to it as the reference path is. A real defect (a wrong key seen, a row
dropped, a gate left on) moves the result by far more than rounding and still fails.
"""

from __future__ import annotations

import torch

EPS32 = torch.finfo(torch.float32).eps


def rounding_error(value: torch.Tensor, truth: torch.Tensor) -> float:
    return float((value.detach().double() - truth.detach().double()).abs().max())


def assert_as_close_to_truth(
    tested: torch.Tensor,
    reference: torch.Tensor,
    truth: torch.Tensor,
    what: str,
    *,
    slack: float = 4.0,
    floor_ulps: float = 64.0,
) -> None:
    """`tested` (fp32) is within `slack` times the fp32 `reference` path's own error from `truth` (fp64), plus
    `floor_ulps` fp32 ulps of the truth's largest magnitude (when the reference happens to round exactly); and
    the other way round: a reference path far off the truth is a defect too, which a bound scaled by its
    error would hide (issue 40: a wrong rotary cos in the joint forward, 1.6e-3 from the truth against the
    cached path's 1.2e-5; bdcore/vector_math.py)."""
    assert tested.shape == reference.shape == truth.shape, what
    scale = float(truth.detach().abs().max())
    floor = floor_ulps * EPS32 * scale
    err_tested, err_ref = rounding_error(tested, truth), rounding_error(reference, truth)
    for path, err, other in (("tested", err_tested, err_ref), ("reference", err_ref, err_tested)):
        bound = slack * other + floor
        assert err <= bound, (
            f"{what}: the tested path is {err_tested:.3g} from the fp64 truth, the reference path {err_ref:.3g} "
            f"(the {path} path's bound {bound:.3g}, largest |value| {scale:.3g}); more than rounding separates them"
        )
