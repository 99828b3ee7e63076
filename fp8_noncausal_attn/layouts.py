"""No-copy views of the KV-cache layouts that serving stacks use (SPEC §2).

Kernels take the logical ``[num_blocks, block_size, num_kv_heads, head_dim]`` shape with all four
strides, so each layout below is only a view, never a copy.
"""

from __future__ import annotations

from typing import Literal

import torch

from .scales import CACHE_DTYPES, PER_TOKEN_HEAD_DTYPES

CacheLayout = Literal["vllm", "kv_first", "block_first"]


def split_kv_cache(
    kv_cache: torch.Tensor,
    layout: CacheLayout,
    cache_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """View one combined cache tensor as ``(key_cache, value_cache)``.

    Layouts:
      ``"vllm"``:        vLLM 0.33's ``[num_blocks, num_kv_heads, block_size, 2 * head_dim]``, K and
                         V side by side in the last dim.
      ``"kv_first"``:    ``[2, num_blocks, block_size, num_kv_heads, head_dim]``.
      ``"block_first"``: ``[num_blocks, 2, block_size, num_kv_heads, head_dim]``.
    ``cache_dtype`` reinterprets the storage (FP8 caches are often kept as uint8); without it the
    tensor's own dtype is used. Both returned views have the logical shape
    ``[num_blocks, block_size, num_kv_heads, head_dim]``.
    """
    if cache_dtype is not None:
        if cache_dtype not in CACHE_DTYPES:
            raise TypeError(f"cache_dtype must be one of {CACHE_DTYPES}, got {cache_dtype}")
        if kv_cache.element_size() != cache_dtype.itemsize:
            raise TypeError(
                f"cache_dtype {cache_dtype} cannot view kv_cache of dtype {kv_cache.dtype}: "
                "element sizes differ"
            )
        kv_cache = kv_cache.view(cache_dtype)
    if layout == "vllm":
        if kv_cache.dim() != 4 or kv_cache.shape[-1] % 2:
            raise ValueError(
                "kv_cache for layout 'vllm' must be [num_blocks, num_kv_heads, block_size, "
                f"2 * head_dim], got shape {list(kv_cache.shape)}"
            )
        head_dim = kv_cache.shape[-1] // 2
        return (
            kv_cache[..., :head_dim].transpose(1, 2),
            kv_cache[..., head_dim:].transpose(1, 2),
        )
    if layout in ("kv_first", "block_first"):
        kv_axis = 0 if layout == "kv_first" else 1
        if kv_cache.dim() != 5 or kv_cache.shape[kv_axis] != 2:
            raise ValueError(
                f"kv_cache for layout {layout!r} must have rank 5 with size 2 at dim {kv_axis}, "
                f"got shape {list(kv_cache.shape)}"
            )
        key_cache, value_cache = kv_cache.unbind(kv_axis)
        return key_cache, value_cache
    raise ValueError(f"layout must be 'vllm', 'kv_first' or 'block_first', got {layout!r}")


# Bytes of one inline per-token-head scale (a float32) after each head's K and V data.
_SCALE_BYTES = torch.finfo(torch.float32).bits // 8


def split_per_token_head_cache(
    kv_cache: torch.Tensor, cache_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """View vLLM's per-token-head page as ``(key_cache, value_cache, k_scale, v_scale)``, no copy.

    vLLM's TRITON_ATTN (0.32, 0.33) packs ``fp8_per_token_head`` / ``int8_per_token_head`` layers
    as one ``[num_blocks, num_kv_heads, block_size, 2 * (head_dim + 4)]`` tensor of 1-byte
    elements (uint8 for FP8, int8 for int8), whose last dim holds, per (block, head, slot),
    ``[K (head_dim bytes) | K scale (float32) | V (head_dim bytes) | V scale (float32)]``; the
    first three dims may have any physical order (HND or NHD pages), the last is contiguous.

    Args:
        kv_cache: that tensor, one layer's view of vLLM's allocation.
        cache_dtype: the element type of the data, float8_e4m3fn (vLLM's fp8_per_token_head on
            CUDA), float8_e5m2 or int8.
    Returns:
        ``key_cache``, ``value_cache``: ``[num_blocks, block_size, num_kv_heads, head_dim]`` in
        ``cache_dtype``; ``k_scale``, ``v_scale``: float32 ``[num_blocks, block_size,
        num_kv_heads]``, strided views of the inline scales (real K = stored K * k_scale).
    """
    if cache_dtype not in PER_TOKEN_HEAD_DTYPES:
        raise TypeError(f"cache_dtype must be one of {PER_TOKEN_HEAD_DTYPES}, got {cache_dtype}")
    content = kv_cache.shape[-1] if kv_cache.dim() == 4 else 0
    head_dim = content // 2 - _SCALE_BYTES
    if kv_cache.dim() != 4 or content % 2 or head_dim <= 0 or head_dim % _SCALE_BYTES:
        raise ValueError(
            "kv_cache must be [num_blocks, num_kv_heads, block_size, 2 * (head_dim + 4)] with "
            f"head_dim a positive multiple of 4, got shape {list(kv_cache.shape)}"
        )
    if kv_cache.element_size() != 1:
        raise TypeError(f"kv_cache must have 1-byte elements (uint8, int8), got {kv_cache.dtype}")
    # The float32 view needs 4-byte aligned strides and offset, as vLLM's own scale view does.
    if kv_cache.stride(-1) != 1 or any(
        x % _SCALE_BYTES for x in (*kv_cache.stride()[:-1], kv_cache.storage_offset())
    ):
        raise ValueError(
            "kv_cache must have a contiguous last dim and strides and offset that are multiples "
            f"of 4 bytes, got strides {kv_cache.stride()}, offset {kv_cache.storage_offset()}"
        )
    half = content // 2
    data = kv_cache.view(cache_dtype)
    words = kv_cache.view(torch.float32)
    return (
        data[..., :head_dim].transpose(1, 2),
        data[..., half : half + head_dim].transpose(1, 2),
        words[..., head_dim // _SCALE_BYTES].transpose(1, 2),
        words[..., (half + head_dim) // _SCALE_BYTES].transpose(1, 2),
    )
