"""The CUDA kernels of csrc/ run on the CPU by the SIMT executor (csrc/simt/): a test tool, slow.

The executor module is ``_C``'s own source (python/bindings.cpp, csrc/) compiled by the host C++
compiler (``$CXX``, else c++) against csrc/simt/'s CPU twin of CUDA, with the kernel
translation units instrumented (-fsanitize=thread, whose entry points the executor defines) so
that every memory access is checked. It has ``_C``'s functions and takes CPU pointers; nothing
is asynchronous. It is built on first use from a source checkout (csrc/ and python/ beside the
package) and cached by a hash of what each object is compiled from, so a kernel edit is
rebuilt by the next call: ``build/simt/`` under the checkout, or ``$FP8NCA_SIMT_CACHE``.
Needs pybind11 and no CUDA toolkit.

It runs only where :data:`ENABLE_ENV` is ``1``, as Triton's kernels take CPU tensors only under
``TRITON_INTERPRET=1``: asking what runs here (``available_backends()``, the demo) never starts
a build of minutes, and a machine without a GPU compiles no kernel unless asked to.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sysconfig
import tempfile
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType

import torch

ROOT = Path(__file__).resolve().parents[3]
CSRC = ROOT / "csrc"
BINDINGS = ROOT / "python" / "bindings.cpp"
# The attention kernels' translation units (csrc/mma_sync/<name>.cu).
ATTENTION_UNITS = tuple(f"attention_d{d}{kind}" for d in (64, 128, 256) for kind in ("", "_pth"))
STATUS = "the SIMT executor: csrc/'s kernels run on CPU tensors (a test tool, slow)"
ENABLE_ENV = "FP8NCA_SIMT"

_COMMON = ["-std=c++17", "-O1", "-fPIC", "-fno-strict-aliasing", "-fvisibility=hidden"]
# The kernels' loads and stores call the executor's __tsan_* hooks (csrc/simt/runtime.h).
_INSTRUMENT = ["-fsanitize=thread", "--param", "tsan-instrument-func-entry-exit=0"]


def _compiler() -> str:
    return os.environ.get("CXX") or shutil.which("c++") or "g++"


def availability() -> tuple[bool, str]:
    """Whether the executor runs here: asked for (:data:`ENABLE_ENV`), and buildable (a source
    checkout, a C++ compiler, pybind11)."""
    if os.environ.get(ENABLE_ENV) != "1":
        return False, f"CPU tensors run on the SIMT executor only with {ENABLE_ENV}=1 ({STATUS})"
    if not (CSRC / "simt" / "runtime.cpp").is_file() or not BINDINGS.is_file():
        return False, "the SIMT executor builds from a source checkout (csrc/, python/)"
    if shutil.which(_compiler()) is None:
        return False, "the SIMT executor needs a C++ compiler ($CXX or c++)"
    if importlib.util.find_spec("pybind11") is None:
        return False, "the SIMT executor needs pybind11 (pip install pybind11)"
    return True, STATUS


def _cache_dir() -> Path:
    return Path(os.environ.get("FP8NCA_SIMT_CACHE") or ROOT / "build" / "simt")


def _compile_args(csrc: Path, source: Path, units: Sequence[str]) -> list[str]:
    """The compiler's flags for one object (without -c and -o)."""
    args = [*_COMMON, f"-I{csrc / 'simt' / 'include'}", f"-I{csrc}"]
    if source.suffix == ".cu":
        return [*args, *_INSTRUMENT, "-x", "c++", str(source)]
    if source.name == "bindings.cpp":
        import pybind11

        args += [
            f"-I{pybind11.get_include()}",
            f"-I{sysconfig.get_paths()['include']}",
            '-DFP8NCA_CUDA_ARCHS="simt"',
            '-DFP8NCA_PTX_ARCH=""',
        ]
    if source.name == "absent_kernels.cpp":
        args += [f"-DFP8NCA_SIMT_ABSENT_{u.upper()}" for u in ATTENTION_UNITS if u not in units]
    return [*args, str(source)]


def _object(cxx: str, args: list[str], csrc: Path, objects: Path) -> Path:
    """The object file of one compile, built unless an identical compile's is cached: the key
    hashes the flags (``csrc``'s place left out, so a copy shares the unchanged objects) and
    every file the preprocessor reads (g++ -MM)."""
    deps = subprocess.run([cxx, *args, "-MM"], capture_output=True, text=True, check=False)
    if deps.returncode != 0:
        raise RuntimeError(f"SIMT executor build failed:\n{deps.stderr}")
    flags = [cxx, *(arg.replace(str(csrc), "<csrc>") for arg in args[:-1])]
    digest = hashlib.sha256("\0".join(flags).encode())
    files = deps.stdout.replace("\\\n", " ").split(":", 1)[1].split()
    for name in files:
        digest.update(Path(name).read_bytes())
    target = objects / f"{digest.hexdigest()[:24]}.o"
    if not target.is_file():
        objects.mkdir(parents=True, exist_ok=True)
        # Built beside and renamed: processes building at once never link a partial file.
        with tempfile.TemporaryDirectory(dir=objects) as temp:
            partial = Path(temp) / target.name
            proc = subprocess.run(
                [cxx, *args, "-c", "-o", str(partial)], capture_output=True, text=True
            )
            if proc.returncode != 0:
                raise RuntimeError(f"SIMT executor build failed:\n{proc.stdout}{proc.stderr}")
            os.replace(partial, target)
    return target


def build(
    csrc: Path = CSRC, bindings: Path = BINDINGS, units: Sequence[str] = ATTENTION_UNITS
) -> Path:
    """The executor module built from ``csrc`` and ``bindings`` (a copy with a planted change
    builds just the same) with the attention kernels of ``units`` (of :data:`ATTENTION_UNITS`;
    the others refuse their launches, as an uncompiled dtype pair does). Returns the module's
    file; RuntimeError with the compiler's output on failure."""
    cxx = _compiler()
    sources = [
        *(csrc / "mma_sync" / f"{unit}.cu" for unit in units),
        csrc / "cascade" / "merge.cu",
        csrc / "cache" / "reshape_and_cache.cu",
        csrc / "common" / "launch.cpp",
        csrc / "common" / "plan.cpp",
        csrc / "simt" / "runtime.cpp",
        csrc / "simt" / "absent_kernels.cpp",
        bindings,
    ]
    cache = _cache_dir()
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        compiles = [_compile_args(csrc, source, units) for source in sources]
        objects = list(pool.map(lambda a: _object(cxx, a, csrc, cache / "objects"), compiles))
    key = hashlib.sha256("\0".join(o.name for o in objects).encode()).hexdigest()[:24]
    # A name of its own per build: modules of one name share one import in a process.
    name = f"fp8nca_simt_{key}"
    library = cache / "modules" / f"{name}{sysconfig.get_config_var('EXT_SUFFIX')}"
    if not library.is_file():
        library.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=library.parent) as temp:
            partial = Path(temp) / library.name
            module_init = Path(temp) / "bindings.o"
            rename = ["objcopy", f"--redefine-sym=PyInit__C=PyInit_{name}", str(objects[-1])]
            proc = subprocess.run([*rename, str(module_init)], capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"SIMT executor build failed:\n{proc.stderr}")
            objects[-1] = module_init
            link = [cxx, "-shared", "-fPIC", *map(str, objects), "-o", str(partial)]
            proc = subprocess.run(link, capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"SIMT executor link failed:\n{proc.stdout}{proc.stderr}")
            os.replace(partial, library)
    return library


@functools.cache
def load_file(library: Path) -> ModuleType:
    """The executor module in ``library`` (from :func:`build`), imported once per file."""
    name = library.name.split(".")[0]
    loader = importlib.machinery.ExtensionFileLoader(name, str(library))
    spec = importlib.util.spec_from_file_location(name, library, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


@functools.cache
def loaded() -> ModuleType:
    """The executor module of this checkout's sources (built first when they changed)."""
    return load_file(build())


def _span_end(t: torch.Tensor) -> int:
    """One past the last byte of ``t``'s elements (strides >= 0)."""
    last = sum((n - 1) * stride for n, stride in zip(t.shape, t.stride(), strict=True))
    return t.data_ptr() + (last + 1) * t.element_size()


@contextlib.contextmanager
def writable(module: ModuleType, **tensors: torch.Tensor | None) -> Iterator[None]:
    """The launches inside may write ``tensors`` (named for the executor's reports: each from
    its first element to its last) and nothing else outside shared memory and the threads' own
    locals."""
    regions = {name: t for name, t in tensors.items() if t is not None and t.numel() > 0}
    count = len(regions)
    begin = (ctypes.c_uint64 * count)(*(t.data_ptr() for t in regions.values()))
    end = (ctypes.c_uint64 * count)(*(_span_end(t) for t in regions.values()))
    names = (ctypes.c_char_p * count)(*(name.encode() for name in regions))
    set_writable = ctypes.CDLL(module.__file__).fp8nca_simt_set_writable
    set_writable(count, begin, end, names)
    try:
        yield
    finally:
        set_writable(0, None, None, None)
