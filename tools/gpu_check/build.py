"""Build ``_C`` with CMake for one Python and one GPU arch, outside setup.py.

The preparation runs it on the CPU machine for the GPU machine's Python (3.12 there); the check
runs it on the GPU machine only when the carried extension is missing or does not load. CMake
directly, not ``setup.py``: the build then needs no setuptools recent enough for
``pyproject.toml``'s metadata, only cmake, nvcc, a C++ compiler, pybind11 and CUTLASS headers.

    python -m tools.gpu_check.build --python python3.12 --out DIR [--archs 90] [--cutlass DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from .plan import PREPARED, REPO

# The H200's arch: the mma_sync family's machine code for sm_90 (its PTX too).
DEVICE_ARCHS = "90"
# The CUTLASS headers the build reads, packed by the preparation (the GPU machine has none).
CUTLASS_ARCHIVE = "cutlass-include.tar.xz"


def cutlass_include(folder: Path) -> Path:
    """CUTLASS headers: the environment's nvidia-cutlass package, else the preparation's
    archive unpacked into ``folder``."""
    try:
        import cutlass_library

        include = Path(cutlass_library.__file__).parent / "source" / "include"
        if (include / "cute").is_dir():
            return include
    except ImportError:
        pass
    archive = REPO / PREPARED / CUTLASS_ARCHIVE
    if not archive.is_file():
        raise FileNotFoundError(
            f"no CUTLASS headers: nvidia-cutlass is not installed, no {archive}"
        )
    with tarfile.open(archive) as tar:
        tar.extractall(folder, filter="data")
    return folder


def cmake_commands(
    python: str, build_dir: Path, out_dir: Path, cutlass: Path, archs: str, jobs: int
) -> list[list[str]]:
    """The configure and build commands of ``_C`` for interpreter ``python``."""
    import pybind11

    cmake = shutil.which("cmake") or str(Path(sys.executable).parent / "cmake")
    return [
        [
            cmake, "-S", str(REPO), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release",
            f"-DPython_EXECUTABLE={python}", f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DCUTLASS_INCLUDE_DIR={cutlass}", f"-DFP8NCA_OUTPUT_DIR={out_dir.resolve()}",
            f"-DFP8NCA_CUDA_ARCHS={archs}",
        ],
        [cmake, "--build", str(build_dir), "--target", "_C", "-j", str(jobs)],
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.gpu_check.build")
    parser.add_argument("--python", default=sys.executable, help="the interpreter _C is for")
    parser.add_argument("--out", type=Path, required=True, help="folder for _C*.so")
    parser.add_argument("--archs", default=DEVICE_ARCHS)
    parser.add_argument("--build-dir", type=Path, help="CMake's folder (default: a temporary one)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="fp8nca-build-") as scratch:
        build_dir = args.build_dir or Path(scratch) / "cmake"
        cutlass = cutlass_include(Path(scratch) / "cutlass")
        for command in cmake_commands(
            args.python, build_dir, args.out, cutlass, args.archs, os.cpu_count() or 1
        ):
            print("+", " ".join(command), flush=True)
            done = subprocess.run(command, check=False)
            if done.returncode != 0:
                return done.returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
