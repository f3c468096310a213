"""Shake the numeric tests on one machine (`make shake`): the same tests at 1 and 2 threads, under narrower
kernel ISAs, and with other random inputs, so that an assert that holds on this CPU family by luck of its
kernels fails here rather than on the other family's CI run (tests/README.md, "Tolerances").

CI runs the suite once, two workers of one thread each. A comparison that is exact only because one kernel
happened to see one shape (issue 54: a served forward's clean rows after drafting rows, bit-equal on an Intel
AMX machine and 2e-6 off on an AMD EPYC) passes there on the family CI drew. What moves kernels on one machine:
- the thread count (MKL and oneDNN split reductions by thread, and pick other blocks);
- `ATEN_CPU_CAPABILITY` (ATen's own vectorised kernels: avx2 instead of avx512) and `ONEDNN_MAX_CPU_ISA`
  (oneDNN's matmuls: no AVX-512 and no AMX, the AMD path on an Intel machine and a narrower one on AMD);
- the inputs: `BDSTACK_TEST_SEED` reseeds every test's global random draws (ids, which rows draft, how a batch
  is made up), tests/conftest.py.

    python -m tests.shake                 # every configuration over the numeric tests, a table at the end
    python -m tests.shake --quick         # 1 and 2 threads only
    python -m tests.shake -- -k rows      # extra pytest arguments after --
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# Files whose tests compare numeric paths in process (the unit suite's part of them, `-m "not e2e"`) ...
NUMERIC_UNIT = [
    "test_attention_rule.py", "test_cache_room.py", "test_draft_adapter.py", "test_draft_adapter_rows.py",
    "test_draft_adapter_serving.py", "test_gated_delta.py", "test_hybrid_decode.py",
    "test_invariant_1_clean_stream.py", "test_invariant_2_noised_blocks.py", "test_invariant_3_engine_denoise.py",
    "test_opd.py", "test_opd_ar_weight.py", "test_packed_linear.py", "test_reply_top_logprobs.py",
    "test_rl_rollout_batch.py", "test_self_spec_bonus.py", "test_sparse_attention.py", "test_special_tokens.py",
    "test_student_rollout_attention.py", "test_trajectory.py", "test_tree_decode.py", "test_vector_math.py",
    "test_vllm_draft_adapter.py", "test_vllm_sampler.py", "test_vllm_steps.py", "test_decode_rules.py",
    "test_rl.py", "test_single_stream.py", "test_loss.py", "test_draft_distill.py",
]  # fmt: skip
# ... and the in-process equivalence sweeps marked e2e for their length (no torchrun, no server).
NUMERIC_SWEEPS = ["test_invariant_4_self_spec.py", "test_reference_decoder.py", "test_scheduler.py"]

CONFIGS = {
    "1 thread": {"OMP_NUM_THREADS": "1"},
    "2 threads": {"OMP_NUM_THREADS": "2"},
    "2 threads, other inputs": {"OMP_NUM_THREADS": "2", "BDSTACK_TEST_SEED": "1"},
    "1 thread, ATen avx2": {"OMP_NUM_THREADS": "1", "ATEN_CPU_CAPABILITY": "avx2"},
    "2 threads, oneDNN avx2": {"OMP_NUM_THREADS": "2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
}
QUICK = ("1 thread", "2 threads")


def run(name: str, env: dict[str, str], extra: list[str]) -> dict:
    """One configuration: the unit files without their e2e tests, then the sweeps whole."""
    passes = [([f"tests/{f}" for f in NUMERIC_UNIT], ["-m", "not e2e"]), ([f"tests/{f}" for f in NUMERIC_SWEEPS], [])]
    started, summaries, failed, rc = time.monotonic(), [], [], 0
    for files, marker in passes:
        cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rf", *marker]
        proc = subprocess.run(
            [*cmd, *files, *extra], cwd=REPO, env={**os.environ, **env}, capture_output=True, text=True
        )
        lines = proc.stdout.strip().splitlines()
        summaries.append(lines[-1].strip("= ") if lines else proc.stderr.strip()[-200:])
        failed += re.findall(r"^FAILED (\S+)", proc.stdout, re.M)
        rc = rc or (0 if proc.returncode == 5 else proc.returncode)  # 5: an `-k` that selected nothing here
    return {
        "config": name,
        "summary": "; ".join(summaries),
        "failed": failed,
        "seconds": time.monotonic() - started,
        "rc": rc,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1 and 2 threads only")
    parser.add_argument("--config", action="append", choices=list(CONFIGS), help="run only these configurations")
    args, extra = parser.parse_known_args(argv)
    extra = [a for a in extra if a != "--"]
    names = args.config or (list(QUICK) if args.quick else list(CONFIGS))
    results = []
    for name in names:
        print(f"shake: {name} ...", flush=True)
        results.append(run(name, CONFIGS[name], extra))
        r = results[-1]
        print(f"  {r['summary']}  ({r['seconds']:.0f} s)", flush=True)
        for test in r["failed"]:
            print(f"  FAILED {test}", flush=True)
    print("\n| configuration | result | seconds |\n|---|---|---|")
    for r in results:
        print(f"| {r['config']} | {r['summary']} | {r['seconds']:.0f} |")
    return 0 if all(r["rc"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
