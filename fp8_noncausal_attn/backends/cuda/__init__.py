"""The compiled CUDA kernels (``backend="cuda"``): the extension ``_C`` (:mod:`.extension`) and
its kernel families, each a :class:`~.family.KernelFamily`: ``mma_sync`` (:mod:`.mma_sync`, the
portable default, sm_89 and newer) and the CUTLASS-DSL families ``wgmma`` and ``tcgen05``
(:mod:`.dsl`: compiled, NEVER RUN ON HARDWARE, opt-in only).

A plan asks for a family (``family=``, else ``$FP8NCA_CUDA_FAMILY``, else mma_sync); one that
cannot take the batch leaves mma_sync with the reason (the plan's ``family_reason`` and a
warning, once per reason), and a layer whose tensors the planned family cannot take runs on
mma_sync too. The backend therefore supports exactly what mma_sync supports.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from ...problem import AttentionProblem
from . import dsl, extension, mma_sync
from .extension import MAX_SPLITS, merge_splits, merge_states, reshape_and_cache
from .family import KernelFamily, Refused, warn_once

# Part of this backend's contract, re-exported from the extension module.
__all__ = ["MAX_SPLITS", "merge_splits", "merge_states", "reshape_and_cache"]

FAMILY_ENV = "FP8NCA_CUDA_FAMILY"
DEFAULT_FAMILY = mma_sync.name
FAMILIES: dict[str, KernelFamily] = {DEFAULT_FAMILY: mma_sync, **dsl.FAMILIES}
# Keywords of plan() that PagedAttention.plan passes through when this backend runs.
PLAN_OPTIONS = ("family",)


def requested_family(family: str | None = None) -> str:
    """The family asked for: ``family``, else ``$FP8NCA_CUDA_FAMILY``, else mma_sync."""
    chosen = family if family is not None else os.environ.get(FAMILY_ENV, "").strip()
    chosen = chosen or DEFAULT_FAMILY
    if chosen not in FAMILIES:
        source = "family" if family is not None else FAMILY_ENV
        raise ValueError(f"{source} must be one of {tuple(FAMILIES)}, got {chosen!r}")
    return chosen


def check_plan_options(family: str | None = None) -> None:
    """Raise ValueError, by name, for an option value no plan could take."""
    requested_family(family)


def unused_options_reason(family: str | None = None) -> str:
    """Why ``family`` is not used when another backend runs the plan ("" when it is the
    default or not given)."""
    if family in (None, DEFAULT_FAMILY):
        return ""
    return f"family {family!r} is a CUDA family"


def availability() -> tuple[bool, str]:
    """Whether the compiled kernels run here, and why not."""
    ext, why = extension.load()
    if ext is None:
        return False, why
    if not torch.cuda.is_available():
        return False, "the CUDA extension is built, but no CUDA GPU is visible"
    why_not = extension.driver_reason(ext) or extension.arch_reason(
        torch.device("cuda", torch.cuda.current_device())
    )
    if why_not is not None:
        return False, why_not
    archs = ", ".join(f"sm_{arch}" for arch in extension.built_archs())
    return True, (
        f"compiled CUDA kernels (mma.sync family, cp.async) for {archs}, PTX for "
        f"compute_{ext.PTX_ARCH}"
    )


def unsupported_reason(problem: AttentionProblem) -> str | None:
    """None when the CUDA kernels can run ``problem`` (mma_sync can: it is every family's
    fallback), else the reason."""
    if not problem.query.is_cuda:
        return "the CUDA kernels need CUDA tensors"
    ext, why = extension.load()
    if ext is None:
        return why
    return extension.arch_reason(problem.query.device) or mma_sync.unsupported_reason(problem)


def run_unsupported_reason(problem: AttentionProblem, out: torch.Tensor) -> str | None:
    """Run time: None when mma_sync (the fallback of every family) takes this layer's tensors."""
    return mma_sync.run_unsupported_reason(problem, out)


@dataclass(frozen=True)
class CudaPlan:
    """A batch's plan: the family that runs (``family``), why a requested one does not
    (``family_reason``, else ""), that family's own plan (``family_plan``) and, for a family
    other than mma_sync, mma_sync's plan for a layer that family cannot take (``fallback``)."""

    family: str
    family_plan: Any
    fallback: mma_sync.MmaSyncPlan | None = None
    family_reason: str = ""


def plan(
    problem: AttentionProblem,
    workspace=None,
    num_splits: int | None = None,
    family: str | None = None,
) -> CudaPlan:
    """Backend contract, plan time (host sizes only). ``family`` asks for a kernel family
    (default ``$FP8NCA_CUDA_FAMILY``, else mma_sync); ``num_splits`` forces the split-KV count
    (tests use it to cover the merge kernel)."""
    portable = mma_sync.plan(problem, workspace, num_splits)
    name = requested_family(family)
    if name == DEFAULT_FAMILY:
        return CudaPlan(DEFAULT_FAMILY, portable)
    try:
        chosen = FAMILIES[name].plan(problem, workspace, num_splits)
    except Refused as refusal:
        why = f"{name} refused, mma_sync runs: {refusal}"
        warn_once(why)
        return CudaPlan(DEFAULT_FAMILY, portable, family_reason=why)
    return CudaPlan(name, chosen, portable)


def paged_attention(
    problem: AttentionProblem,
    out: torch.Tensor,
    num_splits: int | None = None,
    lse: torch.Tensor | None = None,
) -> None:
    """One-shot form: plan (``num_splits`` forces the count) and run."""
    run(problem, plan(problem, None, num_splits), out, lse)


def run(
    problem: AttentionProblem, plan: CudaPlan, out: torch.Tensor, lse: torch.Tensor | None = None
) -> None:
    """Run the planned family, writing ``out`` [num_tokens, num_q_heads, head_dim] in place
    and, when given, ``lse`` (float32 [num_tokens, num_q_heads], natural log, from the split
    merge); mma_sync runs a layer whose tensors the planned family cannot take (warning once
    per reason), and an LSE call on a family plan that does not split. Asynchronous on the
    current stream."""
    extension.loaded()
    if problem.num_tokens == 0:  # with no sequence, every row is padding: the kernel zeroes it
        if lse is not None:
            lse.fill_(float("-inf"))
        return
    # The LSE output is an extra argument only when asked for (KernelFamily.run).
    extra = () if lse is None else (lse,)
    if plan.fallback is None:
        mma_sync.run(problem, plan.family_plan, out, *extra)
        return
    family = FAMILIES[plan.family]
    why = family.run_unsupported_reason(problem, out)
    if why is None and lse is not None and plan.family_plan.num_splits == 1:
        why = "an unsplit plan has no partial LSEs to return"
    if why is None:
        family.run(problem, plan.family_plan, out, *extra)
        return
    warn_once(f"{plan.family} cannot take this layer, mma_sync runs: {why}")
    mma_sync.run(problem, plan.fallback, out, *extra)


def report_details(cuda_available: bool, cuda_reason: str) -> dict[str, object]:
    """``{"families": {family: {"available", "status", "reason"}}}`` for
    ``available_backends()``, the family ``FP8NCA_CUDA_FAMILY`` asks for marked
    ``"requested": True``."""
    families: dict[str, dict[str, object]] = {
        DEFAULT_FAMILY: {
            "available": cuda_available,
            "status": "the default (portable mma.sync, cp.async; sm_89 and newer)",
            "reason": cuda_reason,
        },
        **dsl.report(cuda_available),
    }
    requested = os.environ.get(FAMILY_ENV, "").strip() or DEFAULT_FAMILY
    families[requested if requested in families else DEFAULT_FAMILY]["requested"] = True
    return {"families": families}
