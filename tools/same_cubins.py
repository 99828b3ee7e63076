"""Whether two builds hold the same cubins: ``python -m tools.same_cubins BEFORE AFTER``.

BEFORE and AFTER are object files, shared libraries or folders of them (``build/cmake``'s
objects, a ``python -m dsl.build`` output folder); every cubin inside (``cuobjdump -xelf all``)
is paired by file name and architecture and compared byte for byte, after masking the 8-hex-digit
prefixes nvcc derives from the source file's path for internal-linkage symbols
(``_GLOBAL__N__<hex>``, ``_INTERNAL_<hex>_``): two checkouts at different paths otherwise never
match. Prints one line per cubin (same, differs: the count of differing bytes, or only on one
side) and exits 1 when any differs. Needs cuobjdump (pip ``nvidia-cuda-cuobjdump``).
"""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from tools.sass_model.toolchain import tool

_PATH_HASHES = re.compile(rb"(_GLOBAL__N__|_INTERNAL_)[0-9a-f]{8}")
_SUFFIXES = (".o", ".so", ".cubin")


def masked(data: bytes) -> bytes:
    """``data`` with nvcc's path-derived symbol prefixes replaced by a fixed one."""
    return _PATH_HASHES.sub(lambda m: m.group(1) + b"x" * 8, data)


def cubins(root: Path) -> dict[str, bytes]:
    """``{"<file>/<arch>": masked cubin}`` of every object, library and cubin under ``root``."""
    files = (
        [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.suffix in _SUFFIXES)
    )
    found = {}
    for path in files:
        if path.suffix == ".cubin":
            found[path.name] = masked(path.read_bytes())
            continue
        with tempfile.TemporaryDirectory() as temp:
            run = subprocess.run([tool("cuobjdump"), "-xelf", "all", str(path.resolve())], cwd=temp,
                                 capture_output=True, text=True)  # fmt: skip
            if run.returncode != 0:
                continue  # no device code in this file
            for cubin in sorted(Path(temp).glob("*.cubin")):
                arch = re.search(r"sm_\w+", cubin.name)
                found[f"{path.name}/{arch.group(0) if arch else cubin.name}"] = masked(
                    cubin.read_bytes()
                )
    return found


def main(argv: list[str] | None = None) -> int:
    before_dir, after_dir = (Path(a) for a in (sys.argv[1:] if argv is None else argv))
    before, after = cubins(before_dir), cubins(after_dir)
    differs = False
    for name in sorted(before.keys() | after.keys()):
        a, b = before.get(name), after.get(name)
        if a is None or b is None:
            print(f"{name}: only {'after' if a is None else 'before'}")
            differs = True
        elif a == b:
            print(f"{name}: same ({hashlib.sha256(a).hexdigest()[:16]})")
        else:
            count = sum(x != y for x, y in zip(a, b, strict=False)) + abs(len(a) - len(b))
            print(f"{name}: differs in {count} bytes")
            differs = True
    return 1 if differs else 0


if __name__ == "__main__":
    sys.exit(main())
