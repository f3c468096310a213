"""The first call into MKL's vector math library, made once in one thread before any forward runs.

PyTorch's CPU `cos`, `sin`, `exp`, `log`, `tanh` ... on contiguous fp32 tensors call MKL VML (`vmsCos` with
`VML_HA`) from each OpenMP thread. With torch 2.13's MKL 2024.2 on an Intel Xeon (AVX512-BF16, AMX), when
the process's first VML call runs in two threads at once, one thread's share comes out at a far lower
accuracy in about one process in ten: `cos` off by 1.5e-4 from index 2280 of 4560
elements, exactly the second thread's half (a rotary embedding's cos, and so hidden states 1.6e-3
apart in one forward of a pair that should agree to 1e-5). One small call in a single thread first, and no
later call is affected (`benchmark/vector_math_race.py` runs both arms). Not seen on AMD EPYC machines;
the call is cheap and harmless there.
"""

from __future__ import annotations

import torch

_settled = False


def settle_vector_math() -> None:
    """Make the process's first VML call now, serially (a 4-element tensor stays under the parallel grain)."""
    global _settled
    if _settled:
        return
    probe = torch.linspace(0.5, 2.0, 4)
    for op in (torch.cos, torch.sin, torch.exp, torch.log, torch.tanh):
        op(probe)
    _settled = True
