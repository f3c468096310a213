#!/usr/bin/env bash
# `make sglang-contract`: bdstack's SGLang commands, plugin and presets against SGLang 0.5.23's own code,
# on CPU. Builds .venv-sglang once (2 minutes measured on 2 shared cores with pip's cache warm; cold, add the
# download of torch CPU, triton and transformers; 2.5 GB installed), then about 12 s a run.
# See inference/sglang_backend/README.md ("Verified where").
set -euo pipefail
cd "$(dirname "$0")/../../.."

VENV=${SGLANG_CONTRACT_VENV:-.venv-sglang}
WORK=${SGLANG_CONTRACT_WORK:-runs/sglang-contract}
HERE=tests/contracts/sglang
source tests/contracts/venv.sh
ensure_contract_venv "$VENV" sglang==0.5.23 "$HERE/requirements.txt"

rm -rf "$WORK"
mkdir -p "$WORK"
# serve.py writes each command's settings YAML under $TMPDIR: keep them with the rest of the run.
TMPDIR=$PWD/$WORK OMP_NUM_THREADS=1 .venv/bin/python -m tests.contracts.sglang.commands "$WORK"
# .venv-sglang has SGLang, not bdstack: the repository comes onto its path as the launcher's does.
PYTHONPATH=$PWD OMP_NUM_THREADS=1 "$VENV/bin/python" -m tests.contracts.sglang.check "$WORK"
