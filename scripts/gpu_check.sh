#!/usr/bin/env bash
# The GPU check, one command of at most 420 s on an H200 (tools/gpu_check runs it):
#   bash scripts/gpu_check.sh OUT [--dry-run]
# Prepare first, here on the CPU machine: bash scripts/prepare_gpu_check.sh (it prints the
# device tool's run call: what to carry, this command, the time limit). Writes OUT/summary.json
# (rewritten after every step) and OUT/logs.tar.gz; exits 1 when a smoke launch, a sanitizer or
# a correctness test failed.
set -uo pipefail
cd "$(dirname "$0")/.."
export PATH="$PATH:/usr/local/cuda/bin"  # compute-sanitizer, nvcc
exec "${PYTHON:-python3}" -m tools.gpu_check "$@"
