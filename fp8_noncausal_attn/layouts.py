"""No-copy views of the KV-cache layouts that serving stacks use (SPEC §2).

Kernels take the logical ``[num_blocks, block_size, num_kv_heads, head_dim]`` shape with all four
strides, so each layout below is only a view, never a copy.
"""

from __future__ import annotations

from typing import Literal

import torch

from .scales import CACHE_DTYPES

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
