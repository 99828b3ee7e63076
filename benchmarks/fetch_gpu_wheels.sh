#!/usr/bin/env bash
# Downloads the wheels scripts/gpu_check.sh needs on the H200, which has no registry access,
# into .whl/ (git-ignored; carried to the device machine). Run here, from the repo root:
#   benchmarks/fetch_gpu_wheels.sh
# nvidia-cutlass is needed only for its CUTLASS/CuTe headers (the build reads
# cutlass_library/source/include), so its own dependencies are not fetched.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl nvidia-cutlass==4.2.0.0
ls -l .whl
