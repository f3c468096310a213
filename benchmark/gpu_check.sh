#!/usr/bin/env bash
# One prepared GPU check (the device tool lends a GPU for ~15 minutes a session): CUDA twins of the
# CPU-tested paths. Usage on the GPU machine, from the repo root:  bash benchmark/gpu_check.sh
# Results land in ${OUT:-gpu_results}/. Assumes a CUDA build of torch in .venv-gpu (created here).
set -uo pipefail
OUT=${OUT:-gpu_results}
mkdir -p "$OUT"
if [ ! -x .venv-gpu/bin/python ]; then
  python3 -m venv .venv-gpu && .venv-gpu/bin/pip install -q torch -r requirements-dev.txt >"$OUT/install.log" 2>&1
fi
PY=.venv-gpu/bin/python
nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1
# 1. flex-attention BlockMask == dense mask on CUDA, and the two-stream model forward (invariants 1-2).
$PY -m pytest -q tests/test_attention_rule.py tests/test_invariant_1_clean_stream.py \
  tests/test_invariant_2_noised_blocks.py tests/test_gated_delta.py >"$OUT/pytest.txt" 2>&1
# 2. Train-step cost on CUDA (flex BlockMask, bf16), side by side with AR SFT.
$PY -m benchmark.train_step --device cuda --layers 8 --hidden 1024 --vocab 32000 --prompt 512 --response 1024 \
  --bd_size 32 >"$OUT/train_step.txt" 2>&1
# 3. Gated delta on CUDA.
$PY -m benchmark.gated_delta --device cuda --lengths 2048,8192 --block_sizes 32 --heads 16 --dim 128 \
  --reference_max_len 0 >"$OUT/gated_delta.txt" 2>&1
# 4. Trainer end to end on one GPU (nccl, bf16, FSDP2) with the tiny demo kit.
$PY -m data.make_demo "$OUT/kit" --train 400 --eval 20 >/dev/null 2>&1
$PY train.py --model_id "$OUT/kit/base_model" --dataset "$OUT/kit/train.jsonl" --bd_size 8 --max_length 1024 \
  --pack --max_steps 20 --save_dir "$OUT/run" --log_every 5 >"$OUT/train.txt" 2>&1
# 5. Serving on CUDA: every mode through the server.
$PY -m benchmark.serving.bench_decode "$OUT/run/final" --prompts "$OUT/kit/eval.jsonl" --num 20 \
  --concurrency 1,4 --server-args "--device cuda" >"$OUT/serving.txt" 2>&1
tail -n 3 "$OUT"/*.txt
