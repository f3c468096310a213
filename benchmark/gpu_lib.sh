# Shared by benchmark/gpu_check.sh and benchmark/gpu_conversion.sh (sourced, not run): the summary note,
# one step under `timeout` within a global deadline, and the offline wheel install on the GPU machine.
# Expects SUMMARY, BUDGET and T0 to be set by the caller.

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
