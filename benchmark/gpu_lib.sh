# Shared by benchmark/gpu_check.sh, gpu_conversion.sh, gpu_sglang_check.sh and gpu_vllm_check.sh (sourced, not
# run): the summary note, one step under `timeout` within a global deadline, the offline wheel install on the GPU
# machine, and an engine served in every mode against the native engine. Expects SUMMARY, BUDGET and T0 to be set
# by the caller (engine_vs_native also OUT, LOG and PY: engine_check_start sets them all).

note() { echo "$*" | tee -a "$SUMMARY"; }

# run_step NAME TIMEOUT LOG CMD...: runs CMD under `timeout` (capped by the global deadline), appends
# its output to LOG, and notes PASS / FAIL rc / TIMEOUT / SKIP with the seconds it took.
run_step() {
  local name=$1 limit=$2 log=$3
  shift 3
  local left=$((BUDGET - ($(date +%s) - T0)))
  if [ "$left" -lt 30 ]; then
    note "SKIP    $name (global budget spent)"
    return 99
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "### $name (timeout ${limit}s): $*" >>"$log"
  local t=$(date +%s) rc
  timeout -k 10 "$limit" "$@" >>"$log" 2>&1
  rc=$?
  local dt=$(($(date +%s) - t))
  if [ $rc -eq 0 ]; then
    note "PASS    $name (${dt}s)"
  elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
    note "TIMEOUT $name (${dt}s, limit ${limit}s; see $(basename "$log"))"
  else
    note "FAIL    $name (rc $rc, ${dt}s; see $(basename "$log"))"
  fi
  return $rc
}

# install_wheels LOG: the packages the GPU image lacks, from .whl/ (benchmark/gpu_wheels.sh), into
# /tmp/site, first on PYTHONPATH.
install_wheels() {
  if ls .whl/*.whl >/dev/null 2>&1; then
    run_step wheels 120 "$1" python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --upgrade --target /tmp/site .whl/*.whl
  else
    note "FAIL    wheels (.whl/ is missing: name .whl in the device tool's carry)"
  fi
  export PYTHONPATH=/tmp/site:$PWD
}

# engine_check_start DEFAULT_OUT [OUT]: the globals of an engine check (gpu_sglang_check.sh, gpu_vllm_check.sh):
# OUT (made), an empty SUMMARY, LOG, BUDGET (default 540 s), T0, and PY (default python3).
engine_check_start() {
  OUT=${2:-$1}
  mkdir -p "$OUT"
  SUMMARY=$OUT/summary.txt
  LOG=$OUT/log.txt
  BUDGET=${BUDGET:-540}
  T0=$(date +%s)
  PY=${PY:-python3}
  : >"$SUMMARY"
}

# engine_vs_native ENGINE ENGINE_PYTHON FIRST_PORT "CHECK_FLAGS" SERVE_FLAGS...: a tiny checkpoint ($OUT/ckpt) and
# the same base with a draft-only adapter ($OUT/draft), each served by `serve.py --backend ENGINE` in every mode
# (SERVE_FLAGS after `--`, to the engine), and each server's greedy text against the native engine's
# (benchmark/served_vs_native.py with CHECK_FLAGS). A server that does not come up leaves its log's tail in LOG.
engine_vs_native() {
  local engine=$1 engine_python=$2 first_port=$3 check=$4
  shift 4
  run_step checkpoints 120 "$LOG" env PYTHONPATH="$PWD" "$PY" -c \
    "from benchmark.tiny import draft_checkpoint, tiny_checkpoint; tiny_checkpoint('$OUT/ckpt', bd_size=4); draft_checkpoint('$OUT/draft')"
  local run ckpt mode port pid served
  for run in ckpt:causal ckpt:diffusion ckpt:self-spec draft:causal draft:diffusion draft:self-spec; do
    ckpt=$OUT/${run%%:*} mode=${run#*:} port=$((first_port + RANDOM % 1000)) served=$OUT/serve-${run/:/-}.log
    "$PY" inference/serve.py "$ckpt" --mode "$mode" --backend "$engine" "--$engine-python" "$engine_python" \
      --port "$port" -- "$@" >"$served" 2>&1 &
    pid=$!
    if run_step "$engine ${run%%:*} $mode up" 300 "$LOG" bash -c \
      "until curl -sf localhost:$port/v1/models >/dev/null; do kill -0 $pid 2>/dev/null || exit 3; sleep 2; done"; then
      # shellcheck disable=SC2086  # CHECK_FLAGS are words
      run_step "$engine ${run%%:*} $mode vs native (greedy)" 180 "$LOG" env PYTHONPATH="$PWD" \
        "$PY" -m benchmark.served_vs_native "$ckpt" "$mode" "$port" $check
    else
      tail -5 "$served" >>"$LOG"
    fi
    kill "$pid" 2>/dev/null
    wait "$pid" 2>/dev/null
  done
}
