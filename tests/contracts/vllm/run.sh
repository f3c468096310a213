#!/usr/bin/env bash
# `make vllm-contract`: bdstack's vLLM commands and plugin against vLLM 0.33.0's own code, on CPU.
# Builds .venv-vllm-contract once (vLLM's wheel --no-deps over torch 2.13.0 CPU: vLLM's torch 2.14 pin is
# not needed to parse arguments and build configs; ~3 GB installed, several minutes with pip's cache
# warm), then a run takes 35 s on 2 shared cores (5.5 minutes once under heavy load; mostly importing vLLM).
# See inference/vllm_backend/README.md ("Verified where").
set -euo pipefail
cd "$(dirname "$0")/../../.."

VENV=${VLLM_CONTRACT_VENV:-.venv-vllm-contract}
WORK=${VLLM_CONTRACT_WORK:-runs/vllm-contract}
HERE=tests/contracts/vllm
source tests/contracts/venv.sh
ensure_contract_venv "$VENV" vllm==0.33.0 "$HERE/requirements.txt" --editable

rm -rf "$WORK"
mkdir -p "$WORK"
TMPDIR=$PWD/$WORK OMP_NUM_THREADS=1 .venv/bin/python -m tests.contracts.vllm.commands "$WORK"
PYTHONPATH=$PWD OMP_NUM_THREADS=1 VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" -m tests.contracts.vllm.check "$WORK"
