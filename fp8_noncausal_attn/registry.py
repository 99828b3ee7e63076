"""Every backend in one flat list, and the one choice among them (SPEC §4).

``backend=`` takes ``"auto"`` or one name of :data:`BACKEND_NAMES`, one per kernel
implementation (FlashInfer's ``backend="fa2|fa3|trtllm-gen|cute-dsl"`` convention). ``auto``
walks :data:`AUTO_ORDER`, fastest first and only backends that have run on a GPU, and takes the
first that runs here, takes the call's device and supports its batch; it never picks Triton's
CPU interpreter (a test tool), so on a CPU it picks the reference. A named backend that cannot
serve a call raises with the reason: only ``auto`` moves on. Attention
(:func:`plan_batch`), the cache write and the merge (:func:`for_device`) choose here and
nowhere else.

The one knob is the argument; :data:`BACKEND_ENV` is its default only where no argument reaches
the library (the vLLM backend: :func:`backend_from_env`). Nothing here is called under
``torch.compile`` tracing: the API passes the backend name into its opaque op, which chooses
when the graph runs.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from .backends import reference
from .backends.cuda import dsl, extension, mma_sync
from .backends.protocol import Backend, Refused
from .backends.triton import attention as triton_attention
from .problem import AttentionProblem, Batch, CacheWrite

BACKEND_ENV = "FP8NCA_BACKEND"
NEVER_RUN = f"{dsl.STATUS}: runs only when named, auto never picks it"


def _triton_cache_write(write: CacheWrite) -> None:
    # Triton is an optional dependency: its cache kernel is imported when first used.
    from .backends.triton.cache import reshape_and_cache

    reshape_and_cache(write)


@dataclass(frozen=True)
class Entry:
    """One backend: its kernels (attention), its cache write and merge, what it is, and the
    tensors' device types ``auto`` may pick it for (``()``: never), and why not for others;
    ``writes_per_token_head``: whether its cache write computes per-token-head scales."""

    name: str
    kernels: Backend
    status: str
    auto_devices: tuple[str, ...]
    auto_note: str
    reshape_and_cache: Callable[[CacheWrite], None]
    merge_states: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
    writes_per_token_head: bool


# Every CUDA kernel family writes the cache and merges split or partial states with _C's kernels:
# the CUTLASS-DSL families launch only their attention from their own libraries. _C's write
# takes per-head scales only: a per-token-head write goes to the next backend that computes them.
_C_KERNELS = {"reshape_and_cache": extension.reshape_and_cache,
              "merge_states": extension.merge_states, "writes_per_token_head": False}  # fmt: skip
# In auto's order (fastest first); the families never run on a GPU come last and auto skips them.
REGISTRY: dict[str, Entry] = {
    entry.name: entry
    for entry in (
        Entry("mma_sync", mma_sync, "portable CUDA kernels (mma.sync, cp.async; sm_89 and newer)",
              ("cuda",), "auto picks it for CUDA tensors only", **_C_KERNELS),
        Entry("triton", triton_attention, "Triton kernels (GPUs from sm_89; a CPU interpreter)",
              ("cuda",), "auto does not pick Triton's CPU interpreter (a test tool, far slower "
              "than PyTorch)", _triton_cache_write, triton_attention.merge_states, True),
        Entry("reference", reference, "plain PyTorch, fp32 math: the oracle",
              ("cpu", "cuda", "meta"), "", reference.reshape_and_cache, reference.merge_states,
              True),
        Entry("wgmma", dsl.FAMILIES["wgmma"], f"Hopper CUTLASS-DSL kernels (sm_90a); {NEVER_RUN}",
              (), "never run on a GPU", **_C_KERNELS),
        Entry("tcgen05", dsl.FAMILIES["tcgen05"],
              f"Blackwell CUTLASS-DSL kernels (sm_100, sm_103); {NEVER_RUN}", (),
              "never run on a GPU", **_C_KERNELS),
    )
}  # fmt: skip
BACKEND_NAMES = tuple(REGISTRY)
AUTO_ORDER = tuple(name for name, entry in REGISTRY.items() if entry.auto_devices)

# Each backend's availability() answer, asked once per process: it describes the machine (the
# extension, the driver, the GPU), and a call should not pay for it. available_backends()
# asks again and refreshes it.
_availability: dict[str, tuple[bool, str]] = {}


def availability(name: str) -> tuple[bool, str]:
    """``availability()`` of backend ``name``, remembered (see :func:`available_backends`)."""
    known = _availability.get(name)
    if known is None:
        known = _availability[name] = REGISTRY[name].kernels.availability()
    return known


def check_name(backend: object, source: str = "backend") -> str:
    """``backend`` when it is ``"auto"`` or a registered name, else ValueError naming
    ``source`` (the one text for a bad name)."""
    if backend != "auto" and backend not in REGISTRY:
        raise ValueError(f"{source} must be 'auto' or one of {BACKEND_NAMES}, got {backend!r}")
    return backend  # type: ignore[return-value]


def backend_from_env() -> str:
    """The backend :data:`BACKEND_ENV` names (default ``"auto"``); ValueError for a bad name."""
    return check_name(os.environ.get(BACKEND_ENV, "").strip() or "auto", BACKEND_ENV)


def max_splits() -> int:
    """The largest split-KV count any backend plans (sizes the default workspace)."""
    return max(getattr(entry.kernels, "MAX_SPLITS", 1) for entry in REGISTRY.values())


def _refusal(name: str, device: torch.device, batch: Batch | None) -> str | None:
    """Why backend ``name`` cannot take ``batch`` (or, without one, tensors on ``device``)."""
    runs, why = availability(name)
    if not runs:
        return why
    kernels = REGISTRY[name].kernels
    if batch is None:
        return kernels.device_reason(device)
    if batch.cache_dtype == torch.int8 and kernels.PER_TOKEN_HEAD_REFUSAL:
        return f"an int8 cache has per-token-head scales: {kernels.PER_TOKEN_HEAD_REFUSAL}"
    return kernels.unsupported_reason(batch)


def _refuse(name: str, device: torch.device, batch: Batch | None) -> None:
    """RuntimeError with the reason when the named backend cannot serve the call."""
    runs, why = availability(name)
    if not runs:
        raise RuntimeError(f"backend {name!r} is not available here: {why}")
    why = _refusal(name, device, batch)
    if why is not None:
        raise RuntimeError(f"backend {name!r} does not support this call: {why}")


def _auto_walk(device: torch.device, batch: Batch | None):
    """``(name, None)`` for each backend ``auto`` may take for ``batch`` (or ``device``) in
    order, and ``(name, why)`` for each it passes over."""
    for name in AUTO_ORDER:
        why = _refusal(name, device, batch)
        if why is None and device.type not in REGISTRY[name].auto_devices:
            why = REGISTRY[name].auto_note
        yield name, why


def for_device(backend: str, device: torch.device, per_token_head: bool = False) -> Entry:
    """The backend whose cache write and merge run for tensors on ``device``: ``backend``
    itself (RuntimeError with the reason when it cannot), or ``auto``'s first that can.
    ``per_token_head``: a cache write that computes per-token-head scales (``auto`` passes over
    the backends whose write does not: _C's)."""
    if check_name(backend) != "auto":
        _refuse(backend, device, None)
        if per_token_head and not REGISTRY[backend].writes_per_token_head:
            raise RuntimeError(
                f"backend {backend!r} does not support this call: its cache write does not "
                "compute per-token-head scales"
            )
        return REGISTRY[backend]
    for name, why in _auto_walk(device, None):
        if why is None and (REGISTRY[name].writes_per_token_head or not per_token_head):
            return REGISTRY[name]
    raise AssertionError("the reference backend takes every device")


class Planned(NamedTuple):
    """One backend's plan of a batch (a named tuple: one is made per one-shot call)."""

    name: str
    kernels: Backend
    plan: Any


def plan_batch(
    backend: str, batch: Batch, workspace: Any = None, num_splits: int | None = None
) -> tuple[tuple[Planned, ...], tuple[tuple[str, str], ...]]:
    """Plan ``batch`` on ``backend``: the plans :func:`run` tries in order, and why ``auto``
    passed over the backends before the first (``(name, reason)`` pairs).

    A named backend gives one plan, or RuntimeError with the reason it cannot serve the batch.
    ``auto`` gives the first backend of :data:`AUTO_ORDER` that plans the batch, followed by
    every later one that does: a layer whose own tensors (pointers, strides) the first cannot
    take runs on the next that can, decided here (the reference takes every layer).
    """
    if check_name(backend) != "auto":
        _refuse(backend, batch.device, batch)
        kernels = REGISTRY[backend].kernels
        try:
            return (Planned(backend, kernels, kernels.plan(batch, workspace, num_splits)),), ()
        except Refused as refusal:
            raise RuntimeError(
                f"backend {backend!r} does not support this call: {refusal}"
            ) from None
    chain: list[Planned] = []
    passed_over: list[tuple[str, str]] = []
    for name, why in _auto_walk(batch.device, batch):
        if why is None:
            try:
                kernels = REGISTRY[name].kernels
                chain.append(Planned(name, kernels, kernels.plan(batch, workspace, num_splits)))
                continue
            except Refused as refusal:
                why = str(refusal)
        if not chain:
            passed_over.append((name, why))
    if not chain:
        raise AssertionError("the reference backend plans every valid batch")
    return tuple(chain), tuple(passed_over)


def run(
    chain: tuple[Planned, ...],
    problem: AttentionProblem,
    out: torch.Tensor,
    lse: torch.Tensor | None = None,
) -> None:
    """Launch the first plan of ``chain`` (from :func:`plan_batch`) whose backend takes this
    layer's tensors; RuntimeError with the reasons when none does. A layer with no query rows
    launches nothing (``out`` and ``lse`` are empty)."""
    if problem.num_tokens == 0:
        return
    refusals = []
    per_token_head = problem.per_token_head_scales
    for planned in chain:
        why = planned.kernels.PER_TOKEN_HEAD_REFUSAL if per_token_head else None
        if why is not None:
            why = f"per-token-head scales: {why}"
        else:
            why = planned.kernels.run_unsupported_reason(problem, out)
        if why is None:
            if lse is None:
                planned.kernels.run(problem, planned.plan, out)
            else:
                planned.kernels.run(problem, planned.plan, out, lse)
            return
        refusals.append(f"{planned.name}: {why}")
    raise RuntimeError(f"no planned backend can run this layer's tensors: {'; '.join(refusals)}")


def auto_choice(device: torch.device) -> tuple[str, str]:
    """The backend ``auto`` takes for tensors on ``device`` (before any batch), and why."""
    passed_over = []
    for name, why in _auto_walk(device, None):
        if why is None:
            because = f"fastest available for {device.type} tensors"
            if passed_over:
                because += " (" + "; ".join(passed_over) + ")"
            return name, because
        passed_over.append(f"{name}: {why}")
    raise AssertionError("the reference backend takes every device")


def available_backends() -> dict[str, dict[str, object]]:
    """What runs here and why not the rest.

    Returns ``{name: {"available": bool, "reason": str, "status": str, "auto": bool,
    "per_token_head": str}}`` for every name of :data:`BACKEND_NAMES` (``"per_token_head"``:
    ``"reads"`` when its kernels read per-token-head scales, else why not; ``"auto"``: whether
    ``auto`` may pick it at all;
    ``wgmma`` and ``tcgen05`` are compiled and SASS-checked, NEVER RUN ON HARDWARE, never
    picked), plus ``"auto": {"choice": name, "reason": str, "order": [...]}`` for the current
    default device (CUDA when a GPU is visible, else CPU). Asks every backend afresh and updates
    the answers that calls use.
    """
    report: dict[str, dict[str, object]] = {}
    for name, entry in REGISTRY.items():
        runs, why = _availability[name] = entry.kernels.availability()
        reads = entry.kernels.PER_TOKEN_HEAD_REFUSAL or "reads"
        report[name] = {"available": runs, "reason": why, "status": entry.status,
                        "auto": bool(entry.auto_devices), "per_token_head": reads}  # fmt: skip
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    choice, why = auto_choice(device)
    report["auto"] = {"choice": choice, "reason": why, "order": list(AUTO_ORDER)}
    return report
