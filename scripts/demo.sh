#!/usr/bin/env bash
# Quick start, command 1: set up (idempotent) and run the demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --demo
exec .venv/bin/python -m fp8_noncausal_attn
