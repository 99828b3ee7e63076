"""The portable mma.sync kernel family (csrc/mma_sync: cp.async multi-stage KV loads), compiled
into ``_C`` for sm_89, sm_90, the sm_100 family (100f) and sm_120 with PTX for the newest:
``backend="mma_sync"``, ``auto``'s first choice on a GPU. Its plan comes from the C++ plan
function (csrc/common/plan.h); the split-KV workspace is the kept one or comes from torch's caching
allocator (graph-safe). Per-token-head scales (e4m3, e5m2 and int8 caches) run on kernels of
their own, chosen by the batch's ``scale_mode`` when it is planned. Nothing here synchronises
with the host. On CPU tensors the same kernels run through the SIMT executor (simt.py: a test
tool, slow, never ``auto``'s choice).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import ModuleType

import torch

from ...launch_record import MMA_SYNC, LaunchInputs, launch_values
from ...problem import AttentionProblem, Batch
from ..protocol import Refused
from . import extension, simt

# This module is a backend (backends/protocol.py): it runs on this machine when _C does (CUDA
# tensors) or the SIMT executor builds (CPU tensors), and its plan() refuses what no compiled
# kernel takes.


def availability() -> tuple[bool, str]:
    """Whether the compiled kernels run here (on a GPU, or CPU tensors through the SIMT
    executor), and why not."""
    runs, why = extension.availability()
    if runs:
        return True, f"mma.sync kernels (cp.async) in {why}"
    builds, simt_why = simt.availability()
    return (True, f"{simt_why}; CUDA tensors: {why}") if builds else (False, f"{why}; {simt_why}")


def _module(device: torch.device) -> ModuleType:
    """The compiled kernels for tensors on ``device``: the SIMT executor's for CPU ones."""
    return simt.loaded() if device.type == "cpu" else extension.loaded()


def _aligned(t: torch.Tensor, strides: tuple[int, ...], nbytes: int) -> bool:
    size = t.element_size()
    return t.data_ptr() % nbytes == 0 and all((s * size) % nbytes == 0 for s in strides)


def plan_refusal(batch: Batch) -> str | None:
    """None when a kernel compiled into ``_C`` runs ``batch`` on its device (``_C`` loads and
    runs there, or the SIMT executor builds for CPU tensors): its dtypes, sizes and scale kind.
    Per-token-head kernels exist for 1-byte caches (e4m3, e5m2, int8), and an int8 cache has no
    other; every kernel writes the LSE."""
    why = extension.device_reason(batch.device)
    if why is not None:
        return why
    # validation.py already limits head_dim (64/128/256) and the dtypes to the compiled set.
    if batch.cache_dtype.itemsize == 2 and batch.cache_dtype != batch.query_dtype:
        return (
            f"a {batch.cache_dtype} cache under a {batch.query_dtype} query runs on Triton (fp32 "
            "dots): converting bf16 keys to fp16 could overflow"
        )
    if batch.per_token_head_scales and batch.cache_dtype.itemsize != 1:
        return "per-token-head scales are compiled for e4m3, e5m2 and int8 caches only"
    if not batch.per_token_head_scales and batch.cache_dtype == torch.int8:
        return "an int8 cache is compiled with per-token-head scales only"
    most = extension.MAX_SEQS
    if batch.num_seqs > most:
        return f"at most {most} sequences per launch, got {batch.num_seqs}"
    return None


def run_unsupported_reason(problem: AttentionProblem, out: torch.Tensor | None) -> str | None:
    """None when the layer's own tensors suit the planned kernel (checked on every run:
    pointers and strides differ per layer). ``out`` is never a reason: the kernels pick their
    store width from its alignment and write it in place."""
    # The kernels read K/V rows with 16-byte copies and Q with 8-byte loads.
    for name, cache in (("key_cache", problem.key_cache), ("value_cache", problem.value_cache)):
        if not _aligned(cache, cache.stride()[:3], 16):
            return f"{name} pointer and strides must be multiples of 16 bytes"
    if not _aligned(problem.query, problem.query.stride()[:2], 8):
        return "query pointer and strides must be multiples of 8 bytes"
    return None


@functools.cache
def _resident_ctas(
    device_index: int, head_dim: int, q_dtype: int, cache_dtype: int, block_m: int
) -> int:
    ext = extension.loaded()
    sms = torch.cuda.get_device_properties(device_index).multi_processor_count
    return sms * max(ext.ctas_per_sm(device_index, head_dim, q_dtype, cache_dtype, block_m), 1)


def resident_ctas(batch: Batch) -> int:
    """CTAs of this batch's kernel (the tile the plan picks for its rows per KV head) the whole
    GPU holds at once (occupancy x SMs); one on the SIMT executor, which runs one at a time."""
    if batch.device.type == "cpu":
        return 1
    codes = extension.DTYPE_CODES
    cache_dtype = codes[batch.cache_dtype]
    rows = max(batch.max_seqlen_q, 1) * batch.group_size
    return _resident_ctas(
        batch.device.index,
        batch.head_dim,
        codes[batch.query_dtype],
        cache_dtype,
        extension.loaded().block_m_for(batch.head_dim, cache_dtype, rows),
    )


def kernel_plan(batch: Batch, resident: int, num_splits: int | None = None) -> dict[str, object]:
    """The C++ plan (csrc/common/plan.h, host only): ``kernel_name`` (the kernel the launch
    runs: :func:`kernel_name`), ``block_m`` (64, or 128
    for more than 64 rows per KV head on a 1-byte cache at head_dim 128), ``block_n``,
    ``threads``, ``smem_bytes``, ``m_tiles``, ``num_splits``, ``grid``, ``key_groups`` and the
    split-KV workspace sizes ``ws_o_elems`` / ``ws_lse_elems`` (float32 elements; 0 when
    unsplit) for ``resident`` CTA slots on the GPU. ``num_splits`` forces the count (clamped to
    what the grid holds).

    Uses host-side sizes only (``max_seqlen_q/k``, the window, the launch-wide causal flag), so a
    captured graph keeps its plan; each CTA derives its own key range from the device-side
    ``seq_lens``. A window bounded on both sides (the right one by causality or by the window)
    sizes the splits from the keys one query tile's window spans, not from the context.
    """
    report = _module(batch.device).plan(
        **extension.plan_sizes(batch),
        num_tokens=batch.num_tokens,
        head_dim=batch.head_dim,
        cache_dtype=extension.DTYPE_CODES[batch.cache_dtype],
        resident_ctas=resident,
        num_splits=num_splits or 0,
    )
    report["kernel_name"] = kernel_name(report["kernel_name"], batch)
    return report


def kernel_name(tile_kernel: str, batch: Batch) -> str:
    """The kernel a launch of ``batch`` runs (csrc/mma_sync/kernel.cuh ``kernel_of``): the C++
    plan's tile kernel (``paged_attention_kernel`` or ``paged_attention_kernel_m128``), or its
    ``_pth`` twin for per-token-head scales (every int8 cache). Either writes the LSE in its
    epilogue when asked (unsplit; the merge does when split), so the LSE names no kernel."""
    return f"{tile_kernel}_pth" if batch.per_token_head_scales else tile_kernel


def num_splits_for(batch: Batch, resident: int) -> int:
    """Split-KV count for ``resident`` CTA slots: 1 unless (seqs x KV heads x M tiles) CTAs
    leave the GPU underused, else the fewest splits that fill whole waves (the C++ plan)."""
    return int(kernel_plan(batch, resident)["num_splits"])


@dataclass(frozen=True)
class MmaSyncPlan:
    """A batch's C++ plan (``launch``: ``_C.Plan``, handed back to every launch as it is), its
    split-KV count and, when it splits, the partial buffers: views of the kept workspace
    (``ws_o`` float32 [splits, tokens, q_heads, head_dim], ``ws_lse`` [splits, tokens,
    q_heads]), or None to allocate them per launch (the one-shot path)."""

    num_splits: int
    ws_o: torch.Tensor | None
    ws_lse: torch.Tensor | None
    launch: object


def plan(batch: Batch, workspace=None, num_splits: int | None = None) -> MmaSyncPlan:
    """The plan of the kernel that runs ``batch`` (:func:`plan_refusal`'s reason raised as
    :class:`Refused`). By default :func:`num_splits_for` chooses the split count, capped by what
    ``workspace`` (``fp8_noncausal_attn.plan.Workspace``) holds; ``num_splits`` forces it."""
    why = plan_refusal(batch)
    if why is not None:
        raise Refused(why)
    resident = resident_ctas(batch)
    report = kernel_plan(batch, resident, num_splits)
    if workspace is not None and report["num_splits"] > 1:
        fits = workspace.max_splits(batch.num_tokens)
        if fits < report["num_splits"]:
            report = kernel_plan(batch, resident, fits)
    num_splits = int(report["num_splits"])
    if workspace is None or num_splits == 1:
        return MmaSyncPlan(num_splits, None, None, report["launch"])
    ws_o, ws_lse = workspace.partials(num_splits, batch.num_tokens)
    return MmaSyncPlan(num_splits, ws_o, ws_lse, report["launch"])


def run(
    problem: AttentionProblem, plan: MmaSyncPlan, out: torch.Tensor, lse: torch.Tensor | None = None
) -> None:
    """Launch attention (and the split-KV merge when the plan splits), writing ``out``
    [num_tokens, num_q_heads, head_dim] in place. Asynchronous on the current stream.

    ``lse`` (float32 [num_tokens, num_q_heads], contiguous), when given, receives each row's
    natural-log LSE in the same passes: from the attention kernel's epilogue when the plan does
    not split, from the split merge when it does."""
    if lse is not None and not lse.is_contiguous():
        raise ValueError("mma_sync writes the LSE into a contiguous [num_tokens, num_q_heads]")
    q = problem.query
    device = q.device
    num_splits, ws_o, ws_lse = plan.num_splits, plan.ws_o, plan.ws_lse
    if num_splits > 1 and ws_o is None:
        rows = (num_splits, problem.num_tokens, problem.num_q_heads)
        ws_lse = torch.empty(rows, dtype=torch.float32, device=device)
        ws_o = torch.empty(rows + (problem.head_dim,), dtype=torch.float32, device=device)
    inputs = LaunchInputs(problem, out, num_splits, ws_o, ws_lse)
    # The index tensors (the causal flags too, bool or int32) are read in place through their
    # strides: vLLM rewrites them between replays.
    fields = launch_values(MMA_SYNC, inputs)
    writes = {"out": out, "lse": lse, "ws_o": ws_o, "ws_lse": ws_lse}
    with extension.launching(device, **writes) as (ext, device_index, stream):
        ext.paged_attention(
            device=device_index,
            stream=stream,
            plan=plan.launch,
            q_dtype=extension.DTYPE_CODES[q.dtype],
            cache_dtype=extension.DTYPE_CODES[problem.key_cache.dtype],
            fields=fields,
            lse=0 if lse is None else lse.data_ptr(),
        )
