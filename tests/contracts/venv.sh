# Sourced by tests/contracts/{sglang,vllm}/run.sh: builds an engine's contract venv once.
# ensure_contract_venv VENV ENGINE_PIN REQUIREMENTS [--editable]
# The engine wheel goes in --no-deps over torch 2.13.0 CPU: its own CUDA torch pin is not needed to parse
# arguments and build configs, and the constraint keeps every later install on the CPU build. --editable
# also installs bdstack itself (no dependencies: the engine's pins rule there), for an entry point.
# Rebuilt when REQUIREMENTS is newer than the venv's stamp.
ensure_contract_venv() {
    local venv=$1 engine=$2 requirements=$3 editable=${4:-}
    local stamp=$venv/.contract-installed
    if [ -f "$stamp" ] && [ ! "$requirements" -nt "$stamp" ]; then
        return
    fi
    python3 -m venv "$venv"
    local constraints
    constraints=$(mktemp)
    echo "torch==2.13.0" >"$constraints"
    PIP_CONSTRAINT=$constraints "$venv/bin/pip" install --quiet torch==2.13.0
    "$venv/bin/pip" install --quiet --no-deps "$engine"
    PIP_CONSTRAINT=$constraints "$venv/bin/pip" install --quiet -r "$requirements"
    if [ "$editable" = "--editable" ]; then
        "$venv/bin/pip" install --quiet --no-deps --no-build-isolation -e .
    fi
    rm -f "$constraints"
    touch "$stamp"
}
