#!/usr/bin/env bash
# `make vllm-contract`: bdstack's vLLM commands and plugin against vLLM 0.33.0's own code, on CPU.
# Builds .venv-vllm-contract once (vLLM's wheel --no-deps over torch 2.13.0 CPU: vLLM's torch 2.14 pin is
# not needed to parse arguments and build configs; ~3 GB installed, several minutes with pip's cache
# warm), then a run takes 35 s on 2 shared cores (5.5 minutes once under heavy load; mostly importing vLLM).
# See inference/vllm_backend/README.md ("Verified where").
set -euo pipefail
cd "$(dirname "$0")/../.."

VENV=${VLLM_CONTRACT_VENV:-.venv-vllm-contract}
WORK=${VLLM_CONTRACT_WORK:-runs/vllm-contract}
HERE=benchmark/vllm_contract
STAMP=$VENV/.contract-installed

if [ ! -f "$STAMP" ] || [ "$HERE/requirements.txt" -nt "$STAMP" ]; then
    python3 -m venv "$VENV"
    constraints=$(mktemp)
    echo "torch==2.13.0" >"$constraints"
    PIP_CONSTRAINT=$constraints "$VENV/bin/pip" install --quiet torch==2.13.0
    "$VENV/bin/pip" install --quiet --no-deps vllm==0.33.0
    PIP_CONSTRAINT=$constraints "$VENV/bin/pip" install --quiet -r "$HERE/requirements.txt"
    # bdstack itself, for its `vllm.general_plugins` entry point (no dependencies: vLLM's pins rule there).
    "$VENV/bin/pip" install --quiet --no-deps --no-build-isolation -e .
    rm -f "$constraints"
    touch "$STAMP"
fi

rm -rf "$WORK"
mkdir -p "$WORK"
TMPDIR=$PWD/$WORK OMP_NUM_THREADS=1 .venv/bin/python -m benchmark.vllm_contract.commands "$WORK"
PYTHONPATH=$PWD OMP_NUM_THREADS=1 VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" -m benchmark.vllm_contract.check "$WORK"
