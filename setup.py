"""Build hook: compiles the CUDA extension ``fp8_noncausal_attn._C`` with CMake when nvcc is found.

Metadata lives in pyproject.toml; this file only decides whether the wheel gets ``_C``.

Environment (the README's "Environment variables" section lists them too):
  FP8NCA_BUILD_CUDA       "1": ``_C`` must be built, anything that would skip it is an error;
                          "0": skip it; unset: build when nvcc is found, except an editable
                          install (``pip install -e``) on a machine with no GPU visible and no
                          FP8NCA_CUDA_ARCHS, where nothing could run it; else skip with a warning.
  CUDA_HOME (CUDA_PATH)   the CUDA toolkit whose ``bin/nvcc`` builds ``_C``; unset: nvcc on PATH.
                          No other place is searched.
  FP8NCA_CUDA_ARCHS       CUDA architectures, e.g. "90" or "89;90" (machine code for each, PTX for
                          the last), or "all": every supported one (CMakeLists.txt's list); unset:
                          the visible GPUs' (nvidia-smi; none when CUDA_VISIBLE_DEVICES is empty),
                          else every supported one.
  FP8NCA_CUTLASS_INCLUDE  CUTLASS headers; default: the ``nvidia-cutlass`` package of the build
                          environment (``cutlass_library/source/include``).
  FP8NCA_BUILD_JOBS       parallel compile jobs (default: CPU count).
  FP8NCA_BUILD_CACHE      a folder of built ``_C`` keyed by the hash of what they are compiled
                          from (extension_key): a build whose key is there copies it instead of
                          compiling, a new one is stored there; unset: no cache.
  FP8NCA_BUILD_DSL        "1": also compile the CUTLASS-DSL families (wgmma, tcgen05) ahead of
                          time into the package (``fp8_noncausal_attn/_<family>/``: one libc-only
                          library with the cubins inside, build.json, the cubins for SASS checks);
                          or a comma-separated list of families; unset/"0": not (the default: it
                          adds minutes, and the families are opt-in, never run on hardware).
                          Needs nvidia-cutlass-dsl[cu13]==4.8.1 in the environment pip builds
                          from (not in build-system.requires), a C compiler (CC/CXX) and
                          CUDA_HOME's libcudart_static.a; no GPU.

Under build isolation (pip's default) pybind11, nvidia-cutlass and cmake come from
``build-system.requires``; with ``--no-build-isolation`` they must be installed beforehand.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

from setuptools import Distribution, Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
PACKAGE = "fp8_noncausal_attn"
CMAKE_MIN_VERSION = (3, 24)  # cmake_minimum_required in CMakeLists.txt
BUILD_FLAG = "FP8NCA_BUILD_CUDA"
ARCHS_VAR = "FP8NCA_CUDA_ARCHS"
CACHE_VAR = "FP8NCA_BUILD_CACHE"
# What _C is compiled from, besides CMakeLists.txt: these folders' sources and headers.
EXTENSION_SOURCE_DIRS = ("csrc", "python")
EXTENSION_SOURCE_SUFFIXES = (".cu", ".cuh", ".cpp", ".cc", ".h", ".hpp", ".inl")
DSL_FLAG = "FP8NCA_BUILD_DSL"
DSL_FAMILIES = ("wgmma", "tcgen05")


def find_nvcc(environ: Mapping[str, str] = os.environ) -> str | None:
    """``$CUDA_HOME/bin/nvcc`` (or ``$CUDA_PATH``), else nvcc on ``PATH``; nowhere else."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = environ.get(var)
        if home and (Path(home) / "bin" / "nvcc").is_file():
            return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc", path=environ.get("PATH", ""))


def find_cmake(environ: Mapping[str, str] = os.environ) -> str | None:
    """cmake on ``PATH``, else the one pip's ``cmake`` package put beside this interpreter."""
    beside = Path(sys.executable).parent / "cmake"
    return shutil.which("cmake", path=environ.get("PATH", "")) or (
        str(beside) if beside.exists() else None
    )


def find_host_compiler(environ: Mapping[str, str] = os.environ) -> str | None:
    """The C++ compiler CMake and nvcc will use: ``$CXX``, else c++ or g++ on ``PATH``."""
    path = environ.get("PATH", "")
    cxx = environ.get("CXX")
    if cxx:
        return shutil.which(cxx, path=path) or (cxx if Path(cxx).is_file() else None)
    return shutil.which("c++", path=path) or shutil.which("g++", path=path)


def tool_version(tool: str) -> tuple[tuple[int, ...] | None, str]:
    """(version, "") from ``tool --version``, or (None, why it could not run) in words."""
    try:
        result = subprocess.run(
            [tool, "--version"], capture_output=True, text=True, timeout=60, check=False
        )
    except PermissionError:
        return None, f"{tool} is not executable"
    except (OSError, subprocess.SubprocessError) as err:
        return None, f"{tool} does not run ({err.__class__.__name__}: {err})"
    if result.returncode != 0:
        return None, f"'{tool} --version' failed: {(result.stderr or result.stdout).strip()[:200]}"
    found = re.search(r"(?:version|release) (\d+)\.(\d+)(?:\.(\d+))?", result.stdout)
    if not found:
        return None, f"'{tool} --version' printed no version: {result.stdout.strip()[:200]}"
    return tuple(int(part) for part in found.groups() if part is not None), ""


def _package_dir(name: str) -> Path | None:
    """Folder of package ``name`` in this interpreter, else in the environment around it.

    Under pip's build isolation the environment's own site-packages are hidden from this
    process; a child interpreter started with ``-I`` (no PYTHONPATH, so none of pip's
    path tricks, and not the current folder) sees them.
    """
    spec = importlib.util.find_spec(name)
    if spec is not None and spec.submodule_search_locations:
        return Path(list(spec.submodule_search_locations)[0])
    return _package_dir_outside(name)


def _package_dir_outside(name: str) -> Path | None:
    code = (
        f"import importlib.util as u; s = u.find_spec({name!r}); "
        "print(list(s.submodule_search_locations)[0] if s and s.submodule_search_locations "
        "else '')"
    )
    try:
        found = subprocess.run(
            [sys.executable, "-I", "-c", code],
            capture_output=True, text=True, timeout=60, cwd=tempfile.gettempdir(),
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return Path(found) if found else None


def find_cutlass_include() -> str | None:
    env = os.environ.get("FP8NCA_CUTLASS_INCLUDE")
    if env:
        return env
    package = _package_dir("cutlass_library")
    include = package / "source" / "include" if package else None
    return str(include) if include and (include / "cute").is_dir() else None


def find_pybind11_cmake_dir() -> str | None:
    package = _package_dir("pybind11")
    cmake_dir = package / "share" / "cmake" / "pybind11" if package else None
    return str(cmake_dir) if cmake_dir and cmake_dir.is_dir() else None


def supported_archs(root: Path = ROOT) -> tuple[str, ...]:
    """Every architecture ``_C`` supports: CMakeLists.txt's default list, oldest first."""
    cmakelists = (root / "CMakeLists.txt").read_text()
    found = re.search(r'set\(FP8NCA_DEFAULT_ARCHS "([^"]+)"\)', cmakelists)
    if found is None:
        raise RuntimeError("CMakeLists.txt sets no FP8NCA_DEFAULT_ARCHS")
    return tuple(found.group(1).split(";"))


def visible_gpu_capabilities(environ: Mapping[str, str] = os.environ) -> list[tuple[int, int]]:
    """(major, minor) of every GPU the driver reports (``nvidia-smi``), none when
    ``CUDA_VISIBLE_DEVICES`` hides them all or there is no driver. Not torch: pip's isolated
    build environment has none."""
    if environ.get("CUDA_VISIBLE_DEVICES", "unset").strip() in ("", "-1"):
        return []
    smi = shutil.which("nvidia-smi", path=environ.get("PATH", ""))
    if smi is None:
        return []
    query = [smi, "--query-gpu=compute_cap", "--format=csv,noheader"]
    try:
        result = subprocess.run(query, capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.SubprocessError):
        return []
    found = re.findall(r"^\s*(\d+)\.(\d+)\s*$", result.stdout if result.returncode == 0 else "",
                       flags=re.MULTILINE)  # fmt: skip
    return [(int(major), int(minor)) for major, minor in found]


def arch_for(capability: tuple[int, int], supported: tuple[str, ...]) -> str | None:
    """The entry of ``supported`` whose machine code a GPU of ``capability`` runs: same major
    version, the newest minor not above the GPU's (``100f`` serves the whole sm_10x family)."""
    runnable = []
    for arch in supported:
        digits = re.match(r"\d+", arch).group()
        major, minor = int(digits[:-1]), int(digits[-1])
        if major == capability[0] and minor <= capability[1]:
            runnable.append((minor, arch))
    return max(runnable)[1] if runnable else None


def cuda_archs(
    environ: Mapping[str, str] = os.environ, capabilities: list[tuple[int, int]] | None = None
) -> tuple[list[str], str]:
    """The architectures ``_C`` is built for and why, in a few words (FP8NCA_CUDA_ARCHS, else
    the visible GPUs', else every supported one); ``capabilities``: the visible GPUs'."""
    asked = environ.get(ARCHS_VAR, "").strip()
    supported = supported_archs()
    if asked == "all":
        return list(supported), f"{ARCHS_VAR}=all"
    if asked:
        return [arch for arch in re.split(r"[;,]", asked) if arch], f"{ARCHS_VAR}={asked}"
    if capabilities is None:
        capabilities = visible_gpu_capabilities(environ)
    archs = dict.fromkeys(a for c in capabilities if (a := arch_for(c, supported)) is not None)
    if archs:
        return list(archs), "the visible GPU's"
    seen = ", ".join(f"sm_{major}{minor}" for major, minor in capabilities)
    return list(supported), f"no supported GPU visible ({seen})" if seen else "no GPU visible"


def build_plan(environ: Mapping[str, str] = os.environ, editable: bool = False) -> tuple[bool, str]:
    """Whether this build includes ``_C`` and, when not, the reason in a few words.

    ``FP8NCA_BUILD_CUDA=1`` always plans the build (a missing tool then fails it, by name). An
    editable install (``editable``: a development set-up) builds it only for a GPU it sees or
    the architectures ``FP8NCA_CUDA_ARCHS`` names: without them nothing there could run it.
    """
    flag = environ.get(BUILD_FLAG, "").strip()
    if flag not in ("", "0", "1"):
        raise ValueError(f"{BUILD_FLAG} must be 0, 1 or unset, got {flag!r}")
    if flag == "0":
        return False, f"{BUILD_FLAG}=0"
    if flag == "1":
        return True, ""
    if not find_nvcc(environ):
        return False, "nvcc not found: set CUDA_HOME or put nvcc on PATH"
    if editable and not environ.get(ARCHS_VAR, "").strip():
        capabilities = visible_gpu_capabilities(environ)
        if not runs_on_a_visible_gpu(capabilities):
            return False, (
                f"{cuda_archs(environ, capabilities)[1]}, so nothing here could run it (an "
                f"editable install builds it for the GPU it sees; {ARCHS_VAR} or {BUILD_FLAG}=1 "
                "builds it anyway)"
            )
    return True, ""


def runs_on_a_visible_gpu(capabilities: list[tuple[int, int]] | None = None) -> bool:
    """Whether ``_C`` has code for one of the GPUs of ``capabilities`` (default: the visible
    ones)."""
    if capabilities is None:
        capabilities = visible_gpu_capabilities()
    return any(arch_for(c, supported_archs()) for c in capabilities)


def is_editable_install(argv: list[str]) -> bool:
    """Whether setuptools runs this file for an editable install (pip install -e, develop)."""
    return bool({"editable_wheel", "develop"} & set(argv))


def toolchain_problems() -> list[str]:
    """Everything missing for the CMake build, each in words a user can act on."""
    problems = []
    nvcc = find_nvcc()
    if nvcc is None:
        problems.append("nvcc not found (set CUDA_HOME to a CUDA toolkit, or put nvcc on PATH)")
    else:
        version, why = tool_version(nvcc)
        if version is None:
            problems.append(why)
    cmake = find_cmake()
    if cmake is None:
        problems.append(
            "cmake not found (pip install 'cmake>=3.24', or your system's cmake; pip installs it "
            "itself under build isolation)"
        )
    else:
        version, why = tool_version(cmake)
        if version is None:
            problems.append(why)
        elif version < CMAKE_MIN_VERSION:
            need = ".".join(map(str, CMAKE_MIN_VERSION))
            have = ".".join(map(str, version))
            problems.append(f"{cmake} is version {have}; CMakeLists.txt needs {need} or newer")
    if find_host_compiler() is None:
        problems.append("no C++ compiler (set CXX, or put c++/g++ on PATH)")
    if find_cutlass_include() is None:
        problems.append(
            "CUTLASS headers not found (pip install nvidia-cutlass==4.2.0.0, or set "
            "FP8NCA_CUTLASS_INCLUDE)"
        )
    if find_pybind11_cmake_dir() is None:
        problems.append("pybind11 not importable (pip install pybind11)")
    return problems


def installed_extension(root: Path = ROOT) -> Path | None:
    """An ``_C`` that the environment receiving this install already has, outside this tree.

    Installing a build without ``_C`` over it would silently drop the CUDA kernels.
    """
    package = _package_dir_outside(PACKAGE)
    if package is None or package.resolve() == (root / PACKAGE).resolve():
        return None
    built = sorted(package.glob("_C.*.so")) + sorted(package.glob("_C.*.pyd"))
    return built[0] if built else None


def say_loudly(line: str) -> None:
    """Write ``line`` to stderr, and to the terminal too when stderr is captured.

    pip hides a build's output unless it fails or runs with ``-v``; the terminal is where the
    person running pip still sees this line.
    """
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
    if sys.stderr.isatty():
        return
    try:
        with open("/dev/tty", "w") as tty:
            tty.write("\n" + line + "\n")  # pip's progress spinner holds the current line
    except OSError:
        pass  # no terminal (CI, a service): stderr is all there is


def skip_message(reason: str) -> str:
    return (
        f"WARNING: fp8-noncausal-attn is being built WITHOUT its CUDA kernels (_C): {reason}. "
        f"Only the triton and reference backends will run; {BUILD_FLAG}=1 makes this an error."
    )


def replacing_extension_problem(
    reason: str, existing: Path | None, environ: Mapping[str, str] = os.environ
) -> str | None:
    """Why a build without ``_C`` (skipped for ``reason``) must not replace the ``_C`` at
    ``existing``, or None when it may: there is none, or ``FP8NCA_BUILD_CUDA=0`` asked for it."""
    if existing is None or environ.get(BUILD_FLAG, "").strip() == "0":
        return None
    return (
        f"fp8-noncausal-attn: refusing to build without the CUDA extension ({reason}) while this "
        f"environment has one at {existing}: installing this build would remove it. Point "
        f"CUDA_HOME at a CUDA toolkit to rebuild it, or set {BUILD_FLAG}=0 to replace it with a "
        "build that has no CUDA kernels."
    )


def dsl_build_plan(environ: Mapping[str, str] = os.environ) -> tuple[str, ...]:
    """The DSL families this build compiles into the package: none unless ``FP8NCA_BUILD_DSL``
    is "1" (all) or names them, comma-separated."""
    flag = environ.get(DSL_FLAG, "").strip()
    if flag in ("", "0"):
        return ()
    if flag == "1":
        return DSL_FAMILIES
    families = tuple(name.strip() for name in flag.split(","))
    if not set(families) <= set(DSL_FAMILIES):
        raise ValueError(
            f"{DSL_FLAG} must be 0, 1 or a comma-separated list of {', '.join(DSL_FAMILIES)}, "
            f"got {flag!r}"
        )
    return families


def dsl_build_command(family: str, out: Path) -> list[str]:
    """``python -m dsl.build --family FAMILY --out OUT`` in a child interpreter started with
    ``-I``: under pip's build isolation it still sees the environment's own packages (the DSL),
    and it imports this tree's ``dsl/`` (build-time only, not in the wheel)."""
    code = (
        f"import sys; sys.path.insert(0, {str(ROOT)!r}); from dsl.build import main; "
        "sys.exit(main(sys.argv[1:]))"
    )
    return [sys.executable, "-I", "-c", code, "--family", family, "--out", str(out)]


def install_dsl_build(build_dir: Path, package_dir: Path, family: str) -> list[str]:
    """Copy what the package needs of one family's build (the library, build.json, the kept
    cubins; not the objects, headers and PTX) into ``package_dir/_<family>/``, replacing an
    older one. Returns the copied paths, relative to that folder."""
    record = json.loads((build_dir / "build.json").read_text())
    names = [record["library"], "build.json"]
    # A kernel that serves several variants (tcgen05: both query dtypes) is listed by each.
    names += dict.fromkeys(cubin for entry in record["variants"] for cubin in entry["cubins"])
    target = package_dir / f"_{family}"
    shutil.rmtree(target, ignore_errors=True)
    for name in names:
        (target / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(build_dir / name, target / name)
    return names


def build_dsl_families(families: tuple[str, ...], package_dir: Path, temp: Path) -> None:
    """Compile each family ahead of time (minutes: every variant) and install it."""
    for family in families:
        out = temp / f"dsl-{family}"
        print(f"fp8_noncausal_attn: compiling the {family} family ahead of time (minutes)")
        proc = subprocess.run(
            dsl_build_command(family, out), capture_output=True, text=True, check=False
        )
        if proc.returncode != 0:
            sys.stderr.write((proc.stdout + proc.stderr)[-20000:])
            raise RuntimeError(
                f"fp8-noncausal-attn: {DSL_FLAG}: building the {family} family failed (it needs "
                "nvidia-cutlass-dsl[cu13]==4.8.1 where pip builds, CC/CXX and CUDA_HOME's "
                f"libcudart_static.a); unset {DSL_FLAG} to build without it"
            )
        copied = install_dsl_build(out, package_dir, family)
        print(f"fp8_noncausal_attn: {family} family built ahead of time: {len(copied)} files")


class PlatformDistribution(Distribution):
    """A distribution holding machine code without ``_C`` (the DSL libraries alone): its wheel
    must carry a platform tag, not py3-none-any."""

    def has_ext_modules(self) -> bool:
        return True


class BuildPyWarnsWithoutCuda(build_py):
    """Runs for every wheel and editable build (not for an sdist): says when ``_C`` is skipped,
    and refuses to replace an installed ``_C`` with nothing unless ``FP8NCA_BUILD_CUDA=0``;
    compiles the DSL families into the package when ``FP8NCA_BUILD_DSL`` asks."""

    def run(self) -> None:
        planned, reason = build_plan(editable=is_editable_install(sys.argv))
        if not planned:
            existing = installed_extension()
            problem = replacing_extension_problem(reason, existing)
            if problem:
                raise RuntimeError(problem)
            if existing is not None:
                say_loudly(f"WARNING: {BUILD_FLAG}=0: this install drops the CUDA build {existing}")
            say_loudly(skip_message(reason))
        super().run()
        families = dsl_build_plan()
        if families:
            # An editable install runs the tree's package; a wheel packs build_lib.
            editable = getattr(self, "editable_mode", False)
            package_dir = ROOT / PACKAGE if editable else Path(self.build_lib) / PACKAGE
            with tempfile.TemporaryDirectory() as temp:
                build_dsl_families(families, package_dir, Path(temp))


def cmake_configure_args(
    cmake: str, build_dir: Path, output_dir: Path, archs: list[str]
) -> list[str]:
    """The CMake configure command for ``_C`` for ``archs`` (toolchain_problems() must be
    empty). The list is always explicit, so one cached by an earlier configure of the same
    build folder never outlives its setting."""
    return [
        cmake,
        "-S",
        str(ROOT),
        "-B",
        str(build_dir),
        "-DCMAKE_BUILD_TYPE=Release",
        f"-DPython_EXECUTABLE={sys.executable}",
        f"-Dpybind11_DIR={find_pybind11_cmake_dir()}",
        f"-DCUTLASS_INCLUDE_DIR={find_cutlass_include()}",
        f"-DFP8NCA_OUTPUT_DIR={output_dir}",
        f"-DCMAKE_CUDA_COMPILER={find_nvcc()}",
        f"-DFP8NCA_CUDA_ARCHS={';'.join(archs)}",
    ]


def translation_units(root: Path = ROOT) -> list[str]:
    """The sources CMakeLists.txt compiles into ``_C``, in its order."""
    cmakelists = (root / "CMakeLists.txt").read_text()
    return re.findall(r"\b((?:csrc|python)/[\w/]+\.(?:cu|cpp))\b", cmakelists)


def compiled_source(line: str) -> str | None:
    """The source a CMake build output line starts compiling (``Building CUDA object
    CMakeFiles/x.dir/csrc/a.cu.o``), else None."""
    found = re.search(r"Building (?:CUDA|CXX) object \S*?\.dir/(\S+?)\.o\b", line)
    return found.group(1) if found else None


def minutes(seconds: float) -> str:
    return f"{int(seconds // 60)} min {int(seconds % 60):02d} s"


def extension_key(archs: list[str], root: Path = ROOT) -> str:
    """sha256 of everything a built ``_C`` depends on: CMakeLists.txt, setup.py, pyproject.toml
    (the build requirements' pins), every source and header under csrc/ and python/, the
    architectures, nvcc's version, the CUTLASS headers' folder, pybind11's and this Python's
    versions."""
    digest = hashlib.sha256()
    files = [root / "CMakeLists.txt", root / "setup.py", root / "pyproject.toml"]
    for folder in EXTENSION_SOURCE_DIRS:
        files += sorted(
            path for path in (root / folder).rglob("*")
            if path.is_file() and path.suffix in EXTENSION_SOURCE_SUFFIXES
        )  # fmt: skip
    for path in files:
        digest.update(f"{path.relative_to(root)}\0".encode() + path.read_bytes() + b"\0")
    nvcc = find_nvcc()
    nvcc_version = tool_version(nvcc)[0] if nvcc else None
    try:
        pybind11_version = importlib.metadata.version("pybind11")
    except importlib.metadata.PackageNotFoundError:
        pybind11_version = None
    toolchain = (archs, nvcc_version, find_cutlass_include(), pybind11_version, sys.version)
    digest.update(repr(toolchain).encode())
    return digest.hexdigest()


def cached_extension(archs: list[str], name: str) -> Path | None:
    """Where ``FP8NCA_BUILD_CACHE`` keeps the ``_C`` file ``name`` built for ``archs`` from
    this tree, or None when no cache is set."""
    cache = os.environ.get(CACHE_VAR, "").strip()
    return Path(cache) / extension_key(archs) / name if cache else None


def store_in_cache(built: Path, cached: Path) -> None:
    """Copy ``built`` to ``cached`` whole or not at all (a concurrent reader never sees part)."""
    cached.parent.mkdir(parents=True, exist_ok=True)
    partial = cached.with_name(f".{cached.name}.{os.getpid()}")
    shutil.copy2(built, partial)
    partial.replace(cached)


class CMakeBuild(build_ext):
    """Checks the toolchain, then configures and builds CMakeLists.txt, placing _C*.so where
    setuptools expects it."""

    def build_extension(self, ext: Extension) -> None:
        problems = toolchain_problems()
        if problems:
            why = "; ".join(problems)
            raise RuntimeError(
                f"fp8-noncausal-attn: cannot build the CUDA extension _C: {why}. "
                f"({BUILD_FLAG}=0 installs without it.)"
            )
        out_path = Path(self.get_ext_fullpath(ext.name)).resolve()
        out_path.parent.mkdir(parents=True, exist_ok=True)
        archs, why = cuda_archs()
        cached = cached_extension(archs, out_path.name)
        if cached is not None and cached.is_file():
            shutil.copy2(cached, out_path)
            say_loudly(f"fp8_noncausal_attn: _C for sm_{', sm_'.join(archs)} ({why}) from "
                       f"{CACHE_VAR}, built from the same inputs: {cached}")  # fmt: skip
            return
        build_dir = ROOT / "build" / "cmake"
        build_dir.mkdir(parents=True, exist_ok=True)
        cmake = find_cmake()
        assert cmake is not None  # toolchain_problems() said so
        args = cmake_configure_args(cmake, build_dir, out_path.parent, archs)
        jobs = os.environ.get("FP8NCA_BUILD_JOBS", str(os.cpu_count() or 1))
        subprocess.run(args, check=True)
        log = build_dir / "ptxas.log"
        sources = translation_units()
        say_loudly(
            f"fp8_noncausal_attn: compiling _C for sm_{', sm_'.join(archs)} ({why}): "
            f"{len(sources)} translation units, {jobs} at a time; minutes per architecture"
        )
        start, started = time.monotonic(), 0
        with open(log, "w") as fh:
            proc = subprocess.Popen(
                [cmake, "--build", str(build_dir), "--target", "_C", "-j", jobs],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            )  # fmt: skip
            for line in proc.stdout:
                fh.write(line)
                source = compiled_source(line)
                if source is not None:
                    started += 1
                    say_loudly(f"fp8_noncausal_attn: [{started}/{len(sources)}] {source} "
                               f"({minutes(time.monotonic() - start)})")  # fmt: skip
        if proc.wait() != 0:
            sys.stderr.write(log.read_text()[-20000:])
            raise RuntimeError(f"CUDA extension build failed (log: {log})")
        built = sorted(out_path.parent.glob("_C*.so"), key=lambda p: p.stat().st_mtime)
        if not built:
            raise RuntimeError(f"CMake produced no _C*.so in {out_path.parent}")
        if built[-1] != out_path:
            shutil.copy2(built[-1], out_path)
        say_loudly(f"fp8_noncausal_attn: built {out_path} for sm_{', sm_'.join(archs)} in "
                   f"{minutes(time.monotonic() - start)} (ptxas report: {log})")  # fmt: skip
        if cached is not None:
            store_in_cache(out_path, cached)


if __name__ == "__main__":
    BUILD_CUDA, _ = build_plan(editable=is_editable_install(sys.argv))
    setup(
        ext_modules=[Extension(f"{PACKAGE}._C", sources=[])] if BUILD_CUDA else [],
        cmdclass={"build_py": BuildPyWarnsWithoutCuda, "build_ext": CMakeBuild},
        distclass=PlatformDistribution if dsl_build_plan() else Distribution,
    )
