"""What the GPU machine has: ``python -m tools.gpu_check.environment`` prints one JSON line
(Python, torch, Triton, CUDA, nvcc and compute-sanitizer versions, whether ``_C`` loads, which
DSL libraries and peers were carried)."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import platform
import subprocess
import sysconfig

from benchmarks import fa3_peer, vllm_peer

from .backends import DSL_FAMILIES
from .plan import REPO


def tool_version(*argv: str) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=5, check=False)
    except (OSError, subprocess.SubprocessError) as error:
        return f"absent ({type(error).__name__})"
    lines = (done.stdout or done.stderr).strip().splitlines()
    return lines[-1] if lines else f"rc {done.returncode}"


def extension_status() -> str:
    """ "loads", or why the package's ``_C`` for this interpreter does not (loaded on its own:
    pybind11 needs neither torch nor the package)."""
    path = REPO / "fp8_noncausal_attn" / f"_C{sysconfig.get_config_var('EXT_SUFFIX')}"
    if not path.is_file():
        return f"absent: no {path.name}"
    try:
        loader = importlib.machinery.ExtensionFileLoader("fp8_noncausal_attn._C", str(path))
        spec = importlib.util.spec_from_file_location("fp8_noncausal_attn._C", path, loader=loader)
        loader.exec_module(importlib.util.module_from_spec(spec))
    except ImportError as error:
        return f"does not load: {error}"
    return "loads"


def main() -> None:
    import torch
    import triton

    facts = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "triton": triton.__version__,
        "nvcc": tool_version("nvcc", "--version"),
        "compute_sanitizer": tool_version("compute-sanitizer", "--version"),
        "c_extension": extension_status(),
        "vllm_triton_peer": all((vllm_peer.PEER_DIR / f).is_file() for f in vllm_peer.KERNEL_FILES),
        "fa3_library": fa3_peer.ARCHIVE.is_file(),
    }
    for family in DSL_FAMILIES:
        facts[f"{family}_library"] = (REPO / ".dsl" / family / f"libfp8nca_{family}.so").is_file()
    print(json.dumps(facts), flush=True)


if __name__ == "__main__":
    main()
