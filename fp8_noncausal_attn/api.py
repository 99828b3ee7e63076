"""The public API (SPEC §4): validate, pick a backend, run it through a ``torch.library`` op.

The ops are opaque to ``torch.compile`` and CUDA graphs; passing ``max_seqlen_q/k`` keeps a call
free of device-to-host synchronisation, so it can be captured in a graph.
"""

from typing import Optional

import torch

from . import dispatch
from .problem import AttentionProblem
from .scales import ScaleArg, compute_kv_scales
from .validation import validate_attention, validate_cache_write

__all__ = ["paged_attention", "reshape_and_cache", "compute_kv_scales", "available_backends"]

available_backends = dispatch.available_backends


@torch.library.custom_op("fp8_noncausal_attn::paged_attention", mutates_args=("out",))
def _paged_attention_op(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    causal_per_seq: Optional[torch.Tensor],  # noqa: UP045 (torch's schema inference needs it)
    causal: bool,
    softmax_scale: float,
    max_seqlen_q: int,
    max_seqlen_k: int,
    backend: str,
) -> None:
    problem = AttentionProblem(
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        block_table=block_table,
        cu_seqlens_q=cu_seqlens_q,
        seq_lens=seq_lens,
        k_scale=k_scale,
        v_scale=v_scale,
        causal=causal,
        causal_per_seq=causal_per_seq,
        softmax_scale=softmax_scale,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
    )
    dispatch.backend_module(backend).paged_attention(problem, out)


@_paged_attention_op.register_fake
def _paged_attention_fake(out, *args) -> None:
    return None


@torch.library.custom_op(
    "fp8_noncausal_attn::reshape_and_cache", mutates_args=("key_cache", "value_cache")
)
def _reshape_and_cache_op(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
) -> None:
    if key.is_cuda:
        from .triton_cache import reshape_and_cache as write
    else:
        from .reference import reshape_and_cache as write
    write(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)


@_reshape_and_cache_op.register_fake
def _reshape_and_cache_fake(*args) -> None:
    return None


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    causal: bool | torch.Tensor = True,
    k_scale: ScaleArg = None,
    v_scale: ScaleArg = None,
    softmax_scale: float | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    out: torch.Tensor | None = None,
    backend: str = "auto",
    validate: bool = False,
) -> torch.Tensor:
    """Paged attention over a (possibly FP8) KV cache with per-KV-head scales.

    Args:
        query: ``[num_tokens, num_q_heads, head_dim]`` bf16/fp16, all sequences packed.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``,
            float8_e4m3fn / float8_e5m2 / bf16 / fp16, any strides with a contiguous last dim
            (see :func:`fp8_noncausal_attn.layouts.split_kv_cache` for combined layouts).
        block_table: ``[num_seqs, max_blocks_per_seq]`` int32 page ids.
        cu_seqlens_q: ``[num_seqs + 1]`` int32 query offsets (vLLM's ``query_start_loc``).
        seq_lens: ``[num_seqs]`` int32 KV lengths, including each sequence's new tokens.
        causal: a bool for the whole call, or a ``[num_seqs]`` bool tensor per sequence.
        k_scale, v_scale: dequantisation multipliers (real K = stored K * k_scale[kv_head]):
            None, a float, a 0-d/1-element float32 tensor or a ``[num_kv_heads]`` float32 tensor.
        softmax_scale: defaults to ``head_dim ** -0.5``.
        max_seqlen_q, max_seqlen_k: upper bounds of q_len / kv_len; give both to avoid any
            device-to-host sync (needed for CUDA-graph capture).
        out: written in place when given (``query``'s shape and dtype).
        backend: ``"auto"``, ``"cuda"``, ``"triton"`` or ``"reference"``.
        validate: also run the checks that need device values on the host (a sync).
    Returns:
        ``[num_tokens, num_q_heads, head_dim]`` in ``query``'s dtype (``out`` when given).
    """
    problem = validate_attention(
        query, key_cache, value_cache, block_table, cu_seqlens_q, seq_lens,
        causal=causal, k_scale=k_scale, v_scale=v_scale, softmax_scale=softmax_scale,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, out=out, validate=validate,
    )  # fmt: skip
    chosen = dispatch.resolve_backend(backend, problem)
    if out is None:
        out = torch.empty_like(query)
    if problem.num_tokens == 0:
        return out
    _paged_attention_op(
        out, problem.query, problem.key_cache, problem.value_cache, problem.block_table,
        problem.cu_seqlens_q, problem.seq_lens, problem.k_scale, problem.v_scale,
        problem.causal_per_seq, problem.causal, problem.softmax_scale,
        problem.max_seqlen_q, problem.max_seqlen_k, chosen,
    )  # fmt: skip
    return out


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: ScaleArg = None,
    v_scale: ScaleArg = None,
    validate: bool = False,
) -> None:
    """Write new K/V rows into the paged caches, quantising to the cache dtype.

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]`` bf16/fp16.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` (any strides,
            contiguous last dim), FP8 or 16-bit; written in place.
        slot_mapping: ``[num_tokens]`` int64, ``block_id * block_size + offset``; < 0 is skipped.
        k_scale, v_scale: as in :func:`paged_attention`; the stored value is
            ``x / scale[kv_head]``, saturated to the format's finite max, rounded to nearest even.
    """
    k_scale_t, v_scale_t = validate_cache_write(
        key, value, key_cache, value_cache, slot_mapping,
        k_scale=k_scale, v_scale=v_scale, validate=validate,
    )  # fmt: skip
    if key.shape[0]:
        _reshape_and_cache_op(
            key, value, key_cache, value_cache, slot_mapping, k_scale_t, v_scale_t
        )
