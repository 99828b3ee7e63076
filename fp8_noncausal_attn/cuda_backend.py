"""The compiled CUDA/CUTLASS kernels (``backend="cuda"``), through ``fp8_noncausal_attn._C``."""

from __future__ import annotations

import torch

from .problem import AttentionProblem


def availability() -> tuple[bool, str]:
    try:
        from . import _C  # noqa: F401
    except ImportError as err:
        return False, f"the CUDA extension fp8_noncausal_attn._C is not built ({err})"
    if not torch.cuda.is_available():
        return False, "the CUDA extension is built, but no CUDA GPU is visible"
    return True, "compiled CUDA kernels"


def unsupported_reason(problem: AttentionProblem) -> str | None:
    if not problem.query.is_cuda:
        return "the CUDA kernels need CUDA tensors"
    return None


def paged_attention(problem: AttentionProblem, out: torch.Tensor) -> None:
    raise NotImplementedError("the CUDA binding is not wired yet")
