"""The test extension ``fp8nca_host_hooks`` (tests/ext/host_hooks.cpp): built here, never shipped.

It compiles the CUDA kernels' own index maps, cache quantisation and split-KV merge row
(``FP8NCA_HD`` functions of csrc/) with the host C++ compiler, so the CPU tests check the very
maps the kernels use, and the SIMT executor's twin of the hardware's primitives (one warp of it
for mma.sync and ldmatrix). It needs a C++ compiler (``$CXX``, else c++) and pybind11,
no CUDA toolkit. The module is built once per source state into ``build/host-hooks/<hash>/``:
the hash covers the hook source, every header under csrc/ and the executor's runtime, so an
edited map is rebuilt.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "tests" / "ext" / "host_hooks.cpp"
# The SIMT executor, whose twin of the warp primitives the hooks run one warp of.
EXECUTOR = ROOT / "csrc" / "simt" / "runtime.cpp"
NAME = "fp8nca_host_hooks"


def _source_hash() -> str:
    digest = hashlib.sha256(SOURCE.read_bytes())
    for header in sorted([*(ROOT / "csrc").rglob("*.h"), EXECUTOR]):
        digest.update(str(header.relative_to(ROOT)).encode() + header.read_bytes())
    return digest.hexdigest()[:16]


def compile_command(output: Path) -> list[str]:
    """The compiler call that builds the module into ``output``."""
    import pybind11

    cxx = os.environ.get("CXX") or shutil.which("c++") or "g++"
    return [
        cxx, "-O1", "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden",
        f"-I{pybind11.get_include()}", f"-I{sysconfig.get_paths()['include']}",
        f"-I{ROOT / 'csrc'}", str(SOURCE), str(EXECUTOR), "-o", str(output),
    ]  # fmt: skip


@functools.cache
def load() -> ModuleType:
    """The hooks module, compiled first when this source state has no build yet.

    Raises RuntimeError with the compiler's output when the build fails, ImportError when
    pybind11 is missing.
    """
    folder = ROOT / "build" / "host-hooks" / _source_hash()
    library = folder / f"{NAME}{sysconfig.get_config_var('EXT_SUFFIX')}"
    if not library.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        # Built beside and renamed: test processes running at once never load a partial file.
        with tempfile.TemporaryDirectory(dir=folder) as temp:
            partial = Path(temp) / library.name
            proc = subprocess.run(compile_command(partial), capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"building {NAME} failed:\n{proc.stdout}{proc.stderr}")
            os.replace(partial, library)
    spec = importlib.util.spec_from_file_location(NAME, library)
    module = importlib.util.module_from_spec(spec)
    sys.modules[NAME] = module
    spec.loader.exec_module(module)
    return module
