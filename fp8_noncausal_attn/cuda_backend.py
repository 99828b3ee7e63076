"""The compiled CUDA kernels (``backend="cuda"``), through ``fp8_noncausal_attn._C``.

``_C`` (csrc/ + python/bindings.cpp, built by CMake from setup.py) holds the portable mma.sync
kernel family (cp.async multi-stage KV loads), compiled by default for sm_89, sm_90, the sm_100
family (100f) and sm_120 with PTX for the newest, the split-KV merge and the cache write. It takes
raw device pointers, strides and the stream, so it works with any torch build; this module turns
an :class:`AttentionProblem` into that call, takes tiles and the split-KV count from the C++ plan
function and allocates the split-KV workspace with torch's caching allocator (graph-safe) when
no kept workspace is given. Nothing here synchronises with the host.

The CUTLASS-DSL families (wgmma, tcgen05; :mod:`fp8_noncausal_attn.dsl_families`) run through
this backend too, opt-in only (``FP8NCA_CUDA_FAMILY``): compiled, NEVER RUN ON HARDWARE.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from types import ModuleType

import torch

from . import dsl_families
from .problem import AttentionProblem

# Element codes of csrc/common/params.h.
DTYPE_CODES = {
    torch.bfloat16: 0,
    torch.float16: 1,
    torch.float8_e4m3fn: 2,
    torch.float8_e5m2: 3,
}
# Most split-KV partials a plan uses (csrc/common/plan.h kMaxSplits; the build test checks they
# agree): workspaces are sized with it.
MAX_SPLITS = 32
# The kernels take window sides as C ints; a side this long reaches past any context, so larger
# ones (validation admits any int) are passed as this.
_INT32_MAX = 2**31 - 1


def window_sides(problem: AttentionProblem) -> tuple[int, int]:
    """The problem's ``(left, right)`` window as the kernels take it: -1 = unbounded, others
    capped at INT32_MAX (already past any position)."""
    left, right = problem.window
    return min(left, _INT32_MAX), min(right, _INT32_MAX)


@functools.cache
def _load() -> tuple[ModuleType | None, str]:
    try:
        from . import _C
    except ImportError as err:
        return None, (
            f"the CUDA extension fp8_noncausal_attn._C is not built ({err}); build it where nvcc "
            "is: pip install nvidia-cutlass==4.2.0.0 pybind11, then pip install -e ."
        )
    return _C, ""


def _version(code: int) -> str:
    """CUDA version code (e.g. 13000) as "13.0"."""
    return f"{code // 1000}.{code % 1000 // 10}"


def _driver_reason(ext: ModuleType) -> str | None:
    """None when the installed driver runs the extension's (statically linked) CUDA runtime."""
    found, needed = ext.driver_version(), ext.CUDA_RUNTIME_VERSION
    if found >= needed:
        return None
    return (
        f"the CUDA extension's runtime needs a newer NVIDIA driver: driver {_version(found)} "
        f"found, {_version(needed)} needed (CUDA {_version(needed)} requires driver >= "
        "580 on Linux)"
    )


def _parse_arch(arch: str) -> tuple[int, int, str]:
    """ "100f" -> (10, 0, "f"): compute capability and suffix ("", "a" or "f")."""
    suffix = arch[-1] if arch[-1] in "af" else ""
    digits = arch.removesuffix(suffix)
    return int(digits[:-1]), int(digits[-1]), suffix


def runs_on(capability: tuple[int, int], cubins: list[str], ptx: str | None) -> bool:
    """Whether a binary with machine code for ``cubins`` and PTX for ``ptx`` runs on a GPU of
    ``capability``: a plain cubin (sm_89) runs on its major version from its minor up, a family
    cubin (sm_100f) on every member of its family (sm_100, sm_103, ...), an arch-specific one
    (sm_90a) only on that exact GPU; PTX is JIT-compiled by the driver for any newer GPU."""
    major, minor = capability
    for arch in cubins:
        c_major, c_minor, suffix = _parse_arch(arch)
        if suffix == "a" and (major, minor) == (c_major, c_minor):
            return True
        if suffix != "a" and major == c_major and minor >= c_minor:
            return True
    return ptx is not None and capability >= _parse_arch(ptx)[:2]


def _built_archs() -> list[str]:
    ext, _ = _load()
    return ext.CUDA_ARCHS.split(",")


def _arch_supported(device: torch.device) -> str | None:
    """None when ``_C`` holds code (machine code or PTX) that runs on ``device``, else why not."""
    ext, _ = _load()
    built = _built_archs()
    capability = torch.cuda.get_device_capability(device)
    if runs_on(capability, built, ext.PTX_ARCH or None):
        return None
    return (
        f"the CUDA extension was built for sm_{', sm_'.join(built)} (PTX: "
        f"{ext.PTX_ARCH or 'none'}), this GPU is sm_{capability[0]}{capability[1]} (rebuild "
        "with FP8NCA_CUDA_ARCHS including it)"
    )


def availability() -> tuple[bool, str]:
    """Whether the compiled kernels run here, and why not."""
    ext, why = _load()
    if ext is None:
        return False, why
    if not torch.cuda.is_available():
        return False, "the CUDA extension is built, but no CUDA GPU is visible"
    why_not = _driver_reason(ext) or _arch_supported(
        torch.device("cuda", torch.cuda.current_device())
    )
    if why_not is not None:
        return False, why_not
    archs = ", ".join(f"sm_{arch}" for arch in _built_archs())
    return True, (
        f"compiled CUDA kernels (mma.sync family, cp.async) for {archs}, PTX for "
        f"compute_{ext.PTX_ARCH}"
    )


def _aligned(t: torch.Tensor, strides: tuple[int, ...], nbytes: int) -> bool:
    size = t.element_size()
    return t.data_ptr() % nbytes == 0 and all((s * size) % nbytes == 0 for s in strides)


def unsupported_reason(problem: AttentionProblem) -> str | None:
    """None when the CUDA kernels can run ``problem``, else the reason."""
    q, k = problem.query, problem.key_cache
    if not q.is_cuda:
        return "the CUDA kernels need CUDA tensors"
    ext, why = _load()
    if ext is None:
        return why
    why_not = _arch_supported(q.device)
    if why_not is not None:
        return why_not
    # validation.py already limits head_dim (64/128/256) and the dtypes to the compiled set.
    if k.dtype.itemsize == 2 and k.dtype != q.dtype:
        return (
            f"a {k.dtype} cache under a {q.dtype} query runs on Triton (fp32 dots): converting "
            "bf16 keys to fp16 could overflow"
        )
    why_not = run_unsupported_reason(problem, None)
    if why_not is not None:
        return why_not
    if problem.num_seqs > ext.MAX_SEQS:
        return f"at most {ext.MAX_SEQS} sequences per launch, got {problem.num_seqs}"
    return None


def run_unsupported_reason(problem: AttentionProblem, out: torch.Tensor | None) -> str | None:
    """Backend contract, run time: None when the layer's own tensors suit the kernels' loads
    (checked on every run: pointers differ per layer). ``out`` is never a reason: the kernels
    pick their store width from its alignment and write it in place."""
    # The kernels read K/V rows with 16-byte copies and Q with 8-byte loads.
    for name, cache in (("key_cache", problem.key_cache), ("value_cache", problem.value_cache)):
        if not _aligned(cache, cache.stride()[:3], 16):
            return f"{name} pointer and strides must be multiples of 16 bytes"
    if not _aligned(problem.query, problem.query.stride()[:2], 8):
        return "query pointer and strides must be multiples of 8 bytes"
    return None


@functools.cache
def _resident_ctas(
    device_index: int, head_dim: int, q_dtype: int, kv_dtype: int, block_m: int
) -> int:
    ext, _ = _load()
    sms = torch.cuda.get_device_properties(device_index).multi_processor_count
    return sms * max(ext.ctas_per_sm(device_index, head_dim, q_dtype, kv_dtype, block_m), 1)


def resident_ctas(problem: AttentionProblem) -> int:
    """CTAs of this problem's kernel (the tile the plan picks for its rows per KV head) the whole
    GPU holds at once (occupancy x SMs)."""
    ext, _ = _load()
    kv_dtype = DTYPE_CODES[problem.key_cache.dtype]
    rows = max(problem.max_seqlen_q, 1) * problem.group_size
    return _resident_ctas(
        problem.query.device.index,
        problem.head_dim,
        DTYPE_CODES[problem.query.dtype],
        kv_dtype,
        ext.block_m_for(problem.head_dim, kv_dtype, rows),
    )


def kernel_plan(
    problem: AttentionProblem, resident: int, num_splits: int | None = None
) -> dict[str, object]:
    """The C++ plan (csrc/common/plan.h, host only): ``kernel_name``, ``block_m`` (64, or 128
    for more than 64 rows per KV head on an FP8 cache at head_dim 128), ``block_n``,
    ``threads``, ``smem_bytes``, ``m_tiles``, ``num_splits``, ``grid`` and the split-KV workspace
    sizes ``ws_o_elems`` / ``ws_lse_elems`` (float32 elements; 0 when unsplit) for ``resident``
    CTA slots on the GPU. ``num_splits`` forces the count (clamped to what the grid holds).

    Uses host-side sizes only (``max_seqlen_q/k``, the window, the launch-wide causal flag), so a
    captured graph keeps its plan; each CTA derives its own key range from the device-side
    ``seq_lens``. A window bounded on both sides (the right one by causality or by the window)
    sizes the splits from the keys one query tile's window spans, not from the context.
    """
    ext, why = _load()
    if ext is None:
        raise RuntimeError(why)
    return ext.plan(
        **plan_sizes(problem),
        num_tokens=problem.num_tokens,
        head_dim=problem.head_dim,
        kv_dtype=DTYPE_CODES[problem.key_cache.dtype],
        resident_ctas=resident,
        num_splits=num_splits or 0,
    )


def plan_sizes(problem: AttentionProblem) -> dict[str, int | bool]:
    """The host sizes the split-KV planner reads (``_C.plan`` and ``_C.plan_splits`` keywords):
    sequences, heads, ``max_seqlen_q/k``, the window as the kernels take it and whether every
    sequence is causal (per-sequence flags live on the device: planned as bidirectional)."""
    window_left, window_right = window_sides(problem)
    return {
        "num_seqs": problem.num_seqs,
        "num_q_heads": problem.num_q_heads,
        "num_kv_heads": problem.num_kv_heads,
        "max_seqlen_q": problem.max_seqlen_q,
        "max_seqlen_k": problem.max_seqlen_k,
        "window_left": window_left,
        "window_right": window_right,
        "causal": problem.causal_per_seq is None and bool(problem.causal),
    }


def num_splits_for(problem: AttentionProblem, resident: int) -> int:
    """Split-KV count for ``resident`` CTA slots: 1 unless (seqs x KV heads x M tiles) CTAs
    leave the GPU underused, else the fewest splits that fill whole waves (the C++ plan)."""
    return int(kernel_plan(problem, resident)["num_splits"])


@dataclass(frozen=True)
class CudaPlan:
    """A batch's split-KV count and, when it splits, the partial buffers: views of the kept
    workspace (``ws_o`` float32 [splits, tokens, q_heads, head_dim], ``ws_lse`` [splits, tokens,
    q_heads]), or None to allocate them per launch (the one-shot path)."""

    num_splits: int
    ws_o: torch.Tensor | None
    ws_lse: torch.Tensor | None
    # The kernel family that runs (dsl_families.FAMILY_NAMES), why when an opt-in request was
    # refused, and an opted-in DSL family's own plan (the mma.sync fields above stay the
    # fallback for a layer whose tensors that family cannot take).
    family: str = dsl_families.DEFAULT_FAMILY
    family_reason: str = ""
    dsl: dsl_families.DslPlan | None = None


def plan(
    problem: AttentionProblem,
    workspace=None,
    num_splits: int | None = None,
    family: str | None = None,
) -> CudaPlan:
    """Backend contract, plan time (host sizes only). ``family`` asks for a kernel family
    (default ``$FP8NCA_CUDA_FAMILY``, else mma_sync; the DSL families are opt-in, see
    :mod:`fp8_noncausal_attn.dsl_families`): one that cannot run the batch leaves mma_sync with
    the reason in ``family_reason``. ``num_splits`` forces the split-KV count (tests use it to
    cover the merge kernel)."""
    portable = _mma_sync_plan(problem, workspace, num_splits)
    dsl, why = dsl_families.plan(problem, workspace, family, num_splits)
    if dsl is None:
        return dataclasses.replace(portable, family_reason=why) if why else portable
    return dataclasses.replace(portable, family=dsl.family, dsl=dsl)


def _mma_sync_plan(problem: AttentionProblem, workspace, num_splits: int | None) -> CudaPlan:
    """The mma.sync family's plan: by default :func:`num_splits_for` chooses the split count,
    capped by what ``workspace`` (``fp8_noncausal_attn.plan.Workspace``) holds."""
    num_splits = int(kernel_plan(problem, resident_ctas(problem), num_splits)["num_splits"])
    if workspace is None or num_splits == 1:
        return CudaPlan(num_splits, None, None)
    num_splits = min(num_splits, workspace.max_splits(problem.num_tokens))
    if num_splits == 1:
        return CudaPlan(1, None, None)
    ws_o, ws_lse = workspace.partials(num_splits, problem.num_tokens)
    return CudaPlan(num_splits, ws_o, ws_lse)


def paged_attention(
    problem: AttentionProblem, out: torch.Tensor, num_splits: int | None = None
) -> None:
    """One-shot form: plan (``num_splits`` forces the count) and run."""
    run(problem, plan(problem, None, num_splits), out)


def run(problem: AttentionProblem, plan: CudaPlan, out: torch.Tensor) -> None:
    """Run the CUDA kernels, writing ``out`` [num_tokens, num_q_heads, head_dim] in place.

    Asynchronous on the current stream.
    """
    ext, why = _load()
    if ext is None:
        raise RuntimeError(why)
    if problem.num_tokens == 0:  # with no sequence, every row is padding: the kernel zeroes it
        return
    if plan.dsl is not None:
        why = dsl_families.run_unsupported_reason(problem, out)
        if why is None:
            dsl_families.run(problem, plan.dsl, out)
            return
        dsl_families.warn_once(f"{plan.dsl.family} cannot take this layer, mma_sync runs: {why}")
    q = problem.query
    device = q.device
    num_splits, ws_o, ws_lse = plan.num_splits, plan.ws_o, plan.ws_lse
    if num_splits > 1 and ws_o is None:
        rows = (num_splits, problem.num_tokens, problem.num_q_heads)
        ws_lse = torch.empty(rows, dtype=torch.float32, device=device)
        ws_o = torch.empty(rows + (problem.head_dim,), dtype=torch.float32, device=device)
    window_left, window_right = window_sides(problem)
    causal_per_seq = problem.causal_per_seq
    # Read in place by the kernel (bool or int32, any stride): vLLM rewrites it between replays.
    causal_ptr, causal_bytes, causal_stride = (
        (0, 1, 0)
        if causal_per_seq is None
        else (causal_per_seq.data_ptr(), causal_per_seq.element_size(), causal_per_seq.stride(0))
    )
    stream = torch.cuda.current_stream(device).cuda_stream
    with torch.cuda.device(device):
        ext.paged_attention(
            device=device.index,
            stream=stream,
            q=q.data_ptr(),
            k=problem.key_cache.data_ptr(),
            v=problem.value_cache.data_ptr(),
            out=out.data_ptr(),
            block_table=problem.block_table.data_ptr(),
            cu_seqlens_q=problem.cu_seqlens_q.data_ptr(),
            seq_lens=problem.seq_lens.data_ptr(),
            k_scale=problem.k_scale.data_ptr(),
            v_scale=problem.v_scale.data_ptr(),
            causal_per_seq=causal_ptr,
            causal_bytes=causal_bytes,
            causal_stride=causal_stride,
            causal=bool(problem.causal),
            sinks=0 if problem.sinks is None else problem.sinks.data_ptr(),
            window_left=window_left,
            window_right=window_right,
            ws_o=0 if ws_o is None else ws_o.data_ptr(),
            ws_lse=0 if ws_lse is None else ws_lse.data_ptr(),
            q_dtype=DTYPE_CODES[q.dtype],
            kv_dtype=DTYPE_CODES[problem.key_cache.dtype],
            q_strides=tuple(q.stride()[:2]),
            o_strides=tuple(out.stride()[:2]),
            k_strides=tuple(problem.key_cache.stride()[:3]),
            v_strides=tuple(problem.value_cache.stride()[:3]),
            bt_strides=tuple(problem.block_table.stride()),
            cu_stride=problem.cu_seqlens_q.stride(0),
            sl_stride=problem.seq_lens.stride(0),
            num_tokens=problem.num_tokens,
            num_seqs=problem.num_seqs,
            num_q_heads=problem.num_q_heads,
            num_kv_heads=problem.num_kv_heads,
            head_dim=problem.head_dim,
            block_size=problem.block_size,
            max_seqlen_q=problem.max_seqlen_q,
            num_splits=num_splits,
            softmax_scale=float(problem.softmax_scale),
        )


def merge_splits(
    problem: AttentionProblem, ws_o: torch.Tensor, ws_lse: torch.Tensor, out: torch.Tensor
) -> None:
    """``out`` [num_tokens, num_q_heads, head_dim] (the query dtype; token and head strides
    free, head dims at unit stride) = the split-KV merge kernel (csrc/cascade/merge.cu) of
    partials another kernel family wrote: ``ws_o`` float32 [splits, num_tokens, num_q_heads,
    head_dim], each split's O normalised and times v_scale, and ``ws_lse`` float32 [splits,
    num_tokens, num_q_heads] in log2 units (-inf: the split saw no key; its O is never read),
    both contiguous. The problem's sinks join the denominator here, once; rows past
    ``cu_seqlens_q[-1]`` are written as zeros. Asynchronous on the current stream."""
    ext, why = _load()
    if ext is None:
        raise RuntimeError(why)
    rows = (ws_lse.shape[0], problem.num_tokens, problem.num_q_heads)
    layouts = (("ws_o", ws_o, (*rows, problem.head_dim)), ("ws_lse", ws_lse, rows))
    for name, tensor, shape in layouts:
        if tensor.dtype != torch.float32 or tuple(tensor.shape) != shape:
            raise ValueError(
                f"{name} must be float32 {list(shape)}, got {tensor.dtype} {list(tensor.shape)}"
            )
        if not tensor.is_contiguous() or tensor.device != out.device:
            raise ValueError(f"{name} must be contiguous on {out.device}")
    if out.stride(2) != 1:
        raise ValueError("out must hold each row's head dims at unit stride")
    if problem.num_tokens == 0:
        return
    device = out.device
    stream = torch.cuda.current_stream(device).cuda_stream
    with torch.cuda.device(device):
        ext.merge_splits(
            device=device.index,
            stream=stream,
            ws_o=ws_o.data_ptr(),
            ws_lse=ws_lse.data_ptr(),
            out=out.data_ptr(),
            o_strides=tuple(out.stride()[:2]),
            sinks=0 if problem.sinks is None else problem.sinks.data_ptr(),
            cu_seqlens_q=problem.cu_seqlens_q.data_ptr(),
            cu_stride=problem.cu_seqlens_q.stride(0),
            num_seqs=problem.num_seqs,
            num_splits=rows[0],
            num_tokens=problem.num_tokens,
            num_q_heads=problem.num_q_heads,
            head_dim=problem.head_dim,
            q_dtype=DTYPE_CODES[out.dtype],
        )


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
) -> None:
    """Same contract as ``reference.reshape_and_cache``, on the CUDA extension's kernel (bytes
    identical to ``scales.quantize``). ``key``/``value`` bf16/fp16 ``[num_tokens, num_kv_heads,
    head_dim]``; scales float32 ``[num_kv_heads]``, contiguous; ``slot_mapping`` int64
    ``[num_tokens]``, any stride. Asynchronous on the current stream."""
    ext, why = _load()
    if ext is None:
        raise RuntimeError(why)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    device = key.device
    ext.reshape_and_cache(
        device=device.index,
        stream=torch.cuda.current_stream(device).cuda_stream,
        key=key.data_ptr(),
        value=value.data_ptr(),
        key_cache=key_cache.data_ptr(),
        value_cache=value_cache.data_ptr(),
        slot_mapping=slot_mapping.data_ptr(),
        k_scale=k_scale.data_ptr(),
        v_scale=v_scale.data_ptr(),
        key_strides=tuple(key.stride()[:2]),
        value_strides=tuple(value.stride()[:2]),
        kc_strides=tuple(key_cache.stride()[:3]),
        vc_strides=tuple(value_cache.stride()[:3]),
        slot_stride=slot_mapping.stride(0),
        num_tokens=num_tokens,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=key_cache.shape[1],
        in_dtype=DTYPE_CODES[key.dtype],
        cache_dtype=DTYPE_CODES[key_cache.dtype],
    )
