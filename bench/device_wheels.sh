#!/usr/bin/env bash
# The wheels the lent GPU machine (the device tool) lacks, downloaded here into the ignored
# folders its calls carry. Run once per checkout from the repository root, with network:
#   bash bench/device_wheels.sh
# The machine's image (KINDS.md's package list, 2026-11-17: torch, transformers, numpy,
# aiohttp, httpx, psutil, pytest, …) lacks what Ray, sglang-router, megatron-core and
# milepost import on top of it; that closure, resolved from these versions' metadata (no
# extras), is listed below. A call carries at most 64 MiB, so Ray (its Java jars, unused by
# Python, removed) and megatron-core travel in one call and the rest in the next:
#   .loop-a       ray 2.60.0, megatron-core 0.16.1           (bench/device_loop_env.sh a)
#   .gpu-wheels   pydantic, the engine's web stack, msgspec…  (part a; alone: bench/device_env.sh)
#   .loop-b       sglang-router and what Ray and it import    (bench/device_loop_env.sh b)
#   .fp8-wheels   megatron-core alone (bench/fp8_training.py, tests/gpu/test_fp8_linear_gpu.py)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64)

fetch() {  # fetch FOLDER NAME==VERSION…: cp312 x86-64 wheels, no dependencies (they are named here)
  local folder=$1; shift
  mkdir -p "$folder"
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      "${PLATFORMS[@]}" -d "$folder" "$@"
}

fetch .loop-a ray==2.60.0 megatron-core==0.16.1
for wheel in .loop-a/ray-*.whl; do  # drop ray/jars (Java, ~34 MB): the call's 64 MiB limit
  zip -q -d "$wheel" 'ray/jars/*' || [ $? -eq 12 ]  # 12: nothing left to remove (run before)
done
fetch .gpu-wheels pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
    fastapi==0.136.3 starlette==1.10.0 uvicorn==0.55.0 msgspec==0.23.0 submitit==1.5.4
fetch .loop-b sglang-router==0.3.2 orjson==3.13.0 setproctitle==1.3.8 jsonschema==4.26.0 \
    jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
fetch .fp8-wheels megatron-core==0.16.1
du -sh .loop-a .gpu-wheels .loop-b .fp8-wheels
