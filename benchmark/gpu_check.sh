#!/usr/bin/env bash
# The prepared GPU check: CUDA twins of the CPU-tested paths, then the GPU numbers, in one run that
# fits a short device lease (about 6 to 7 minutes on one H200). From the repo root:
#
#   bash benchmark/gpu_check.sh                 # on the GPU machine (the device tool sets OUT)
#   GPU_CHECK_DEVICE=cpu OUT=/tmp/gpu_dry bash benchmark/gpu_check.sh   # CPU dry run, here
#
# GPU machine: runs the image's `python3` (no venv, no network). Packages it lacks or has in another
# version travel as wheels in .whl/ (made by benchmark/gpu_wheels.sh; git-ignored; name `.whl` in the
# device tool's carry) and are installed with --no-index into /tmp/site, which goes first on PYTHONPATH.
# GPU_CHECK_DEVICE=cpu: the same steps and flags with `--device cpu`, smaller sizes, .venv/bin/python
# and no wheel install; it proves every command line, not the numbers.
#
# Steps, each under its own `timeout` and a global deadline (GPU_CHECK_BUDGET seconds, default 420):
#   env      versions (torch, CUDA, transformers, serving stack) and nvidia-smi
#   pytest   tests/test_cuda_paths.py (CUDA twins) + the invariant tests with CUDA visible
#   step     benchmark.train_step: block-diffusion vs AR SFT step on CUDA (flex BlockMask, fp32)
#   gdelta   benchmark.gated_delta: two-stream gated delta vs the causal floor on CUDA
#   train    data.make_demo + train.py, 20 steps on one GPU (nccl, FSDP2, bf16, flex attention)
#   serve    benchmark.serving.bench_decode on that checkpoint, fp32: greedy self-spec == causal
#   serve16  the same in bf16 (the serving default on a GPU): speed, no equality required
# Files under $OUT (the device tool returns at most 8): summary.txt env.txt pytest.txt bench.txt
# train.txt serving.txt results.json. Checkpoints and the demo kit stay under $GPU_CHECK_WORK.
set -uo pipefail
cd "$(dirname "$0")/.."
DEV=${GPU_CHECK_DEVICE:-cuda}
OUT=${OUT:-gpu_results}
WORK=${GPU_CHECK_WORK:-/tmp/gpu_check}
mkdir -p "$OUT"
rm -rf "$WORK" && mkdir -p "$WORK"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1  # no network there
T0=$(date +%s)

if [ "$DEV" = cpu ]; then
  PY=${PY:-.venv/bin/python}
  BUDGET=${GPU_CHECK_BUDGET:-1500}
  export PYTHONPATH=$PWD
  SMALL=1
else
  PY=python3
  BUDGET=${GPU_CHECK_BUDGET:-420}
  SMALL=0
fi

SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
. benchmark/gpu_lib.sh  # note, run_step, install_wheels

# --- env ---------------------------------------------------------------------------------------
ENV_LOG="$OUT/env.txt"
[ "$DEV" != cpu ] && install_wheels "$ENV_LOG"
run_step env 60 "$ENV_LOG" $PY - <<'EOF'
import importlib, platform, sys
import torch
print("python", sys.version.split()[0], platform.machine())
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", p.name, f"{p.total_memory / 2**30:.0f} GiB", "sm", f"{p.major}.{p.minor}", "SMs", p.multi_processor_count)
for name in ("transformers", "huggingface_hub", "tokenizers", "safetensors", "triton", "fastapi", "starlette",
             "pydantic", "uvicorn", "openai", "httpx2", "anyio", "typing_extensions", "liger_kernel", "fla"):
    try:
        m = importlib.import_module(name)
        print(f"{name:18} {getattr(m, '__version__', '?'):12} {getattr(m, '__file__', '')}")
    except Exception as e:  # noqa: BLE001
        print(f"{name:18} MISSING ({type(e).__name__}: {e})")
EOF
command -v nvidia-smi >/dev/null && nvidia-smi >>"$ENV_LOG" 2>&1
grep -E "^(torch|device|transformers) " "$ENV_LOG" | tee -a "$SUMMARY"

# --- pytest: CUDA twins first, then the invariant tests with CUDA visible ------------------------
PYTEST_LOG="$OUT/pytest.txt"
TESTS=(tests/test_cuda_paths.py tests/test_attention_rule.py tests/test_invariant_1_clean_stream.py
  tests/test_invariant_2_noised_blocks.py
  tests/test_invariant_3_engine_denoise.py tests/test_invariant_4_self_spec.py tests/test_gated_delta.py
  tests/test_sparse_attention.py tests/test_loss.py)
PYTEST_ARGS=(-rfEs --durations=12 -p no:cacheprovider
  --deselect "tests/test_invariant_4_self_spec.py::test_sampled_self_spec_follows_the_ar_distribution")
if [ "$SMALL" = 1 ]; then
  TESTS=(tests/test_cuda_paths.py tests/test_attention_rule.py tests/test_invariant_3_engine_denoise.py)
fi
# Per-test timeout and parallel workers where the plugins are there (the GPU image has both).
$PY -c "import pytest_timeout" 2>/dev/null && PYTEST_ARGS+=(--timeout 150)
if [ "$SMALL" = 0 ] && $PY -c "import xdist" 2>/dev/null; then
  PYTEST_ARGS+=(-n 6)
  export OMP_NUM_THREADS=2 # six workers on 16 cores: keep the CPU twins from oversubscribing
fi
run_step pytest 240 "$PYTEST_LOG" $PY -m pytest "${PYTEST_ARGS[@]}" "${TESTS[@]}"
unset OMP_NUM_THREADS
note "        $(grep -E '[0-9]+ (passed|failed)' "$PYTEST_LOG" | tail -n 1)"

# --- train-step and gated-delta benchmarks -----------------------------------------------------
BENCH_LOG="$OUT/bench.txt"
if [ "$SMALL" = 1 ]; then
  STEP_SIZES=(--layers 2 --hidden 128 --vocab 512 --prompt 32 --response 64 --bd_size 16 --steps 1 --warmup 1)
  GD_SIZES=(--lengths 256 --block_sizes 32 --heads 2 --dim 32 --repeats 1 --reference_max_len 0)
else
  STEP_SIZES=(--layers 8 --hidden 1024 --vocab 32000 --prompt 256 --response 768 --bd_size 32 --steps 5 --warmup 2)
  GD_SIZES=(--lengths 2048,8192 --block_sizes 32 --heads 16 --dim 128 --repeats 3 --reference_max_len 0)
fi
run_step train_step 120 "$BENCH_LOG" $PY -m benchmark.train_step --device "$DEV" "${STEP_SIZES[@]}" --json
STEP_JSON=$(grep '^{' "$BENCH_LOG" | tail -n 1)
[ -n "$STEP_JSON" ] && note "        train_step $STEP_JSON"
run_step gated_delta 90 "$BENCH_LOG" $PY -m benchmark.gated_delta --device "$DEV" "${GD_SIZES[@]}"
awk '/^device=/{on=1} on' "$BENCH_LOG" | grep -v "^\[transformers\]" | tail -n 4 | sed 's/^/        /' | tee -a "$SUMMARY"

# --- trainer end to end on one device ----------------------------------------------------------
TRAIN_LOG="$OUT/train.txt"
if [ "$SMALL" = 1 ]; then
  KIT_ARGS=(--train 60 --eval 4 --hidden 64 --layers 2)
  TRAIN_ARGS=(--max_steps 3 --log_every 1 --dtype auto)
else
  KIT_ARGS=(--train 400 --eval 20)
  TRAIN_ARGS=(--max_steps 20 --log_every 5 --dtype bf16)
fi
CKPT=""
if run_step make_demo 60 "$TRAIN_LOG" $PY -m data.make_demo "$WORK/kit" "${KIT_ARGS[@]}" &&
  run_step train 150 "$TRAIN_LOG" $PY train.py --model_id "$WORK/kit/base_model" --dataset "$WORK/kit/train.jsonl" \
    --bd_size 8 --max_length 1024 --pack --lr 1e-3 --warmup 2 "${TRAIN_ARGS[@]}" --save_dir "$WORK/run"; then
  CKPT="$WORK/run/final"
  cat "$WORK/run/metrics.jsonl" >>"$TRAIN_LOG" 2>/dev/null
  note "        last metrics: $(tail -n 1 "$WORK/run/metrics.jsonl" 2>/dev/null | cut -c1-300)"
fi

# --- serving on the device against that checkpoint --------------------------------------------
SERVE_LOG="$OUT/serving.txt"
if [ "$SMALL" = 1 ]; then
  SERVE_ARGS=(--num 3 --concurrency 1 --max-tokens 16)
else
  SERVE_ARGS=(--num 20 --concurrency 1,4 --max-tokens 64)
fi
check_same() { # greedy self-spec must reproduce causal output exactly (fp32)
  $PY - "$1" <<'EOF'
import json, sys
rows = json.load(open(sys.argv[1]))
for r in rows:
    print(f"        {r['mode']:9} conc {r['concurrency']}  same {r['same_as_causal']:.0%}  "
          f"tok/fwd {r['tokens_per_forward']:.2f}  tok/s {r['tok_s']:.0f}  x{r['speedup']:.2f}  p50 {r['p50']:.3f}s")
bad = [r for r in rows if r["mode"] == "self-spec" and r["same_as_causal"] != 1.0]
sys.exit(1 if bad else 0)
EOF
}
if [ -n "$CKPT" ]; then
  if run_step serve_fp32 120 "$SERVE_LOG" $PY -m benchmark.serving.bench_decode "$CKPT" \
    --prompts "$WORK/kit/eval.jsonl" "${SERVE_ARGS[@]}" --json "$WORK/serving_fp32.json" \
    --dtype fp32 --device "$DEV" --server-args "--backend native"; then
    if check_same "$WORK/serving_fp32.json" | tee -a "$SUMMARY"; then
      note "PASS    serve_fp32: greedy self-spec == causal on every prompt"
    else
      note "FAIL    serve_fp32: greedy self-spec differs from causal"
    fi
  fi
  if [ "$SMALL" = 0 ]; then
    run_step serve_bf16 90 "$SERVE_LOG" $PY -m benchmark.serving.bench_decode "$CKPT" \
      --prompts "$WORK/kit/eval.jsonl" --num 20 --concurrency 1 --max-tokens 64 --json "$WORK/serving_bf16.json" \
      --dtype bf16 --device "$DEV" --server-args "--backend native" &&
      { check_same "$WORK/serving_bf16.json" | tee -a "$SUMMARY"; true; }
  fi
else
  note "SKIP    serving (no checkpoint from the train step)"
fi

# --- results.json and the summary --------------------------------------------------------------
$PY - "$OUT/results.json" "$WORK" "$STEP_JSON" <<'EOF'
import json, pathlib, sys
out, work, step = sys.argv[1], pathlib.Path(sys.argv[2]), sys.argv[3]
res = {"train_step": json.loads(step) if step else None}
for name in ("serving_fp32", "serving_bf16"):
    p = work / f"{name}.json"
    res[name] = json.loads(p.read_text()) if p.is_file() else None
m = work / "run" / "metrics.jsonl"
res["train_metrics"] = [json.loads(x) for x in m.read_text().splitlines()] if m.is_file() else None
pathlib.Path(out).write_text(json.dumps(res, indent=1))
EOF
note "total $(($(date +%s) - T0))s (budget ${BUDGET}s); logs in $OUT"
echo "===== summary ====="
cat "$SUMMARY"
