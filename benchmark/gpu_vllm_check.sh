#!/usr/bin/env bash
# When a GPU is lent: serve a tiny converted checkpoint, and the same base with a draft-only adapter, with vLLM
# in each mode and compare with the native engine (greedy: identical tokens; tokens per forward and tok/s side
# by side). The draft-adapter runs are the launch serve.py builds, e.g. (printed by --dry-run):
#   python inference/serve.py CKPT --mode self-spec --backend vllm --vllm-python $VLLM_PY -- --max-model-len 512
#   -> $VLLM_PY -m vllm.entrypoints.cli.main serve CKPT ... --enable-lora --max-loras 1 --max-lora-rank 8
#      --lora-target-modules down_proj gate_proj k_proj o_proj q_proj up_proj v_proj --max-model-len 512
# Usage:
#   VLLM_PY=/path/to/vllm-env/bin/python benchmark/gpu_vllm_check.sh [OUT_DIR]
# Needs a vLLM 0.33.0 environment already on the GPU machine: the vllm wheel alone is 336 MB and its CUDA
# dependencies (torch 2.14 cu13, flashinfer, ...) several GB, far over the 64 MiB a device run carries, so
# this script cannot install vLLM there; without VLLM_PY it records SKIP and the CPU contract
# (`make vllm-contract`, inference/vllm_backend/README.md) remains the proof.
# Every mode must come up and give the native engine's greedy text (diffusion: the native engine unfused,
# as the plugin runs it; self-spec: native self-spec). Non-causal requests leave temperature at vLLM's
# default 1 (vLLM 0.33 rejects any other for a diffusion model): the plugin is greedy unless
# extra_args["bdstack"] asks otherwise.
set -uo pipefail
cd "$(dirname "$0")/.."
. benchmark/gpu_lib.sh
engine_check_start gpu_results/vllm "${1:-}"

if [ -z "${VLLM_PY:-}" ] || ! "$VLLM_PY" -c "import vllm" 2>/dev/null; then
  note "SKIP    vllm (no vLLM environment on this machine: set VLLM_PY; it cannot be carried in 64 MiB)"
  exit 0
fi
# vLLM 0.33 rejects a temperature for a diffusion model: non-causal requests leave it, the plugin is greedy
engine_vs_native vllm "$VLLM_PY" 31000 "--greedy temperature=0 --greedy-modes causal" --max-model-len 512 --gpu-memory-utilization 0.3
cat "$SUMMARY"
