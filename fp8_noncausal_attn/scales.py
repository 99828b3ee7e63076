"""Everything about KV-cache scales and FP8 formats, in one place.

A scale is a *dequantisation multiplier*: real K = stored K * k_scale[kv_head]. Users hand us
``None``, a Python float, a 0-d / 1-element tensor or a ``[num_kv_heads]`` tensor; kernels only
ever see the normalised form, a contiguous float32 ``[num_kv_heads]`` tensor, so a per-head scale
can never be dropped or broadcast from element 0 on the way down.
"""

from __future__ import annotations

import math

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
SIXTEEN_BIT_DTYPES = (torch.bfloat16, torch.float16)
CACHE_DTYPES = FP8_DTYPES + SIXTEEN_BIT_DTYPES

ScaleArg = float | torch.Tensor | None


def finite_max(dtype: torch.dtype) -> float:
    """Largest finite value of a cache dtype (448 for e4m3fn, 57344 for e5m2)."""
    return float(torch.finfo(dtype).max)


def normalize_scale(
    scale: ScaleArg, name: str, num_kv_heads: int, device: torch.device, check_values: bool
) -> torch.Tensor:
    """Return ``scale`` as a contiguous float32 ``[num_kv_heads]`` tensor on ``device``.

    Raises TypeError / ValueError naming ``name`` for a wrong type, dtype, length or device, and,
    when ``check_values`` (the values are on the host, or the caller asked), for non-finite or
    non-positive entries.
    """
    if scale is None:
        return torch.ones(num_kv_heads, dtype=torch.float32, device=device)
    if isinstance(scale, bool) or not isinstance(scale, (float, int, torch.Tensor)):
        raise TypeError(
            f"{name} must be None, a float or a float32 tensor, got {type(scale).__name__}"
        )
    if not isinstance(scale, torch.Tensor):
        value = float(scale)
        if not math.isfinite(value) or value <= 0.0:
            raise ValueError(f"{name} must be finite and > 0, got {value}")
        return torch.full((num_kv_heads,), value, dtype=torch.float32, device=device)
    if scale.dtype != torch.float32:
        raise TypeError(f"{name} must have dtype torch.float32, got {scale.dtype}")
    if scale.device != device:
        raise ValueError(f"{name} must be on {device} like query, got {scale.device}")
    if scale.numel() == 1 and scale.dim() <= 1:
        per_head = scale.reshape(1).expand(num_kv_heads)
    elif scale.dim() == 1 and scale.shape[0] == num_kv_heads:
        per_head = scale
    else:
        raise ValueError(
            f"{name} must be a scalar or have shape [num_kv_heads] = [{num_kv_heads}], "
            f"got shape {list(scale.shape)}"
        )
    if check_values:
        bad = ~torch.isfinite(per_head) | (per_head <= 0)
        if bool(bad.any()):
            raise ValueError(
                f"{name} must be finite and > 0 for every KV head, got {per_head.tolist()}"
            )
    return per_head.contiguous()


def compute_kv_scales(
    key: torch.Tensor, value: torch.Tensor, *, fp8_dtype: torch.dtype = torch.float8_e4m3fn
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-KV-head scales that map each head's absolute maximum onto the FP8 format's maximum.

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]``, bf16/fp16/fp32.
        fp8_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
    Returns:
        ``(k_scale, v_scale)``, float32 ``[num_kv_heads]``; a head that is all zeros gets 1.0,
        so a scale is never zero.
    """
    from .validation import check_kv_tokens

    check_kv_tokens(key, value)
    if fp8_dtype not in FP8_DTYPES:
        raise TypeError(f"fp8_dtype must be one of {FP8_DTYPES}, got {fp8_dtype}")
    fmax = finite_max(fp8_dtype)

    def per_head(x: torch.Tensor) -> torch.Tensor:
        amax = x.float().abs().amax(dim=(0, 2))
        return torch.where(amax > 0, amax / fmax, torch.ones_like(amax))

    return per_head(key), per_head(value)


def quantize(x: torch.Tensor, scale: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """Store-side conversion: ``x / scale[head]``, saturated to the format's finite max, RNE.

    Args:
        x: ``[num_tokens, num_kv_heads, head_dim]`` floating.
        scale: float32 ``[num_kv_heads]``.
    Returns:
        ``x`` converted to ``cache_dtype``; NaN stays NaN.
    """
    scaled = x.float() / scale[None, :, None]
    if cache_dtype in FP8_DTYPES:
        fmax = finite_max(cache_dtype)
        scaled = scaled.clamp(-fmax, fmax)
    return scaled.to(cache_dtype)


def dequantize(stored: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Load-side conversion: ``[..., num_kv_heads, head_dim]`` cache rows to float32 real values."""
    return stored.float() * scale[:, None]
