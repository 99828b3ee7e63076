"""Our backends by their flat names, and how each is asked for (no torch import: the driver
reads this before any step runs).

:func:`backend_request` is the one place that turns a flat name into the API's ``backend=``
value and the environment a call needs; everything else (the smoke launches, the sanitizer
launches, the correctness step's environment, the benchmark's adapters) goes through it.
"""

from __future__ import annotations

# Ours, by flat name: the compiled CUDA families, Triton and the PyTorch reference.
CUDA_FAMILIES = ("mma_sync", "wgmma", "tcgen05")
OURS = ("reference", "triton", *CUDA_FAMILIES)
# The CUTLASS-DSL families run only on their own GPU generation: (compute capability prefix,
# the arch of their cubins).
FAMILY_GPU = {"wgmma": ("9.0", "sm_90a"), "tcgen05": ("10.", "sm_100f")}
DSL_FAMILIES = tuple(FAMILY_GPU)


def backend_request(name: str) -> tuple[str, dict[str, str]]:
    """(``backend=`` value, environment variables) that make a call run backend ``name``: the
    name itself, and ``FP8NCA_BACKEND`` for the test suite's GPU backend (tests/helpers)."""
    if name not in OURS:
        raise ValueError(f"backend must be one of {OURS}, got {name!r}")
    return name, {"FP8NCA_BACKEND": name}


def runs_on(name: str, capability: str) -> str | None:
    """None when backend ``name`` can run on a GPU of ``capability`` (as nvidia-smi prints it,
    "9.0"), else why not."""
    if name not in FAMILY_GPU:
        return None
    prefix, arch = FAMILY_GPU[name]
    if capability.startswith(prefix):
        return None
    return f"{name}: skipped, needs an {arch} GPU (this one is cc {capability})"
