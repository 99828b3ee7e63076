"""Locating and running the CUDA binary utilities (cuobjdump) that read cubins.

The pip packages in the project's venv ship them (nvidia/cu13/bin); a system CUDA install is the
fallback, so the model runs wherever the extension was built.
"""

from __future__ import annotations

import functools
import shutil
import subprocess
import sys
from pathlib import Path


@functools.cache
def tool(name: str) -> str:
    """Absolute path of a CUDA binary utility (``cuobjdump``, ``nvdisasm``); raises if absent."""
    site = Path(sys.prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    candidates = sorted((site / "site-packages" / "nvidia").glob(f"cu*/bin/{name}"), reverse=True)
    candidates += [Path(p) for p in filter(None, [shutil.which(name)])]
    candidates.append(Path("/usr/local/cuda/bin") / name)
    for path in candidates:
        if path.is_file():
            return str(path)
    raise FileNotFoundError(f"{name} not found (pip nvidia-cuda-cuobjdump, or a CUDA toolkit)")


def run(name: str, *args: str, cwd: str | Path | None = None) -> str:
    """Runs a utility and returns its stdout; raises with its stderr on failure."""
    result = subprocess.run(
        [tool(name), *args], cwd=cwd, capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        raise RuntimeError(f"{name} {' '.join(args)} failed: {result.stderr.strip()[-2000:]}")
    return result.stdout
