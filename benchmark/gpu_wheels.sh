#!/usr/bin/env bash
# Download into .whl/ the wheels benchmark/gpu_check.sh installs on the offline GPU machine (Python 3.12,
# x86-64; its image has torch 2.11, transformers 5.17 and no serving stack). Run here, with PyPI access;
# then name `.whl` in the device tool's carry. About 19 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
WHEELS=(
  transformers==5.23.0 fastapi==0.163.2 starlette==1.10.0 pydantic==2.14.4 pydantic_core==2.50.5
  annotated_types==0.8.0 annotated_doc==0.0.7 typing_inspection==0.4.5 typing_extensions==4.16.0
  uvicorn==0.54.0 h11==0.16.0 openai==3.51.0 httpx2==2.16.2 httpcore2==2.16.2 jiter==0.19.0 anyio==4.16.0
  idna==3.20 sniffio==1.3.1 opentelemetry_api==1.45.2 truststore==0.10.5
)
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl "${WHEELS[@]}"
