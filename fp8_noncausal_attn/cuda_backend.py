"""The compiled CUDA kernels (``backend="cuda"``), through ``fp8_noncausal_attn._C``.

``_C`` (csrc/ + python/bindings.cpp, built by CMake from setup.py) runs mma.sync tensor-core
kernels with cp.async multi-stage KV loads, compiled for sm_90a and sm_100a. It takes raw device
pointers, strides and the stream, so it works with any torch build; this module turns an
:class:`AttentionProblem` into that call, chooses the split-KV count and allocates the split-KV
workspace with torch's caching allocator (graph-safe). Nothing here synchronises with the host.
"""

from __future__ import annotations

import functools
import math
from types import ModuleType

import torch

from .problem import AttentionProblem

# Element codes of csrc/params.h.
DTYPE_CODES = {
    torch.bfloat16: 0,
    torch.float16: 1,
    torch.float8_e4m3fn: 2,
    torch.float8_e5m2: 3,
}
MAX_SPLITS = 32
# A split should stream at least this many key tiles, or the merge costs more than it saves.
MIN_TILES_PER_SPLIT = 4
# Split-KV takes the fewest splits whose CTAs fill the resident slots (CTAs per SM x SMs) in
# whole waves to at least this fraction; a last wave left mostly empty idles most SMs.
WAVE_FILL = 0.9
MAX_GRID_Z = 65535


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


def _arch_of(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"{major}{minor}a"


def _built_archs() -> list[str]:
    ext, _ = _load()
    return [arch.removesuffix("-real") for arch in ext.CUDA_ARCHS.split(",")]


def _arch_supported(device: torch.device) -> str | None:
    """None when ``_C`` holds machine code for ``device``, else why not."""
    built = _built_archs()
    arch = _arch_of(device)
    if arch not in built:
        return (
            f"the CUDA extension was built for sm_{', sm_'.join(built)}, this GPU is sm_{arch} "
            "(rebuild with FP8NCA_CUDA_ARCHS including it)"
        )
    return None


def availability() -> tuple[bool, str]:
    """Whether the compiled kernels run here, and why not."""
    ext, why = _load()
    if ext is None:
        return False, why
    if not torch.cuda.is_available():
        return False, "the CUDA extension is built, but no CUDA GPU is visible"
    why_not = _arch_supported(torch.device("cuda", torch.cuda.current_device()))
    if why_not is not None:
        return False, why_not
    archs = ", ".join(f"sm_{arch}" for arch in _built_archs())
    return True, f"compiled CUDA kernels (mma.sync, cp.async) for {archs}"


def _aligned(t: torch.Tensor, strides: tuple[int, ...], nbytes: int) -> bool:
    size = t.element_size()
    return t.data_ptr() % nbytes == 0 and all((s * size) % nbytes == 0 for s in strides)


def unsupported_reason(problem: AttentionProblem) -> str | None:
    """None when the CUDA kernels can run ``problem``, else the reason."""
    q, k, v = problem.query, problem.key_cache, problem.value_cache
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
    # The kernels read K/V rows with 16-byte copies and Q with 8-byte loads.
    for name, cache in (("key_cache", k), ("value_cache", v)):
        if not _aligned(cache, cache.stride()[:3], 16):
            return f"{name} pointer and strides must be multiples of 16 bytes"
    if not _aligned(q, q.stride()[:2], 8):
        return "query pointer and strides must be multiples of 8 bytes"
    if problem.num_seqs > MAX_GRID_Z:
        return f"at most {MAX_GRID_Z} sequences per launch, got {problem.num_seqs}"
    for name, t in (("cu_seqlens_q", problem.cu_seqlens_q), ("seq_lens", problem.seq_lens)):
        if not t.is_contiguous():
            return f"{name} must be contiguous"
    return None


def _out_aligned(out: torch.Tensor, kv_dtype: torch.dtype) -> bool:
    # The kernel stores 2 * (4 / cache element size) output elements per thread at once.
    store_bytes = 16 if kv_dtype.itemsize == 1 else 8
    return _aligned(out, out.stride()[:2], store_bytes)


@functools.cache
def _resident_ctas(device_index: int, head_dim: int, q_dtype: int, kv_dtype: int) -> int:
    ext, _ = _load()
    sms = torch.cuda.get_device_properties(device_index).multi_processor_count
    return sms * max(ext.ctas_per_sm(device_index, head_dim, q_dtype, kv_dtype), 1)


def resident_ctas(problem: AttentionProblem) -> int:
    """CTAs of this problem's kernel the whole GPU holds at once (occupancy x SMs)."""
    return _resident_ctas(
        problem.query.device.index,
        problem.head_dim,
        DTYPE_CODES[problem.query.dtype],
        DTYPE_CODES[problem.key_cache.dtype],
    )


def num_splits_for(problem: AttentionProblem, resident: int) -> int:
    """Split-KV count for ``resident`` CTA slots: 1 unless (seqs x KV heads x M tiles) CTAs
    leave the GPU underused, else the fewest splits that fill whole waves to WAVE_FILL.

    Uses host-side sizes only (``max_seqlen_q/k``), so a captured graph keeps its plan; each
    CTA derives its own key range from the device-side ``seq_lens``.
    """
    ext, _ = _load()
    m_tiles = math.ceil(max(problem.max_seqlen_q, 1) * problem.group_size / ext.BLOCK_M)
    ctas = problem.num_seqs * problem.num_kv_heads * m_tiles
    key_tiles = math.ceil(max(problem.max_seqlen_k, 1) / ext.block_n(problem.head_dim))
    max_splits = min(
        key_tiles // MIN_TILES_PER_SPLIT, MAX_SPLITS, MAX_GRID_Z // max(problem.num_seqs, 1)
    )
    if ctas >= resident or max_splits <= 1:
        return 1
    best, best_fill = 1, 0.0
    for splits in range(1, max_splits + 1):
        total = ctas * splits
        fill = total / (math.ceil(total / resident) * resident)
        if fill >= WAVE_FILL:
            return splits
        if fill > best_fill:
            best, best_fill = splits, fill
    return best


def paged_attention(
    problem: AttentionProblem, out: torch.Tensor, num_splits: int | None = None
) -> None:
    """Run the CUDA kernels, writing ``out`` [num_tokens, num_q_heads, head_dim] in place.

    ``num_splits`` forces the split-KV count (tests use it to cover the merge kernel); by
    default :func:`num_splits_for` chooses it. Asynchronous on the current stream.
    """
    ext, why = _load()
    if ext is None:
        raise RuntimeError(why)
    if problem.num_tokens == 0 or problem.num_seqs == 0:
        return
    q = problem.query
    device = q.device
    target = out
    if not _out_aligned(out, problem.key_cache.dtype):
        target = torch.empty_like(q)
    if num_splits is None:
        num_splits = num_splits_for(problem, resident_ctas(problem))
    num_splits = max(1, min(num_splits, MAX_GRID_Z // max(problem.num_seqs, 1)))
    ws_o = ws_lse = None
    if num_splits > 1:
        rows = (num_splits, problem.num_tokens, problem.num_q_heads)
        ws_lse = torch.empty(rows, dtype=torch.float32, device=device)
        ws_o = torch.empty(rows + (problem.head_dim,), dtype=torch.float32, device=device)
    causal_per_seq = problem.causal_per_seq
    stream = torch.cuda.current_stream(device).cuda_stream
    with torch.cuda.device(device):
        ext.paged_attention(
            device=device.index,
            stream=stream,
            q=q.data_ptr(),
            k=problem.key_cache.data_ptr(),
            v=problem.value_cache.data_ptr(),
            out=target.data_ptr(),
            block_table=problem.block_table.data_ptr(),
            cu_seqlens_q=problem.cu_seqlens_q.data_ptr(),
            seq_lens=problem.seq_lens.data_ptr(),
            k_scale=problem.k_scale.data_ptr(),
            v_scale=problem.v_scale.data_ptr(),
            causal_per_seq=0 if causal_per_seq is None else causal_per_seq.data_ptr(),
            causal=bool(problem.causal),
            ws_o=0 if ws_o is None else ws_o.data_ptr(),
            ws_lse=0 if ws_lse is None else ws_lse.data_ptr(),
            q_dtype=DTYPE_CODES[q.dtype],
            kv_dtype=DTYPE_CODES[problem.key_cache.dtype],
            q_strides=tuple(q.stride()[:2]),
            o_strides=tuple(target.stride()[:2]),
            k_strides=tuple(problem.key_cache.stride()[:3]),
            v_strides=tuple(problem.value_cache.stride()[:3]),
            bt_strides=tuple(problem.block_table.stride()),
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
    if target is not out:
        out.copy_(target)
