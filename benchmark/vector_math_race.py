"""Reproduce the race in MKL's vector math that `bdcore/vector_math.py` settles: `python -m benchmark.vector_math_race
--processes 200` starts fresh processes, alternately cold and settled, each making its first `cos` over 4,560
fp32 values in two threads, and counts the answers more than 1e-6 from fp64. On an Intel Xeon with AMX (torch
2.13, MKL 2024.2) 21 of 200 cold processes were wrong (0 of 200 settled), by 1.5e-4 from the second thread's
first element on.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

from tqdm import tqdm

CHILD = """
import sys, torch
torch.set_num_threads(2)
if sys.argv[1] == "settled":
    from bdcore.vector_math import settle_vector_math
    settle_vector_math()
x = torch.linspace(0.01, 10.0, 4560)
err = (x.cos().double() - x.double().cos()).abs()
wrong = (err > 1e-6).nonzero()
print(f"{err.max().item():.3g} {int(wrong[0]) if len(wrong) else -1}")
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--processes", type=int, default=100, help="fresh processes per arm (cold, settled)")
    args = p.parse_args(argv)
    wrong = {"cold": [], "settled": []}
    for _ in tqdm(range(args.processes), desc="process pairs"):
        for arm in wrong:
            out = subprocess.run([sys.executable, "-c", CHILD, arm], capture_output=True, text=True, check=True)
            err, first = out.stdout.split()
            if float(err) > 1e-6:
                wrong[arm].append((float(err), int(first)))
    for arm, cases in wrong.items():
        detail = ", ".join(f"{e:.3g} from index {i}" for e, i in cases[:5])
        print(f"{arm}: {len(cases)} of {args.processes} processes wrong" + (f" ({detail})" if cases else ""))
    return 1 if wrong["settled"] else 0


if __name__ == "__main__":
    sys.exit(main())
