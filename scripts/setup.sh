#!/usr/bin/env bash
# Idempotent setup of .venv: CPU torch 2.13.0 (pinned: an unpinned torch pulls a multi-GB CUDA
# build), triton, this package in editable mode, and vLLM 0.34.0 for its backend's tests (and
# vLLM 0.33.0's package in build/vllm-0.33 for their second run). The CUDA extension is built
# when nvcc is found (see setup.py); FP8NCA_BUILD_CUDA=0 skips it.
set -euo pipefail
cd "$(dirname "$0")/.."
python_bin=$(command -v python3.11 || command -v python3)
[ -x .venv/bin/python ] || "$python_bin" -m venv .venv
pip_quiet=(.venv/bin/pip install --quiet --disable-pip-version-check)
"${pip_quiet[@]}" torch==2.13.0 -r requirements-test.txt
"${pip_quiet[@]}" --no-build-isolation --no-deps -e .
# vLLM and its pure-Python imports with --no-deps: its own pins would pull a CUDA torch and
# flashinfer.
"${pip_quiet[@]}" --no-deps -r requirements-vllm.txt
# The previous minor's package alone, for scripts/test.sh's second run of the vLLM tests.
previous_vllm=$(sed -n 's/^vllm==//p' requirements-vllm-0.33.txt)
[ -d "build/vllm-0.33/vllm-$previous_vllm.dist-info" ] \
    || "${pip_quiet[@]}" --no-deps --upgrade --target build/vllm-0.33 -r requirements-vllm-0.33.txt
