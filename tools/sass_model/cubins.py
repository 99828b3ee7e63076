"""Cubins of a built extension: their architecture, kernels, resource usage and SASS text."""

from __future__ import annotations

import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .toolchain import run


@dataclass(frozen=True)
class Kernel:
    """One ``__global__`` function of one cubin.

    ``shared_static`` is the cubin's static shared memory in bytes (dynamic shared memory is a
    launch argument and comes from the kernel's tile facts); ``local`` is local memory (stack and
    spills) per thread in bytes.
    """

    arch: str  # e.g. "sm_90a", "sm_100a", "sm_100f"
    symbol: str  # mangled name
    name: str  # demangled name
    regs: int
    stack: int
    shared_static: int
    local: int
    sass: str  # cuobjdump -sass text of this function alone


_FUNCTION = re.compile(r"^\s*Function\s*:\s*(\S+)\s*$", re.M)
_CODE_FOR = re.compile(r"code for (sm_\w+)")
_RESOURCES = re.compile(
    r"Function (\S+):\s*\n\s*REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", re.M
)


def demangle(symbol: str) -> str:
    """C++ demangling via c++filt when present (names are only labels, so failure is harmless)."""
    try:
        out = subprocess.run(["c++filt", symbol], capture_output=True, text=True, check=True)
        return out.stdout.strip() or symbol
    except (OSError, subprocess.CalledProcessError):
        return symbol


def read_cubin(path: str | Path) -> list[Kernel]:
    """Every kernel of one cubin with its SASS and resource usage."""
    sass = run("cuobjdump", "-sass", str(path))
    arch_match = _CODE_FOR.search(sass)
    if arch_match is None:
        raise ValueError(f"{path}: no SASS found")
    arch = arch_match.group(1)
    usage = {
        m.group(1): tuple(int(m.group(i)) for i in range(2, 6))
        for m in _RESOURCES.finditer(run("cuobjdump", "-res-usage", str(path)))
    }
    kernels = []
    starts = list(_FUNCTION.finditer(sass))
    for i, match in enumerate(starts):
        end = starts[i + 1].start() if i + 1 < len(starts) else len(sass)
        symbol = match.group(1)
        regs, stack, shared, local = usage.get(symbol, (0, 0, 0, 0))
        text = sass[match.end() : end]
        kernels.append(Kernel(arch, symbol, demangle(symbol), regs, stack, shared, local, text))
    return kernels


def read_library(path: str | Path) -> list[Kernel]:
    """Every kernel of every cubin embedded in a shared library (or fatbin / cubin file)."""
    path = Path(path).resolve()
    if path.suffix == ".cubin":
        return read_cubin(path)
    with tempfile.TemporaryDirectory(prefix="sass_model_") as tmp:
        run("cuobjdump", "-xelf", "all", str(path), cwd=tmp)
        kernels = []
        for cubin in sorted(Path(tmp).glob("*.cubin")):
            kernels.extend(read_cubin(cubin))
    return kernels
