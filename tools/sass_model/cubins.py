"""Cubins of a built extension: their architecture, kernels, resource usage and SASS text."""

from __future__ import annotations

import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .toolchain import run


@dataclass(frozen=True)
class Resources:
    """One ``__global__`` function's registers and memory, as the cubin's tables record them.

    ``shared_static`` is the cubin's static shared memory in bytes (dynamic shared memory is a
    launch argument and comes from the kernel's tile facts); ``local`` is local memory (stack and
    spills) per thread in bytes.
    """

    arch: str  # e.g. "sm_90a", "sm_100a", "sm_100f"
    symbol: str  # mangled name
    regs: int
    stack: int
    shared_static: int
    local: int


@dataclass(frozen=True)
class Kernel(Resources):
    """One ``__global__`` function of one cubin, with its SASS."""

    name: str  # demangled name
    sass: str  # cuobjdump -sass text of this function alone


_FUNCTION = re.compile(r"^\s*Function\s*:\s*(\S+)\s*$", re.M)
_CODE_FOR = re.compile(r"code for (sm_\w+)")
# cuobjdump's ELF header line: "64-bit ELF: type=ET_EXEC, ABI=8, sm=90a, ..." (CUDA 13), and
# "64bit elf: type=2, abi=7, sm=90a, ..." for the cubins of older toolkits (Triton 3.6's ptxas).
_ELF_TARGET = re.compile(r"^64-?bit elf: .*?\bsm=(\w+)", re.M | re.I)
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


def _usage(path: str | Path) -> dict[str, tuple[int, int, int, int]]:
    """Symbol -> (registers, stack, static shared, local bytes) from ``cuobjdump -res-usage``."""
    return {
        m.group(1): tuple(int(m.group(i)) for i in range(2, 6))
        for m in _RESOURCES.finditer(run("cuobjdump", "-res-usage", str(path)))
    }


def read_resources(path: str | Path) -> list[Resources]:
    """Every kernel of one cubin with its resource usage, read from the cubin's tables without
    disassembling it (milliseconds, where :func:`read_cubin`'s SASS takes a good part of a
    second). ``arch`` is the target the ELF header names: ``sm_90a`` for an arch-specific
    cubin, but the base ``sm_100`` for a family-specific ``sm_100f`` one."""
    arch = elf_target(run("cuobjdump", "-elf", str(path)))
    if arch is None:
        raise ValueError(f"{path}: no CUDA ELF header found")
    return [Resources(arch, symbol, *usage) for symbol, usage in _usage(path).items()]


def elf_target(listing: str) -> str | None:
    """The ``sm_XX`` of the first ELF header in a ``cuobjdump -elf`` listing, if any."""
    target = _ELF_TARGET.search(listing)
    return None if target is None else f"sm_{target.group(1)}"


def read_cubin(path: str | Path) -> list[Kernel]:
    """Every kernel of one cubin with its SASS and resource usage."""
    sass = run("cuobjdump", "-sass", str(path))
    arch_match = _CODE_FOR.search(sass)
    if arch_match is None:
        raise ValueError(f"{path}: no SASS found")
    arch = arch_match.group(1)
    usage = _usage(path)
    kernels = []
    starts = list(_FUNCTION.finditer(sass))
    for i, match in enumerate(starts):
        end = starts[i + 1].start() if i + 1 < len(starts) else len(sass)
        symbol = match.group(1)
        regs, stack, shared, local = usage.get(symbol, (0, 0, 0, 0))
        text = sass[match.end() : end]
        kernels.append(
            Kernel(arch, symbol, regs, stack, shared, local, name=demangle(symbol), sass=text)
        )
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
