#!/usr/bin/env bash
# Installs a built wheel into a fresh venv and checks, outside the source tree, that the package
# imports from the venv, that _C loads and holds a cubin for every arch it was built for (and
# PTX for the last), and that the metadata (version, entry point, py.typed) came along.
#
#   bash scripts/smoke_test_wheel.sh --prepare      # fresh venv + CPU torch only (can run
#                                                   # while the wheel builds)
#   bash scripts/smoke_test_wheel.sh WHEEL [ARCHS]  # ARCHS: the expected list, e.g. "90",
#                                                   # "89;90;100f;120" or "all" (default:
#                                                   # FP8NCA_CUDA_ARCHS)
#
# cuobjdump comes from .venv (pip nvidia-cuda-cuobjdump, requirements-test.txt) or PATH.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=build/smoke-venv
python_bin=$(command -v python3.11 || command -v python3)

if [ "${1:-}" = "--prepare" ]; then
  rm -rf "$venv"
  "$python_bin" -m venv "$venv"
  # Pinned CPU torch, as scripts/setup.sh does (an unpinned torch pulls a multi-GB CUDA build).
  # --no-compile: one process imports them, once.
  "$venv/bin/pip" install --quiet --disable-pip-version-check --no-compile torch==2.13.0 numpy
  exit 0
fi

wheel=${1:?usage: smoke_test_wheel.sh --prepare | WHEEL [ARCHS]}
archs=${2:-${FP8NCA_CUDA_ARCHS:-}}
if [ "$archs" = all ]; then  # every supported one: setup.py reads them from CMakeLists.txt
  archs=$(.venv/bin/python -c 'import setup; print(";".join(setup.supported_archs()))')
fi
[ -x "$venv/bin/python" ] || bash "$0" --prepare
"$venv/bin/pip" install --quiet --disable-pip-version-check --no-compile --force-reinstall \
    --no-deps "$wheel"

cuobjdump=$(command -v cuobjdump || true)
for candidate in .venv/lib/python3*/site-packages/nvidia/cu*/bin/cuobjdump; do
  if [ -x "$candidate" ]; then cuobjdump=$candidate; break; fi
done
[ -n "$cuobjdump" ] || { echo "smoke_test_wheel.sh: no cuobjdump (see requirements-test.txt)" >&2; exit 2; }
cuobjdump=$(realpath "$cuobjdump")
venv_python="$PWD/$venv/bin/python"  # not resolved: the symlink is what makes it the venv

# From an empty folder: the source tree must not be importable.
cd "$(mktemp -d)"
"$venv_python" - "$cuobjdump" "$archs" <<'EOF'
import importlib.metadata as metadata
import os
import re
import subprocess
import sys
from pathlib import Path

import torch

import fp8_noncausal_attn as fna
from fp8_noncausal_attn import _C
from fp8_noncausal_attn.synthetic import make_case

cuobjdump, wanted = sys.argv[1], sys.argv[2]
package = Path(fna.__file__).parent
assert Path(sys.prefix) in package.parents, f"imported {package}, not the installed wheel"
assert fna.__version__ == metadata.version("fp8-noncausal-attn"), fna.__version__
assert (package / "py.typed").exists()
plugins = metadata.entry_points(group="vllm.general_plugins")
assert [ep.value for ep in plugins if ep.name == "fp8_noncausal_attn"] == [
    "fp8_noncausal_attn.vllm_backend:register"
], list(plugins)

built = [a.removesuffix("-real") for a in _C.CUDA_ARCHS.split(",")]
if wanted:
    expected = [re.sub(r"-(real|virtual)$", "", a) for a in wanted.split(";") if a]
    assert built == expected, f"_C.CUDA_ARCHS {built}, expected {expected}"
env = dict(os.environ, PATH=f"{Path(cuobjdump).parent}{os.pathsep}{os.environ['PATH']}")
listing = subprocess.run(
    [cuobjdump, "-lelf", "-lptx", _C.__file__], capture_output=True, text=True, env=env, check=True
).stdout
cubins = set(re.findall(r"\.sm_(\w+)\.cubin", listing))
ptx = set(re.findall(r"\.sm_(\w+)\.ptx", listing))
# cuobjdump names a family cubin (sm_100f) by its base architecture (sm_100).
missing = [a for a in built if a.removesuffix("f") not in cubins and a not in cubins]
assert not missing, f"no cubin for {missing} in {_C.__file__}:\n{listing}"
ptx_arch = getattr(_C, "PTX_ARCH", "")
assert not ptx_arch or ptx_arch in ptx, f"no PTX for {ptx_arch} in {_C.__file__}:\n{listing}"
cuda = fna.available_backends()["mma_sync"]
assert "not built" not in cuda["reason"], cuda

case = make_case([8, 8], [40, 70], num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16)
out = fna.paged_attention(*case.args(), **case.kwargs(), backend="reference")
assert out.shape == case.query.shape and bool(torch.isfinite(out.float()).all())
print(
    f"smoke test: {package} {fna.__version__}; _C archs {built}, cubins {sorted(cubins)}, "
    f"PTX {sorted(ptx) or 'none'}; mma_sync backend: {cuda['reason']}; reference ran"
)
EOF
