#!/usr/bin/env bash
# Quick start, command 2: set up (idempotent), then lint and run the whole test suite.
# vLLM 0.33.0 and its pure-Python imports are installed with --no-deps: its own pins would pull
# a CUDA torch and flashinfer.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/pip install --quiet --disable-pip-version-check --no-deps -r requirements-vllm.txt
.venv/bin/ruff check .
.venv/bin/ruff format --check .
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
