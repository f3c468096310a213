#!/usr/bin/env bash
# `make sglang-cpu`: SGLang 0.5.23's own CPU engine in .venv-sglang-live (never .venv), issue 57: causal served by
# stock SGLang, our diffusion and self-spec by the plugin with its own torch_native canvas attention
# (inference/sglang_backend/README.md; tests/test_sglang_live.py). SGLang pins torch 2.14.1; it runs here over the
# project's torch 2.13.0+cpu, installed first and held by a constraint. About 3.5 minutes with pip's cache warm, 2.7 GB.
# Stand-ins go to $VENV/stubs (put it on PYTHONPATH): sgl_kernel.py (no CPU build of SGLang's kernels exists on
# PyPI) and a placeholder torchvision without package metadata, which transformers then skips (SGLang imports it
# only for multimodal configs).
# Serve: SGLANG_USE_CPU_ENGINE=1 PYTHONPATH=$VENV/stubs $VENV/bin/python -m sglang.launch_server --model-path CKPT
#   --device cpu --attention-backend torch_native --disable-cuda-graph --max-total-tokens 65536
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${SGLANG_CPU_VENV:-.venv-sglang-live}
HERE=benchmark/sglang_live
STAMP=$VENV/.sglang-cpu-installed
if [ -f "$STAMP" ] && [ ! "$HERE/requirements.txt" -nt "$STAMP" ] && [ ! "$HERE/sgl_kernel.py" -nt "$STAMP" ]; then
    exit 0
fi
python3 -m venv "$VENV"
constraints=$(mktemp)
echo "torch==2.13.0" >"$constraints"
PIP_CONSTRAINT=$constraints "$VENV/bin/pip" install --quiet torch==2.13.0
"$VENV/bin/pip" install --quiet --no-deps sglang==0.5.23
PIP_CONSTRAINT=$constraints "$VENV/bin/pip" install --quiet -r tests/contracts/sglang/requirements.txt
PIP_CONSTRAINT=$constraints "$VENV/bin/pip" install --quiet -r "$HERE/requirements.txt"
"$VENV/bin/pip" uninstall --quiet -y torchvision 2>/dev/null || true
rm -f "$constraints"
STUBS=$VENV/stubs
rm -rf "$STUBS"
mkdir -p "$STUBS/torchvision/transforms/v2"
cp "$HERE/sgl_kernel.py" "$STUBS/"
# torchvision: every name a placeholder class that raises when called; InterpolationMode an enum (read at import)
cat >"$STUBS/torchvision/_anything.py" <<'PY'
import enum


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


class _Placeholder:
    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        raise NotImplementedError("torchvision stand-in (bdstack's SGLang CPU venv): not available")


def module_getattr(name):
    if name.startswith("__"):
        raise AttributeError(name)
    if name == "InterpolationMode":
        return InterpolationMode
    return type(name, (_Placeholder,), {})
PY
echo 'from torchvision._anything import module_getattr as __getattr__  # noqa: F401' >"$STUBS/torchvision/io.py"
for m in transforms/__init__ transforms/functional transforms/v2/__init__ transforms/v2/functional; do
    echo 'from torchvision._anything import InterpolationMode, module_getattr as __getattr__  # noqa: F401' \
        >"$STUBS/torchvision/$m.py"
done
echo 'from torchvision.transforms import functional, v2  # noqa: E402,F401' >>"$STUBS/torchvision/transforms/__init__.py"
echo 'from torchvision.transforms.v2 import functional  # noqa: E402,F401' >>"$STUBS/torchvision/transforms/v2/__init__.py"
cat >"$STUBS/torchvision/__init__.py" <<'PY'
from torchvision._anything import InterpolationMode, module_getattr as __getattr__  # noqa: F401
__version__ = "0.28.0+standin"
from torchvision import io, transforms  # noqa: E402,F401
PY
SGLANG_USE_CPU_ENGINE=1 PYTHONPATH=$STUBS "$VENV/bin/python" -c \
    "import sglang.srt.entrypoints.http_server, torch; print('sglang CPU engine importable, torch', torch.__version__)"
touch "$STAMP"
