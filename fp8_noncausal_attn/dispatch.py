"""Which backend runs a call, and why the others do not (SPEC §4).

Preference order is speed: the compiled CUDA kernels, then Triton, then the PyTorch reference.
``"auto"`` takes the first that runs here and supports the call; it never picks Triton's CPU
interpreter, which exists for testing, so on a CPU it picks the reference.
"""

from __future__ import annotations

from types import ModuleType

import torch

from . import cuda_backend, reference, triton_attention
from .problem import AttentionProblem

# Imported eagerly (each imports its compiled kernels lazily) so that torch.compile can trace
# the choice without stepping into importlib.
BACKENDS: dict[str, ModuleType] = {
    "cuda": cuda_backend,
    "triton": triton_attention,
    "reference": reference,
}
BACKEND_NAMES = tuple(BACKENDS)


def backend_module(name: str) -> ModuleType:
    """The module implementing backend ``name``."""
    return BACKENDS[name]


def _auto_skips(name: str, device: torch.device) -> str | None:
    if name == "triton" and device.type != "cuda":
        return "auto does not pick Triton's CPU interpreter (a test tool, far slower than PyTorch)"
    return None


def auto_choice(device: torch.device, problem: AttentionProblem | None = None) -> tuple[str, str]:
    """The backend ``"auto"`` takes for tensors on ``device`` (and for ``problem``, when given,
    only a backend that supports it), with the reason."""
    passed_over = []
    for name, module in BACKENDS.items():
        runs, why = module.availability()
        skip = why if not runs else _auto_skips(name, device)
        if skip is None and problem is not None:
            skip = module.unsupported_reason(problem)
        if skip is None:
            chosen_because = f"fastest available for {device.type} tensors"
            if passed_over:
                chosen_because += " (" + "; ".join(passed_over) + ")"
            return name, chosen_because
        passed_over.append(f"{name}: {skip}")
    raise AssertionError("the reference backend runs every valid call")


def available_backends() -> dict[str, dict[str, object]]:
    """What runs here and why not the rest.

    Returns ``{name: {"available": bool, "reason": str}}`` for ``cuda``, ``triton`` and
    ``reference``, plus ``"auto": {"choice": name, "reason": str}`` for the current default
    device (CUDA when a GPU is visible, else CPU).
    """
    report: dict[str, dict[str, object]] = {}
    for name in BACKEND_NAMES:
        runs, why = backend_module(name).availability()
        report[name] = {"available": runs, "reason": why}
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    choice, why = auto_choice(device)
    report["auto"] = {"choice": choice, "reason": why}
    return report


def resolve_backend(backend: str, problem: AttentionProblem) -> str:
    """Map the user's ``backend`` argument to a backend that can run ``problem``.

    Raises ValueError for an unknown name and RuntimeError, with the reason, when the named
    backend cannot run here or does not support this call.
    """
    if backend == "auto":
        return auto_choice(problem.query.device, problem)[0]
    if backend not in BACKENDS:
        raise ValueError(f"backend must be 'auto' or one of {BACKEND_NAMES}, got {backend!r}")
    module = backend_module(backend)
    runs, why = module.availability()
    if not runs:
        raise RuntimeError(f"backend {backend!r} is not available here: {why}")
    reason = module.unsupported_reason(problem)
    if reason is not None:
        raise RuntimeError(f"backend {backend!r} does not support this call: {reason}")
    return backend
