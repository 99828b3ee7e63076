"""The CUDA extension ``fp8_noncausal_attn._C``: loading it, whether its code runs on a GPU, its
element codes, and the calls every kernel family shares (the split planner's sizes, the split-KV
merge, the cache write).

``_C`` (csrc/ + python/bindings.cpp, built by CMake from setup.py) takes raw device pointers,
strides and the stream, so it works with any torch build. Nothing here synchronises with the
host.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from types import ModuleType

import torch

from ...launch_record import MMA_SYNC, refusal, window_sides
from ...problem import AttentionProblem, Batch, CacheWrite
from ...scales import LOG2E
from . import simt

# Element codes of csrc/common/params.h (_C.DTYPE_CODES; a test ties them). int8: per-token-head
# caches, read by the attention kernels only.
DTYPE_CODES = {
    torch.bfloat16: 0,
    torch.float16: 1,
    torch.float8_e4m3fn: 2,
    torch.float8_e5m2: 3,
    torch.int8: 5,
}
# Most split-KV partials a plan uses (csrc/common/plan.h kMaxSplits; a test ties them):
# workspaces are sized with it.
MAX_SPLITS = 32
# Most sequences per launch (csrc/common/plan.h kMaxSeqs: the grid's z limit less the padding
# slice; a test ties them), known before any module is loaded.
MAX_SEQS = 65534


@functools.cache
def load() -> tuple[ModuleType | None, str]:
    """``_C`` (imported once per process), or None and why it is not there: not built, or built
    from another launch record than this package's (refused here, before any plan or launch)."""
    try:
        from ... import _C
    except ImportError as err:
        return None, (
            f"the CUDA extension fp8_noncausal_attn._C is not built ({err}); build it where nvcc "
            "is: pip install nvidia-cutlass==4.2.0.0 pybind11, then pip install -e . (for the "
            "visible GPU; FP8NCA_CUDA_ARCHS=90, say, where none is)"
        )
    why = refusal(_C.__file__, getattr(_C, "LAUNCH_RECORD_HASH", None), MMA_SYNC)
    return (None, why) if why else (_C, "")


def loaded() -> ModuleType:
    """``_C``, or RuntimeError with the reason it is not there."""
    ext, why = load()
    if ext is None:
        raise RuntimeError(why)
    return ext


@contextlib.contextmanager
def launching(
    device: torch.device, **writes: torch.Tensor | None
) -> Iterator[tuple[ModuleType, int, int]]:
    """Where a launch on tensors of ``device`` goes: ``(module, device index, stream)``, with
    the device current for the block. CUDA tensors: ``_C`` on the current stream. CPU tensors:
    the SIMT executor (simt.py), synchronous, which may write only ``writes`` (named tensors,
    None skipped) outside shared memory."""
    if device.type == "cpu":
        module = simt.loaded()
        with simt.writable(module, **writes):
            yield module, 0, 0
        return
    with torch.cuda.device(device):
        yield loaded(), device.index, torch.cuda.current_stream(device).cuda_stream


def _version(code: int) -> str:
    """CUDA version code (e.g. 13000) as "13.0"."""
    return f"{code // 1000}.{code % 1000 // 10}"


def driver_reason(ext: ModuleType) -> str | None:
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


def built_archs() -> list[str]:
    """The architectures ``_C`` holds machine code for (``_C`` must be loaded)."""
    return loaded().CUDA_ARCHS.split(",")


def arch_reason(device: torch.device) -> str | None:
    """None when ``_C`` holds code (machine code or PTX) that runs on ``device``, else why not."""
    ext = loaded()
    built = built_archs()
    capability = torch.cuda.get_device_capability(device)
    if runs_on(capability, built, ext.PTX_ARCH or None):
        return None
    return (
        f"the CUDA extension was built for sm_{', sm_'.join(built)} (PTX: "
        f"{ext.PTX_ARCH or 'none'}), this GPU is sm_{capability[0]}{capability[1]} (rebuild "
        "with FP8NCA_CUDA_ARCHS including it)"
    )


def availability() -> tuple[bool, str]:
    """Whether ``_C`` loads and runs on this machine's GPU, and why (not): every CUDA kernel
    family needs it (mma_sync's kernels, and the split planner, merge and cache write that the
    CUTLASS-DSL families share with it)."""
    ext, why = load()
    if ext is None:
        return False, why
    if not torch.cuda.is_available():
        return False, "the CUDA extension is built, but no CUDA GPU is visible"
    why_not = driver_reason(ext) or arch_reason(torch.device("cuda", torch.cuda.current_device()))
    if why_not is not None:
        return False, why_not
    archs = ", ".join(f"sm_{arch}" for arch in built_archs())
    return True, f"_C built for {archs}, PTX for compute_{ext.PTX_ARCH}"


def device_reason(device: torch.device) -> str | None:
    """None when ``_C``'s kernels take tensors on ``device`` (CPU ones through the SIMT
    executor, :func:`launching`), else why not."""
    if device.type == "cpu":
        builds, why = simt.availability()
        return None if builds else why
    if device.type != "cuda":
        return "the CUDA kernels need CUDA tensors (or CPU tensors, on the SIMT executor)"
    ext, why = load()
    if ext is None:
        return why
    return arch_reason(device)


def plan_sizes(batch: Batch) -> dict[str, int | bool]:
    """The host sizes the split-KV planner reads (``_C.plan`` and ``_C.plan_splits`` keywords):
    sequences, heads, ``max_seqlen_q/k``, the window as the kernels take it and whether every
    sequence is causal (per-sequence flags live on the device: planned as bidirectional)."""
    window_left, window_right = window_sides(batch)
    return {
        "num_seqs": batch.num_seqs,
        "num_q_heads": batch.num_q_heads,
        "num_kv_heads": batch.num_kv_heads,
        "max_seqlen_q": batch.max_seqlen_q,
        "max_seqlen_k": batch.max_seqlen_k,
        "window_left": window_left,
        "window_right": window_right,
        "causal": batch.causal_per_seq is None and bool(batch.causal),
    }


def merge_splits(
    problem: AttentionProblem,
    ws_o: torch.Tensor,
    ws_lse: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor | None = None,
) -> None:
    """``out`` [num_tokens, num_q_heads, head_dim] (the query dtype; token and head strides
    free, head dims at unit stride) = the split-KV merge kernel (csrc/cascade/merge.cu) of
    partials a kernel family wrote: ``ws_o`` float32 [splits, num_tokens, num_q_heads,
    head_dim], each split's O normalised and times v_scale, and ``ws_lse`` float32 [splits,
    num_tokens, num_q_heads] in log2 units (-inf: the split saw no key; its O is never read),
    both contiguous. The problem's sinks join the denominator here, once; rows past
    ``cu_seqlens_q[-1]`` are written as zeros. ``lse`` (float32 [num_tokens, num_q_heads], any
    strides), when given, receives each merged row's natural-log LSE (-inf for padded rows).
    Asynchronous on the current stream."""
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
    if lse is not None and (lse.dtype != torch.float32 or tuple(lse.shape) != rows[1:]):
        raise ValueError(f"lse must be float32 {list(rows[1:])}, got {lse.dtype} {list(lse.shape)}")
    if problem.num_tokens == 0:
        return
    # The LSE output goes to the kernel only when asked for.
    lse_arguments = {} if lse is None else {"lse": lse.data_ptr(), "lse_strides": lse.stride()}
    with launching(out.device, out=out, lse=lse) as (ext, device_index, stream):
        ext.merge_splits(
            device=device_index,
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
            **lse_arguments,
        )


def merge_states(
    outs: torch.Tensor, lses: torch.Tensor, out: torch.Tensor, lse: torch.Tensor
) -> None:
    """``reference.merge_states``' contract on the merge kernel (csrc/cascade/merge.cu):
    ``outs`` [num_states, num_tokens, num_heads, head_dim] and natural-log ``lses`` [num_states,
    num_tokens, num_heads] become the kernel's float32 contiguous partials (a copy) with log2
    LSEs; ``out`` (bf16, fp16 or float32, head dims contiguous) and ``lse`` are written in
    place. Asynchronous on the current stream."""
    num_states, num_tokens, num_heads, head_dim = outs.shape
    if num_tokens == 0:
        return
    device = out.device
    ws_o = outs.to(torch.float32, memory_format=torch.contiguous_format)
    ws_lse = (lses * LOG2E).contiguous()
    # The kernel's padding bound cu_seqlens_q[num_seqs]: every row is a real one here.
    bound = torch.full((1,), num_tokens, dtype=torch.int32, device=device)
    with launching(device, out=out, lse=lse) as (ext, device_index, stream):
        codes = {**DTYPE_CODES, torch.float32: ext.MERGE_FP32}
        ext.merge_splits(
            device=device_index,
            stream=stream,
            ws_o=ws_o.data_ptr(),
            ws_lse=ws_lse.data_ptr(),
            out=out.data_ptr(),
            o_strides=tuple(out.stride()[:2]),
            sinks=0,
            cu_seqlens_q=bound.data_ptr(),
            cu_stride=1,
            num_seqs=0,
            num_splits=num_states,
            num_tokens=num_tokens,
            num_q_heads=num_heads,
            head_dim=head_dim,
            q_dtype=codes[out.dtype],
            lse=lse.data_ptr(),
            lse_strides=tuple(lse.stride()),
        )


def reshape_and_cache(write: CacheWrite) -> None:
    """Same contract as ``reference.reshape_and_cache``, on the CUDA extension's kernel (bytes
    identical to ``scales.quantize``). Asynchronous on the current stream."""
    key, value, key_cache, value_cache = write.key, write.value, write.key_cache, write.value_cache
    slot_mapping, k_scale, v_scale = write.slot_mapping, write.k_scale, write.v_scale
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    with launching(key.device, key_cache=key_cache, value_cache=value_cache) as launch:
        ext, device_index, stream = launch
        ext.reshape_and_cache(
            device=device_index,
            stream=stream,
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
