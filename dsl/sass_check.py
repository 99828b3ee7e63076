"""SASS facts of a kept tcgen05 cubin, read with cuobjdump (pip ``nvidia-cuda-cuobjdump``).

Used by tests/test_tcgen05_build.py and by ``python -m dsl.sass_check CUBIN...``. Counts are
static instruction counts over the whole kernel (not per tile, not per byte): they show which
instructions the compiled kernel uses, never how fast it runs.
"""

import functools
import re
import shutil
import subprocess
import sys
from pathlib import Path

# Instruction families the family must contain, by role: the MMA form (UTCHMMA = tcgen05.mma
# kind::f16), TMEM traffic (STTM from the converter, LDTM/STTM in the softmax warps), the load
# path (LDGSTS = cp.async), ldmatrix reads of the ring.
REQUIRED = ("UTCHMMA", "STTM", "LDTM", "LDGSTS", "LDSM")
FORBIDDEN = ("LDL", "STL")  # local memory: spills or stack arrays
# The exact FP8 -> fp16 conversion per cache dtype: (required, forbidden). e4m3 uses F2FP (and
# the integer pipe for a share); e5m2 is byte moves (PRMT), so its conversion-pipe form must
# not appear.
CONVERSION = {
    "float8_e4m3fn": (("F2FP.F16.E4M3.UNPACK_B",), ()),
    "float8_e5m2": (("PRMT",), ("F2FP.F16.E5M2.UNPACK_B",)),
}


def cache_dtype_of(cubin: Path) -> str:
    """Cache dtype of a kept cubin, from its variant folder (``..._e4m3`` / ``..._e5m2``)."""
    return "float8_e5m2" if Path(cubin).parent.name.endswith("_e5m2") else "float8_e4m3fn"


def cuobjdump_path() -> Path:
    """cuobjdump from the pip package next to this interpreter, else from PATH."""
    site = Path(sys.prefix) / "lib"
    for candidate in site.glob("python3*/site-packages/nvidia/cu13/bin/cuobjdump"):
        return candidate
    found = shutil.which("cuobjdump")
    if found is None:
        raise FileNotFoundError("cuobjdump not found: pip install nvidia-cuda-cuobjdump")
    return Path(found)


def _run(option: str, cubin: Path) -> str:
    """cuobjdump's output for one cubin, read once per version of the file (the build tests ask
    several questions of each cubin, and a tcgen05 listing takes about a second)."""
    stat = Path(cubin).stat()
    return _cached_run(option, str(cubin), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=32)
def _cached_run(option: str, cubin: str, mtime_ns: int, size: int) -> str:
    return subprocess.run(
        [str(cuobjdump_path()), option, cubin], check=True, capture_output=True, text=True
    ).stdout


def disassembly(cubin: Path) -> str:
    """``cuobjdump -sass`` of a cubin."""
    return _run("-sass", cubin)


def opcodes(cubin: Path) -> dict[str, int]:
    """Static count of each opcode (with its modifiers, e.g. ``LDGSTS.E.LTC128B.128``)."""
    counts: dict[str, int] = {}
    for line in disassembly(cubin).splitlines():
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
        if m:
            counts[m.group(1)] = counts.get(m.group(1), 0) + 1
    return counts


def count(ops: dict[str, int], family: str) -> int:
    """Instructions whose opcode is ``family`` or starts with ``family.``."""
    return sum(n for op, n in ops.items() if op == family or op.startswith(family + "."))


def resource_usage(cubin: Path) -> dict[str, int]:
    """REG, STACK, SHARED, LOCAL of the cubin's one kernel."""
    text = _run("-res-usage", cubin)
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", text)
    if m is None:
        raise ValueError(f"no resource line in cuobjdump -res-usage of {cubin}")
    return dict(zip(("REG", "STACK", "SHARED", "LOCAL"), map(int, m.groups()), strict=True))


def problems(cubin: Path, cache_dtype: str | None = None) -> list[str]:
    """What is wrong with a tcgen05 cubin of cache dtype ``cache_dtype`` (default: from its folder
    name) (empty when every check passes)."""
    ops = opcodes(cubin)
    usage = resource_usage(cubin)
    required, forbidden = CONVERSION[cache_dtype or cache_dtype_of(cubin)]
    found = [f"missing {name}" for name in REQUIRED + required if count(ops, name) == 0]
    found += [f"{count(ops, name)} x {name}" for name in FORBIDDEN + forbidden if count(ops, name)]
    found += [f"{key} {usage[key]} bytes" for key in ("STACK", "LOCAL") if usage[key]]
    return found


def main(argv=None) -> int:
    status = 0
    for path in map(Path, argv if argv is not None else sys.argv[1:]):
        ops, usage = opcodes(path), resource_usage(path)
        required, forbidden = CONVERSION[cache_dtype_of(path)]
        summary = {name: count(ops, name) for name in REQUIRED + required + FORBIDDEN + forbidden}
        bad = problems(path)
        status |= bool(bad)
        print(f"{path.name}: {usage} {summary} {'OK' if not bad else bad}")
    return status


if __name__ == "__main__":
    sys.exit(main())
