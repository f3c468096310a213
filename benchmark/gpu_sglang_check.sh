#!/usr/bin/env bash
# When a GPU is lent and SGLang 0.5.23 is installed on it: serve a tiny converted checkpoint, and the same base with
# a draft-only adapter, with SGLang in each mode and compare with the native engine (greedy: identical text). The
# draft-adapter runs are the launch serve.py builds, e.g. (printed by --dry-run):
#   python inference/serve.py CKPT --mode self-spec --backend sglang --sglang-python $SGLANG_PY --port PORT \
#     -- --mem-fraction-static 0.3 --dtype float32 --attention-backend triton
#   -> $SGLANG_PY -m inference.sglang_backend.launch --model-path CKPT --host 127.0.0.1 --port PORT
#      --dllm-algorithm BdstackSelfSpec --dllm-algorithm-config /tmp/bdstack-sglang-XXXX/BdstackSelfSpec.yaml
#      --attention-backend triton --no-dllm-fdfo --max-running-requests 8
#      --mem-fraction-static 0.3 --dtype float32 --attention-backend triton
# (the YAML carries `draft_adapter: draft_adapter`; the plugin loads CKPT/draft_adapter into a LoRA manager of
# SGLang's at the first request, since SGLang turns --enable-lora off for dLLM algorithms: no LoRA flag is passed).
# Usage:
#   SGLANG_PY=/path/to/sglang-env/bin/python benchmark/gpu_sglang_check.sh [OUT_DIR]
# Needs an SGLang 0.5.23 environment already on the GPU machine: sglang-kernel alone is a 373 MB wheel and SGLang
# pins torch 2.14.1 (CUDA), far over the 64 MiB a device run carries, so this script cannot install SGLang there;
# without SGLANG_PY it records SKIP and the CPU contract (`make sglang-contract`, inference/sglang_backend/README.md)
# remains the proof. Every mode must come up and give the native engine's greedy text (diffusion: the native engine
# unfused, as our algorithm runs it; self-spec: the base model's causal output, which native self-spec gives). Both
# sides run fp32 (SGLang's `--dtype auto` would serve the tiny fp32 checkpoint in fp16, the native engine in bf16),
# SGLang on its Triton attention in every mode (ours require it; causal gets it too, for fp32).
set -uo pipefail
cd "$(dirname "$0")/.."
. benchmark/gpu_lib.sh
engine_check_start gpu_results/sglang "${1:-}"

if [ -z "${SGLANG_PY:-}" ] || ! "$SGLANG_PY" -c "import sglang" 2>/dev/null; then
  note "SKIP    sglang (no SGLang environment on this machine: set SGLANG_PY; it cannot be carried in 64 MiB)"
  exit 0
fi
engine_vs_native sglang "$SGLANG_PY" 32000 "--greedy temperature=0 --dtype fp32" --mem-fraction-static 0.3 --dtype float32 --attention-backend triton
cat "$SUMMARY"
