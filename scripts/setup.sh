#!/usr/bin/env bash
# Idempotent setup of .venv: CPU torch 2.13.0 (pinned: an unpinned torch pulls a multi-GB CUDA
# build), triton, this package in editable mode, and vLLM 0.34.0 for its backend's tests (and
# vLLM 0.33.0's package in build/vllm-0.33 for their second run). The CUDA extension is built
# only where it can run or is asked for (setup.py, an editable install): with nvcc, for the
# visible GPU; FP8NCA_CUDA_ARCHS or FP8NCA_BUILD_CUDA=1 builds it anyway, FP8NCA_BUILD_CUDA=0
# never.
#   bash scripts/setup.sh [--demo]
# --demo: only what the demo runs and the editable install's build needs (torch, the test
# requirements' pins of triton, numpy, setuptools, wheel, pybind11 and nvidia-cutlass), and the
# CUDA extension under the same rule; a later full run adds the rest to the same .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
python_bin=$(command -v python3.11 || command -v python3)
[ -x .venv/bin/python ] || "$python_bin" -m venv .venv
# --no-compile: byte-compiling every installed module was over half the install's time;
# scripts/test.sh caches the bytecode of the modules its runs import (build/pycache).
pip_quiet=(.venv/bin/pip install --quiet --disable-pip-version-check --no-compile)
if [ "${1:-}" = --demo ]; then
    mapfile -t pins < <(grep -E '^((triton|numpy|setuptools|pybind11|nvidia-cutlass)==|wheel$)' \
        requirements-test.txt | sed 's/ *#.*//')
    "${pip_quiet[@]}" torch==2.13.0 "${pins[@]}"
    "${pip_quiet[@]}" --no-build-isolation --no-deps -e .
    exit 0
fi
"${pip_quiet[@]}" torch==2.13.0 -r requirements-test.txt
# Without a GPU the tests need no _C: they read its host code from the SIMT executor's build
# (g++, on first use), and CI checks every architecture's machine code on the release wheel's.
"${pip_quiet[@]}" --no-build-isolation --no-deps -e .
# vLLM and its pure-Python imports with --no-deps: its own pins would pull a CUDA torch and
# flashinfer.
"${pip_quiet[@]}" --no-deps -r requirements-vllm.txt
# The previous minor's package alone, for scripts/test.sh's second run of the vLLM tests.
previous_vllm=$(sed -n 's/^vllm==//p' requirements-vllm-0.33.txt)
[ -d "build/vllm-0.33/vllm-$previous_vllm.dist-info" ] \
    || "${pip_quiet[@]}" --no-deps --upgrade --target build/vllm-0.33 -r requirements-vllm-0.33.txt
