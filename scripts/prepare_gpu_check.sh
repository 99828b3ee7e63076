#!/usr/bin/env bash
# Prepares the GPU check on this CPU machine (the GPU machine has no network): one command,
#   bash scripts/prepare_gpu_check.sh
# then make the run call it prints. Into ignored folders, each carried:
#   .gpu_check/  _C for the GPU machine's Python 3.12 and sm_90 (CMake, tools/gpu_check/build.py;
#                needs a python3.12 with its headers: PYTHON312, else pyenv's or PATH's), and the
#                CUTLASS headers xz-packed for the fallback build there;
#   .dsl/wgmma/  the wgmma family's library (python -m dsl.build; needs nvidia-cutlass-dsl);
#   .peers/      vLLM 0.34.0's Triton unified attention and FA3 library (benchmarks/fetch_peers.sh).
# A part that cannot be made here is reported and left out; the check then builds _C on the
# GPU machine, or skips what needs the missing part. Ends by checking the carry size and
# printing the call (python -m tools.gpu_check.prepare).
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
mkdir -p .gpu_check .dsl

python312=${PYTHON312:-}
if [ -z "$python312" ]; then
    for candidate in python3.12 "$(pyenv root 2>/dev/null)/versions/3.12"*/bin/python3.12; do
        if command -v "$candidate" >/dev/null 2>&1; then python312=$(command -v "$candidate"); break; fi
    done
fi
if [ -n "$python312" ]; then
    nice -n 10 "$PYTHON" -m tools.gpu_check.build --python "$python312" --out .gpu_check \
        || echo "_C for Python 3.12 did not build: the check builds it on the GPU machine"
else
    echo "no python3.12 here (set PYTHON312): the check builds _C on the GPU machine"
fi
"$PYTHON" - <<'PY'
import tarfile
from pathlib import Path

import cutlass_library

include = Path(cutlass_library.__file__).parent / "source" / "include"
with tarfile.open(".gpu_check/cutlass-include.tar.xz", "w:xz") as tar:
    for part in ("cute", "cutlass"):
        tar.add(include / part, arcname=part)
PY
nice -n 10 "$PYTHON" -m dsl.build --family wgmma --out .dsl/wgmma \
    || echo "the wgmma library did not build: the check skips the wgmma family"
PYTHON="$PYTHON" bash benchmarks/fetch_peers.sh \
    || echo "the peers were not fetched: the check skips them"
"$PYTHON" -m tools.gpu_check.prepare
