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
OUT=${1:-gpu_results/vllm}
mkdir -p "$OUT"
SUMMARY=$OUT/summary.txt
BUDGET=${BUDGET:-540}
T0=$(date +%s)
: >"$SUMMARY"
. benchmark/gpu_lib.sh
LOG=$OUT/log.txt
PY=${PY:-python3}

if [ -z "${VLLM_PY:-}" ] || ! "$VLLM_PY" -c "import vllm" 2>/dev/null; then
  note "SKIP    vllm (no vLLM environment on this machine: set VLLM_PY; it cannot be carried in 64 MiB)"
  exit 0
fi
run_step checkpoints 120 "$LOG" env PYTHONPATH=$PWD "$PY" -c \
  "from benchmark.tiny import draft_checkpoint, tiny_checkpoint; tiny_checkpoint('$OUT/ckpt', bd_size=4); draft_checkpoint('$OUT/draft')"
PROMPTS='["Hello there", "Count: 1 2 3", "The answer is"]'
for run in ckpt:causal ckpt:diffusion ckpt:self-spec draft:causal draft:diffusion draft:self-spec; do
  CKPT=$OUT/${run%%:*} mode=${run#*:}
  port=$((31000 + RANDOM % 1000))
  "$PY" inference/serve.py "$CKPT" --mode "$mode" --backend vllm --vllm-python "$VLLM_PY" --port "$port" \
    -- --max-model-len 512 --gpu-memory-utilization 0.3 >"$OUT/serve-${run/:/-}.log" 2>&1 &
  pid=$!
  run_step "vllm ${run%%:*} $mode up" 240 "$LOG" bash -c \
    "until curl -sf localhost:$port/v1/models >/dev/null; do kill -0 $pid 2>/dev/null || exit 3; sleep 2; done"
  up=$?
  if [ $up -eq 0 ]; then
    run_step "vllm ${run%%:*} $mode vs native (greedy)" 180 "$LOG" env PYTHONPATH=$PWD "$PY" - "$CKPT" "$mode" "$port" "$PROMPTS" <<'PYEOF'
import json, sys, time, urllib.request
from bdcore.decode.sampling import SamplingParams
from inference.native.engine import DecodeConfig, Engine
from bdcore.loading import load_checkpoint
ckpt, mode, port, prompts = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
loaded = load_checkpoint(ckpt, device="cuda", draft_energy=1.0)  # vLLM serves a draft adapter uncut
engine = Engine(loaded, DecodeConfig(mode=mode, fuse_commit=False))
bad = 0
for p in prompts:
    ids = loaded.tokenizer(p)["input_ids"]
    greedy = {"temperature": 0} if mode == "causal" else {}  # the plugin: greedy without extra_args
    body = json.dumps({"model": ckpt, "prompt": ids, "max_tokens": 32, **greedy}).encode()
    t = time.time()
    req = urllib.request.Request(f"http://localhost:{port}/v1/completions", body, {"Content-Type": "application/json"})
    got = json.loads(urllib.request.urlopen(req).read())["choices"][0]["text"]
    dt = time.time() - t
    want = engine.generate(ids, SamplingParams(max_tokens=32))
    print(f"{ckpt} {mode} {p!r}: vllm {got!r} ({dt:.2f}s) native {want.text!r} tpf {want.stats.tokens_per_forward:.2f}")
    bad += got != want.text
sys.exit(1 if bad else 0)
PYEOF
  else
    tail -5 "$OUT/serve-${run/:/-}.log" >>"$LOG"
  fi
  kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null
done
cat "$SUMMARY"
