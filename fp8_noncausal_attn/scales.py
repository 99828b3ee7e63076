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

# Scales reach the kernels as float32; scores are scaled by softmax_scale * k_scale * log2(e)
# (exp2-based softmax), also a float32.
LOG2E = math.log2(math.e)
FLOAT32_MAX = float(torch.finfo(torch.float32).max)
FLOAT32_TINY = float(torch.finfo(torch.float32).tiny)  # smallest normal


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
        value = check_host_float(scale, name)
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
        # A list: one host read, then Python, cheaper than a chain of small tensor ops.
        values = per_head.tolist()
        # NaN and inf make the sum non-finite; float32 values cannot overflow a float64 sum.
        if not (math.isfinite(sum(values)) and min(values) > 0):
            raise ValueError(f"{name} must be finite and > 0 for every KV head, got {values}")
    return per_head.contiguous()


def check_host_float(value: float, name: str) -> float:
    """A host scalar the kernels take as float32: finite, > 0, a normal float32 (ValueError)."""
    value = float(value)
    if not math.isfinite(value) or value <= 0.0:
        raise ValueError(f"{name} must be finite and > 0, got {value}")
    if not FLOAT32_TINY <= value <= FLOAT32_MAX:
        raise ValueError(
            f"{name} must be representable in float32, in [{FLOAT32_TINY:.4g}, "
            f"{FLOAT32_MAX:.4g}], got {value:.4g}"
        )
    return value


def check_score_scale(
    softmax_scale: float,
    k_scale: ScaleArg,
    k_scale_t: torch.Tensor,
    cache_dtype: torch.dtype,
    check_values: bool,
) -> None:
    """Refuse, by name, a score scale whose float32 products overflow or underflow.

    The kernels fold k_scale into the softmax scale, ``softmax_scale * k_scale[h] * log2(e)``,
    in float32, and multiply it by ``q . k_stored``. Refused: that product outside float32's
    normal range (an underflow to 0 gives a uniform softmax), or its product with the largest key
    the cache format can hold (a unit query against that key) overflowing float32, which would
    give inf scores and NaN. A tensor ``k_scale`` is read only when ``check_values`` (its values
    are on the host, or the caller asked for the sync).
    """
    if isinstance(k_scale, torch.Tensor):
        if not check_values:
            return
        per_head = k_scale_t.tolist()  # float32 values, exact as Python floats
        low, high = min(per_head), max(per_head)
    else:
        low = high = 1.0 if k_scale is None else float(k_scale)
    fmax = finite_max(cache_dtype)
    if softmax_scale * high * LOG2E * fmax > FLOAT32_MAX:
        what = f"softmax_scale = {softmax_scale:.4g} with k_scale = "
        raise ValueError(
            f"softmax_scale * k_scale * log2(e) * {fmax:.6g} (the largest {cache_dtype} key) "
            f"must fit in float32 (<= {FLOAT32_MAX:.4g}): {what}{high:.4g} gives "
            f"{softmax_scale * high * LOG2E * fmax:.4g}"
        )
    if softmax_scale * low * LOG2E < FLOAT32_TINY:
        what = f"softmax_scale = {softmax_scale:.4g} with k_scale = "
        raise ValueError(
            f"softmax_scale * k_scale * log2(e) must be >= {FLOAT32_TINY:.4g} (float32's "
            f"smallest normal): {what}{low:.4g} gives {softmax_scale * low * LOG2E:.4g}"
        )


def quantize(x: torch.Tensor, scale: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """Store-side conversion: ``x / scale[head]``, saturated to the format's finite max, RNE
    (16-bit formats too).

    Args:
        x: ``[num_tokens, num_kv_heads, head_dim]`` floating.
        scale: float32 ``[num_kv_heads]``.
    Returns:
        ``x`` converted to ``cache_dtype``; NaN stays NaN.
    """
    scaled = x.float() / scale[None, :, None]
    # Every format saturates, 16-bit ones too: a finite input never becomes inf (clamp keeps NaN).
    fmax = finite_max(cache_dtype)
    return scaled.clamp(-fmax, fmax).to(cache_dtype)


def dequantize(stored: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Load-side conversion: ``[..., num_kv_heads, head_dim]`` cache rows to float32 real values."""
    return stored.float() * scale[:, None]
