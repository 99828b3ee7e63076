"""Build hook: compiles the CUDA extension ``fp8_noncausal_attn._C`` with CMake when possible.

Environment:
  FP8NCA_BUILD_CUDA   "1" builds (fails loudly if it cannot), "0" skips; unset: build when
                      nvcc is found.
  FP8NCA_CUDA_ARCHS   CMake CUDA archs, default "90a;100a".
  FP8NCA_CUTLASS_INCLUDE  CUTLASS headers; default: the ``nvidia-cutlass`` pip package
                      (``cutlass_library/source/include``) of the interpreter running the build.
  FP8NCA_BUILD_JOBS   parallel compile jobs (default: CPU count).

nvidia-cutlass and pybind11 (build-time only) are taken from the environment pip installs into,
also under build isolation: ``pip install nvidia-cutlass==4.2.0.0 pybind11`` first.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def _find_nvcc() -> str | None:
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda_home and (Path(cuda_home) / "bin" / "nvcc").exists():
        return str(Path(cuda_home) / "bin" / "nvcc")
    return shutil.which("nvcc") or (
        "/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None
    )


def _find_cmake() -> str:
    """cmake on PATH, else the one pip's ``cmake`` package put beside this interpreter."""
    beside = Path(sys.executable).parent / "cmake"
    return shutil.which("cmake") or (str(beside) if beside.exists() else "cmake")


def _package_dir(name: str) -> Path | None:
    """Folder of package ``name`` in this interpreter, else in the environment around it.

    Under pip's build isolation the environment's own site-packages are hidden from this
    process; a child interpreter without the isolation variables still sees them.
    """
    spec = importlib.util.find_spec(name)
    if spec is not None and spec.submodule_search_locations:
        return Path(list(spec.submodule_search_locations)[0])
    hidden = ("PYTHONPATH", "PYTHONNOUSERSITE", "PYTHONHOME", "PYTHONSAFEPATH")
    env = {k: v for k, v in os.environ.items() if k not in hidden}
    code = (
        f"import importlib.util as u; s = u.find_spec({name!r}); "
        "print(list(s.submodule_search_locations)[0] if s else '')"
    )
    try:
        found = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return Path(found) if found else None


def _find_cutlass_include() -> str | None:
    env = os.environ.get("FP8NCA_CUTLASS_INCLUDE")
    if env:
        return env
    package = _package_dir("cutlass_library")
    include = package / "source" / "include" if package else None
    return str(include) if include and (include / "cute").is_dir() else None


def _find_pybind11_cmake_dir() -> str | None:
    package = _package_dir("pybind11")
    cmake_dir = package / "share" / "cmake" / "pybind11" if package else None
    return str(cmake_dir) if cmake_dir and cmake_dir.is_dir() else None


def _build_plan() -> tuple[bool, str]:
    """Whether to build the extension, and the one line that says why not."""
    flag = os.environ.get("FP8NCA_BUILD_CUDA", "").strip()
    if flag == "0":
        return False, "FP8NCA_BUILD_CUDA=0"
    missing = []
    if flag != "1" and _find_nvcc() is None:
        missing.append("nvcc not found (set CUDA_HOME or FP8NCA_BUILD_CUDA=1)")
    if _find_cutlass_include() is None:
        missing.append("CUTLASS headers not found (pip install nvidia-cutlass==4.2.0.0)")
    if _find_pybind11_cmake_dir() is None:
        missing.append("pybind11 not importable")
    if not missing:
        return True, ""
    reason = "; ".join(missing)
    if flag == "1":
        raise RuntimeError(f"FP8NCA_BUILD_CUDA=1 but the CUDA extension cannot be built: {reason}")
    return False, reason


class CMakeBuild(build_ext):
    """Configures and builds CMakeLists.txt, placing _C*.so where setuptools expects it."""

    def build_extension(self, ext: Extension) -> None:
        out_path = Path(self.get_ext_fullpath(ext.name)).resolve()
        out_path.parent.mkdir(parents=True, exist_ok=True)
        build_dir = ROOT / "build" / "cmake"
        build_dir.mkdir(parents=True, exist_ok=True)
        nvcc = _find_nvcc()
        cmake = _find_cmake()
        args = [
            cmake,
            "-S",
            str(ROOT),
            "-B",
            str(build_dir),
            "-DCMAKE_BUILD_TYPE=Release",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={_find_pybind11_cmake_dir()}",
            f"-DCUTLASS_INCLUDE_DIR={_find_cutlass_include()}",
            f"-DFP8NCA_OUTPUT_DIR={out_path.parent}",
        ]
        if nvcc:
            args.append(f"-DCMAKE_CUDA_COMPILER={nvcc}")
        # A changed arch list must reach CMake even when the cache already holds one.
        archs = os.environ.get("FP8NCA_CUDA_ARCHS", "90a;100a")
        args.append("-DCMAKE_CUDA_ARCHITECTURES=" + ";".join(f"{a}-real" for a in archs.split(";")))
        jobs = os.environ.get("FP8NCA_BUILD_JOBS", str(os.cpu_count() or 1))
        subprocess.run(args, check=True)
        log = build_dir / "ptxas.log"
        with open(log, "w") as fh:
            proc = subprocess.run(
                [cmake, "--build", str(build_dir), "--target", "_C", "-j", jobs],
                stdout=fh,
                stderr=subprocess.STDOUT,
            )
        if proc.returncode != 0:
            sys.stderr.write(log.read_text()[-20000:])
            raise RuntimeError(f"CUDA extension build failed (log: {log})")
        built = sorted(out_path.parent.glob("_C*.so"), key=lambda p: p.stat().st_mtime)
        if not built:
            raise RuntimeError(f"CMake produced no _C*.so in {out_path.parent}")
        if built[-1] != out_path:
            shutil.copy2(built[-1], out_path)
        print(f"fp8_noncausal_attn: built {out_path} (archs {archs}; ptxas report: {log})")


_BUILD, _WHY_NOT = _build_plan()
if not _BUILD:
    print(f"fp8_noncausal_attn: skipping the CUDA extension build ({_WHY_NOT})")

setup(
    ext_modules=[Extension("fp8_noncausal_attn._C", sources=[])] if _BUILD else [],
    cmdclass={"build_ext": CMakeBuild} if _BUILD else {},
)
