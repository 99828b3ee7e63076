#!/usr/bin/env bash
# The Triton compile check for sm_90a (tests/test_triton_compile.py) under the GPU machine's
# Triton, which is older than the suite's: a kernel construct the newer Triton accepts and the
# H200's rejects (or spills under) would otherwise first show on a GPU lease. (scripts/test.sh's
# full run compiles sm_90 only here, and sm_100 under the suite's Triton.) Runs in
# .venv-triton36 (made here, idempotently) with the suite's CPU torch and test pins; compiling
# needs no GPU. Called by scripts/test.sh's full run.
set -euo pipefail
cd "$(dirname "$0")/.."
device_triton=3.6.0  # the H200 machine's image: torch 2.11 + Triton 3.6.0
venv=.venv-triton36
stamp=$venv/.fp8nca-triton-stamp
# The suite's own torch (scripts/setup.sh pins it) and pins of what the check imports and runs.
torch_version=$(.venv/bin/python -c 'import torch; print(torch.__version__.split("+")[0])')
pins=$(grep -E '^(pytest|numpy|nvidia-cuda-cuobjdump|nvidia-cuda-nvdisasm)==' requirements-test.txt)
want=$(printf '%s\n' "$(cat scripts/test_triton_device.sh)" "$torch_version" "$pins" \
    | sha256sum | cut -d' ' -f1)
start=$SECONDS
if ! [ -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    python_bin=$(command -v python3.11 || command -v python3)
    [ -x "$venv/bin/python" ] || "$python_bin" -m venv "$venv"
    # --no-compile: byte-compiling all of torch made the setup 42 s instead of 13-20 s; as in
    # the other venvs, scripts/test.sh caches the bytecode of what runs.
    # shellcheck disable=SC2086  # one requirement per word
    "$venv/bin/pip" install --quiet --disable-pip-version-check --no-compile \
        "torch==$torch_version" "triton==$device_triton" $pins
    echo "$want" >"$stamp"
    echo "Triton $device_triton venv set up in $((SECONDS - start)) s"
fi
# The test asserts the compiler it ran is this version, so a venv that drifted cannot pass.
FP8NCA_TRITON_VERSION=$device_triton "$venv/bin/python" -m pytest -q -p no:cacheprovider \
    "tests/test_triton_compile.py::test_triton_kernels_compile_for_gpu_target_without_spills[90]"
echo "Triton $device_triton compile check passed in $((SECONDS - start)) s"
