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
    """One backend: its kernels (attention), its cache write and merge and why they cannot take
    tensors on a device (``device_reason``, None: they can), what it is, and the tensors' device
    types ``auto`` may pick it for (``()``: never), and why not for others;
    ``writes_per_token_head``: whether its cache write computes per-token-head scales."""

    name: str
    kernels: Backend
    status: str
    auto_devices: tuple[str, ...]
    auto_note: str
    reshape_and_cache: Callable[[CacheWrite], None]
    merge_states: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
    device_reason: Callable[[torch.device], str | None]
    writes_per_token_head: bool


def _any_device(device: torch.device) -> None:
    return None


def _c_device_reason(device: torch.device) -> str | None:
    # Looked up per call: tests stand in for the extension's entry points.
    return extension.device_reason(device)


# Every CUDA kernel family writes the cache and merges split or partial states with _C's kernels:
# the CUTLASS-DSL families launch only their attention from their own libraries. _C's write
# takes per-head scales only: a per-token-head write goes to the next backend that computes them.
_C_KERNELS = {"reshape_and_cache": extension.reshape_and_cache,
              "merge_states": extension.merge_states, "device_reason": _c_device_reason,
              "writes_per_token_head": False}  # fmt: skip
# In auto's order (fastest first); the families never run on a GPU come last and auto skips them.
REGISTRY: dict[str, Entry] = {
    entry.name: entry
    for entry in (
        Entry("mma_sync", mma_sync, "portable CUDA kernels (mma.sync, cp.async; sm_89 and newer)",
              ("cuda",), "auto picks it for CUDA tensors only", **_C_KERNELS),
        Entry("triton", triton_attention, "Triton kernels (GPUs from sm_89; a CPU interpreter)",
              ("cuda",), "auto does not pick Triton's CPU interpreter (a test tool, far slower "
              "than PyTorch)", _triton_cache_write, triton_attention.merge_states,
              triton_attention.device_reason, True),
        Entry("reference", reference, "plain PyTorch, fp32 math: the oracle",
              ("cpu", "cuda", "meta"), "", reference.reshape_and_cache, reference.merge_states,
              _any_device, True),
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


def _not_available(name: str) -> RuntimeError | None:
    runs, why = availability(name)
    return None if runs else RuntimeError(f"backend {name!r} is not available here: {why}")


def for_device(backend: str, device: torch.device, per_token_head: bool = False) -> Entry:
    """The backend whose cache write and merge run for tensors on ``device``: ``backend``
    itself (RuntimeError with the reason when it cannot), or ``auto``'s first that can.
    ``per_token_head``: a cache write that computes per-token-head scales (``auto`` passes over
    the backends whose write does not: _C's)."""
    if check_name(backend) != "auto":
        error = _not_available(backend)
        if error is not None:
            raise error
        entry = REGISTRY[backend]
        why = entry.device_reason(device)
        if why is None and per_token_head and not entry.writes_per_token_head:
            why = "its cache write does not compute per-token-head scales"
        if why is not None:
            raise RuntimeError(f"backend {backend!r} does not support this call: {why}")
        return entry
    for name in AUTO_ORDER:
        entry = REGISTRY[name]
        if (
            availability(name)[0]
            and device.type in entry.auto_devices
            and entry.device_reason(device) is None
            and (entry.writes_per_token_head or not per_token_head)
        ):
            return entry
    raise AssertionError("the reference backend takes every device")


class Planned(NamedTuple):
    """One backend's plan of a batch (a named tuple: one is made per one-shot call)."""

    name: str
    kernels: Backend
    plan: Any


def _auto_plan(
    names: tuple[str, ...], batch: Batch, workspace: Any, num_splits: int | None,
    passed_over: list[tuple[str, str]],
) -> Planned | None:  # fmt: skip
    """The plan of the first backend of ``names`` that ``auto`` may take for ``batch``'s device
    and whose ``plan()`` accepts it; each one passed over is appended to ``passed_over`` with
    why. ``plan()`` is asked only of a backend that runs here and is picked for the device."""
    for name in names:
        entry = REGISTRY[name]
        runs, why = availability(name)
        if runs and batch.device.type not in entry.auto_devices:
            why = entry.auto_note
        elif runs:
            try:
                return Planned(
                    name, entry.kernels, entry.kernels.plan(batch, workspace, num_splits)
                )
            except Refused as refusal:
                why = str(refusal)
        passed_over.append((name, why))
    return None


class Chain:
    """A batch's plans in the order :func:`run` tries them (iterable of :class:`Planned`): one
    for a named backend; for ``auto``, the first backend of :data:`AUTO_ORDER` whose ``plan()``
    accepts the batch, and the next one planned only when a layer's own tensors (pointers,
    strides) are refused by every plan so far (kept for the batch's later layers).
    ``passed_over``: why ``auto`` did not take the backends before the first."""

    __slots__ = ("requested", "batch", "workspace", "num_splits", "planned", "passed_over")

    def __init__(self, requested: str, batch: Batch, workspace: Any, num_splits: int | None):
        self.requested, self.batch = requested, batch
        self.workspace, self.num_splits = workspace, num_splits
        self.planned: list[Planned] = []
        self.passed_over: list[tuple[str, str]] = []

    def __iter__(self):
        return iter(self.planned)

    def __len__(self) -> int:
        return len(self.planned)

    def __getitem__(self, index: int) -> Planned:
        return self.planned[index]

    def plan_next(self) -> Planned | None:
        """``auto`` only: plan the next backend of its order after the last planned one (the
        backends it passes over are not recorded); None when no later one plans the batch."""
        if self.requested != "auto":
            return None
        later = AUTO_ORDER[AUTO_ORDER.index(self.planned[-1].name) + 1 :]
        planned = _auto_plan(later, self.batch, self.workspace, self.num_splits, [])
        if planned is not None:
            self.planned.append(planned)
        return planned


def plan_batch(
    backend: str, batch: Batch, workspace: Any = None, num_splits: int | None = None
) -> tuple[Chain, tuple[tuple[str, str], ...]]:
    """Plan ``batch`` on ``backend``: the :class:`Chain` :func:`run` tries, and why ``auto``
    passed over the backends before its first plan (``(name, reason)`` pairs).

    A named backend gives one plan, or RuntimeError with the reason it cannot serve the batch
    (its ``plan()``'s refusal). ``auto`` gives the first backend of :data:`AUTO_ORDER` whose
    ``plan()`` accepts the batch (the reference accepts every valid batch).
    """
    chain = Chain(check_name(backend), batch, workspace, num_splits)
    if backend != "auto":
        error = _not_available(backend)
        if error is not None:
            raise error
        kernels = REGISTRY[backend].kernels
        try:
            chain.planned.append(
                Planned(backend, kernels, kernels.plan(batch, workspace, num_splits))
            )
        except Refused as refusal:
            raise RuntimeError(
                f"backend {backend!r} does not support this call: {refusal}"
            ) from None
        return chain, ()
    planned = _auto_plan(AUTO_ORDER, batch, workspace, num_splits, chain.passed_over)
    if planned is None:
        raise AssertionError("the reference backend plans every valid batch")
    chain.planned.append(planned)
    return chain, tuple(chain.passed_over)


def run(
    chain: Chain,
    problem: AttentionProblem,
    out: torch.Tensor,
    lse: torch.Tensor | None = None,
) -> None:
    """Launch the first plan of ``chain`` (from :func:`plan_batch`) whose backend takes this
    layer's tensors (``auto`` plans the next backend when none does); RuntimeError with the
    reasons when none can. A layer with no query rows launches nothing (``out`` and ``lse`` are
    empty)."""
    if problem.num_tokens == 0:
        return
    refusals = []
    index = 0
    while index < len(chain.planned) or chain.plan_next() is not None:
        planned = chain.planned[index]
        index += 1
        why = planned.kernels.run_unsupported_reason(problem, out)
        if why is None:
            if lse is None:
                planned.kernels.run(problem, planned.plan, out)
            else:
                planned.kernels.run(problem, planned.plan, out, lse)
            return
        refusals.append(f"{planned.name}: {why}")
    raise RuntimeError(f"no planned backend can run this layer's tensors: {'; '.join(refusals)}")


def probe_batch(
    device: torch.device, scale_mode: str = "per_head", return_lse: bool = False
) -> Batch:
    """A small batch on ``device`` (one sequence of 4 query rows over 40 keys, 8 query and 2 KV
    heads, head_dim 128, 16-key pages, a bf16 query over an e4m3 cache, bidirectional): what
    :func:`available_backends` asks each backend's ``plan()`` with."""
    index = {"dtype": torch.int32, "device": device}
    return Batch(
        block_table=torch.arange(3, **index).view(1, 3), cu_seqlens_q=torch.tensor([0, 4], **index),
        seq_lens=torch.tensor([40], **index), causal=False, causal_per_seq=None,
        softmax_scale=128**-0.5, max_seqlen_q=4, max_seqlen_k=40, window=(-1, -1), num_tokens=4,
        num_q_heads=8, num_kv_heads=2, head_dim=128, block_size=16, query_dtype=torch.bfloat16,
        cache_dtype=torch.float8_e4m3fn, device=device, scale_mode=scale_mode,
        return_lse=return_lse,
    )  # fmt: skip


def auto_choice(device: torch.device) -> tuple[str, str]:
    """The backend ``auto`` takes for a batch on ``device`` (:func:`probe_batch`), and why."""
    passed_over: list[tuple[str, str]] = []
    planned = _auto_plan(AUTO_ORDER, probe_batch(device), None, None, passed_over)
    if planned is None:
        raise AssertionError("the reference backend plans every valid batch")
    because = f"fastest available for {device.type} tensors"
    if passed_over:
        because += " (" + "; ".join(f"{name}: {why}" for name, why in passed_over) + ")"
    return planned.name, because


def plan_refusal(name: str, batch: Batch) -> str | None:
    """None when backend ``name`` runs here and its ``plan()`` accepts ``batch`` (a forced
    unsplit plan), else why not."""
    runs, why = availability(name)
    if not runs:
        return f"not available here: {why}"
    try:
        REGISTRY[name].kernels.plan(batch, None, 1)
    except Refused as refusal:
        return str(refusal)
    return None


def available_backends() -> dict[str, dict[str, object]]:
    """What runs here and why not the rest, each answer derived from the backend's ``plan()``.

    Returns ``{name: {"available": bool, "reason": str, "status": str, "auto": bool,
    "per_head": str, "per_token_head": str, "unsplit_lse": str}}`` for every name of
    :data:`BACKEND_NAMES`: ``"available"`` whether it runs on this machine, and ``"reason"``
    what it runs on or why not; ``"per_head"``, ``"per_token_head"`` and ``"unsplit_lse"``,
    ``"yes"`` when its ``plan()`` accepts a :func:`probe_batch` on the default device (CUDA
    when a GPU is visible, else CPU) with per-KV-head scales, with per-token-head scales, or
    asking for the LSE of an unsplit launch, else the refusal;
    ``"auto"`` whether ``auto`` may pick it at all (``wgmma`` and ``tcgen05`` are compiled and
    SASS-checked, NEVER RUN ON HARDWARE, never picked); plus ``"auto": {"choice": name,
    "reason": str, "order": [...]}`` for the default device. Asks every backend afresh and
    updates the answers that calls use; the probes are real plans (on a GPU a CUTLASS-DSL
    family's loads the probe's variant, as any plan of it does).
    """
    report: dict[str, dict[str, object]] = {}
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    probes = {
        "per_head": probe_batch(device),
        "per_token_head": probe_batch(device, scale_mode="per_token_head"),
        "unsplit_lse": probe_batch(device, return_lse=True),
    }
    for name, entry in REGISTRY.items():
        runs, why = _availability[name] = entry.kernels.availability()
        report[name] = {"available": runs, "reason": why, "status": entry.status,
                        "auto": bool(entry.auto_devices)}  # fmt: skip
        for need, batch in probes.items():
            report[name][need] = plan_refusal(name, batch) or "yes"
    choice, why = auto_choice(device)
    report["auto"] = {"choice": choice, "reason": why, "order": list(AUTO_ORDER)}
    return report
