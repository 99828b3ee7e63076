"""Everything about KV-cache scales and FP8 formats, in one place.

A scale is a *dequantisation multiplier*: real K = stored K * k_scale[kv_head]. Users hand us
``None``, a Python float, a 0-d / 1-element tensor or a ``[num_kv_heads]`` tensor; kernels only
ever see the normalised form, a contiguous float32 ``[num_kv_heads]`` tensor, so a per-head scale
can never be dropped or broadcast from element 0 on the way down.

Per-token-head scales (vLLM's ``fp8_per_token_head`` / ``int8_per_token_head``) are float32
``[num_blocks, block_size, num_kv_heads]``, indexed like the cache's first three dims, with any
strides (vLLM keeps them inline in the page): real K = stored K * k_scale[block, slot, kv_head].
The cache write computes them; kernels get the user's tensors themselves, never a copy.
"""

from __future__ import annotations

import functools
import math

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
SIXTEEN_BIT_DTYPES = (torch.bfloat16, torch.float16)
# Caches that take per-KV-head scales.
CACHE_DTYPES = FP8_DTYPES + SIXTEEN_BIT_DTYPES
# Caches whose scale is computed per token and KV head when the token is written (vLLM's
# fp8_per_token_head and int8_per_token_head; e5m2 is the same rule with e5m2's max).
PER_TOKEN_HEAD_DTYPES = FP8_DTYPES + (torch.int8,)
# The floor of a per-token-head scale (vLLM's write clamps amax / max to it), so an all-zero
# row gets a positive scale; a float32 like every scale (float32(1e-6) = 9.99999997e-07).
PER_TOKEN_HEAD_MIN_SCALE = 1e-6
# Every cache dtype a call may bring (int8 with per-token-head scales only).
ALL_CACHE_DTYPES = CACHE_DTYPES + (torch.int8,)

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
    if isinstance(scale, torch.Tensor):
        if scale.dtype != torch.float32:
            raise TypeError(f"{name} must have dtype torch.float32, got {scale.dtype}")
        if scale.device != device:
            raise ValueError(f"{name} must be on {device} like query, got {scale.device}")
        if scale.dim() == 1 and scale.shape[0] == num_kv_heads:
            per_head = scale
        elif scale.numel() == 1 and scale.dim() <= 1:
            per_head = scale.reshape(1).expand(num_kv_heads)
        else:
            raise ValueError(
                f"{name} must be a scalar or have shape [num_kv_heads] = [{num_kv_heads}], "
                f"got shape {list(scale.shape)}"
            )
    elif scale is None:
        return torch.ones(num_kv_heads, dtype=torch.float32, device=device)
    elif isinstance(scale, bool) or not isinstance(scale, (float, int)):
        raise TypeError(
            f"{name} must be None, a float or a float32 tensor, got {type(scale).__name__}"
        )
    else:
        value = check_host_float(scale, name)
        return torch.full((num_kv_heads,), value, dtype=torch.float32, device=device)
    if check_values:
        # A list: one host read, then Python, cheaper than a chain of small tensor ops.
        values = per_head.tolist()
        # NaN and inf make the sum non-finite; float32 values cannot overflow a float64 sum.
        if not (math.isfinite(sum(values)) and min(values) > 0):
            raise ValueError(f"{name} must be finite and > 0 for every KV head, got {values}")
    return per_head.contiguous()


def is_per_token_head(scale: ScaleArg) -> bool:
    """Whether ``scale`` is meant per token and head (a rank-3 tensor)."""
    return isinstance(scale, torch.Tensor) and scale.dim() == 3


def _describe(scale: ScaleArg) -> str:
    if isinstance(scale, torch.Tensor):
        return f"a tensor of shape {list(scale.shape)}"
    return "None" if scale is None else f"a {type(scale).__name__}"


def check_per_token_head_scales(
    k_scale: ScaleArg, v_scale: ScaleArg, key_cache: torch.Tensor, device: torch.device
) -> None:
    """Check per-token-head scales against ``key_cache`` (no value is read, no copy is made).

    Both must be float32 tensors on ``device`` of shape ``key_cache.shape[:3]`` =
    ``[num_blocks, block_size, num_kv_heads]``, any strides, and the cache's dtype one of
    :data:`PER_TOKEN_HEAD_DTYPES`. Raises TypeError / ValueError naming the argument: a scale of
    the wrong kind (one per token and head, the other not; an int8 cache with per-head scales),
    shape, dtype or device, or a 16-bit cache given per-token-head scales.
    """
    expected = list(key_cache.shape[:3])
    layout = f"[num_blocks, block_size, num_kv_heads] = {expected}"
    if key_cache.dtype not in PER_TOKEN_HEAD_DTYPES:
        raise TypeError(
            f"per-token-head k_scale/v_scale ({layout}) need a key_cache of dtype in "
            f"{list(PER_TOKEN_HEAD_DTYPES)}, got {key_cache.dtype}"
        )
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not is_per_token_head(scale):
            why = (
                "an int8 cache has per-token-head scales only"
                if key_cache.dtype == torch.int8
                else "both scales must be of one kind"
            )
            raise ValueError(
                f"{name} must be a float32 tensor per token and head, {layout} ({why}), "
                f"got {_describe(scale)}"
            )
        if scale.dtype != torch.float32:
            raise TypeError(f"{name} must have dtype torch.float32, got {scale.dtype}")
        if scale.device != device:
            raise ValueError(f"{name} must be on {device} like query, got {scale.device}")
        if list(scale.shape) != expected:
            raise ValueError(
                f"{name} per token and head must have the key_cache's first dims {layout}, "
                f"got {list(scale.shape)}"
            )


def scale_mode_of(k_scale: ScaleArg, v_scale: ScaleArg, cache_dtype: torch.dtype) -> str:
    """The scale kind a call's scales mean (a key of ``launch_record.SCALE_MODES``):
    ``"per_token_head"`` when either scale has rank 3 or the cache is int8 (which has no
    other), else ``"per_head"``. :func:`normalize_scales` checks that both are of it."""
    if cache_dtype == torch.int8 or is_per_token_head(k_scale) or is_per_token_head(v_scale):
        return "per_token_head"
    return "per_head"


def normalize_scales(
    k_scale: ScaleArg,
    v_scale: ScaleArg,
    key_cache: torch.Tensor,
    device: torch.device,
    check_values: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Both scales in the kernels' form: per-token-head tensors (either scale of rank 3, or an
    int8 cache) checked by :func:`check_per_token_head_scales` and returned as they are; else
    each through :func:`normalize_scale`."""
    if scale_mode_of(k_scale, v_scale, key_cache.dtype) == "per_token_head":
        check_per_token_head_scales(k_scale, v_scale, key_cache, device)
        return k_scale, v_scale  # type: ignore[return-value]
    num_kv_heads = key_cache.shape[2]
    return (
        normalize_scale(k_scale, "k_scale", num_kv_heads, device, check_values),
        normalize_scale(v_scale, "v_scale", num_kv_heads, device, check_values),
    )


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
    in float32, and multiply it by ``q . k_stored``: see :func:`check_score_range`. A tensor
    ``k_scale`` is read only when ``check_values`` (its values are on the host, or the caller
    asked for the sync).
    """
    if isinstance(k_scale, torch.Tensor):
        if not check_values:
            return
        per_head = k_scale_t.tolist()  # float32 values, exact as Python floats
        low, high = min(per_head), max(per_head)
    else:
        low = high = 1.0 if k_scale is None else float(k_scale)
    check_score_range(softmax_scale, low, high, cache_dtype)


def check_score_range(
    softmax_scale: float, low: float, high: float, cache_dtype: torch.dtype
) -> None:
    """Refuse, by name, k_scale values in ``[low, high]`` whose score products leave float32.

    Refused: ``softmax_scale * low * log2(e)`` below float32's normal range (an underflow to 0
    gives a uniform softmax), or ``softmax_scale * high * log2(e)`` times the largest key the
    cache format can hold (a unit query against that key) overflowing float32, which would give
    inf scores and NaN.
    """
    largest = largest_stored(cache_dtype)
    if softmax_scale * high * LOG2E * largest > FLOAT32_MAX:
        raise ValueError(
            f"softmax_scale * k_scale * log2(e) * {largest:.6g} (the largest {cache_dtype} key) "
            f"must fit in float32 (<= {FLOAT32_MAX:.4g}): softmax_scale = {softmax_scale:.4g} "
            f"with k_scale = {high:.4g} gives {softmax_scale * high * LOG2E * largest:.4g}"
        )
    if softmax_scale * low * LOG2E < FLOAT32_TINY:
        raise ValueError(
            f"softmax_scale * k_scale * log2(e) must be >= {FLOAT32_TINY:.4g} (float32's "
            f"smallest normal): softmax_scale = {softmax_scale:.4g} with k_scale = {low:.4g} "
            f"gives {softmax_scale * low * LOG2E:.4g}"
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


def per_token_head_range(cache_dtype: torch.dtype) -> tuple[float, float]:
    """(lowest, highest) value a per-token-head write stores: (-128, 127) for int8, +-the
    finite max for FP8 (the bounds vLLM's write clamps to)."""
    if cache_dtype == torch.int8:
        return -128.0, 127.0
    fmax = finite_max(cache_dtype)
    return -fmax, fmax


@functools.cache  # asked on every call that checks its score scale
def largest_stored(cache_dtype: torch.dtype) -> float:
    """The largest magnitude a cache element holds: 128 for int8 (its lowest code), else the
    format's finite max."""
    return -per_token_head_range(cache_dtype)[0]


def quantize_per_token_head(
    x: torch.Tensor, cache_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Store-side conversion with one scale per row, bit for bit vLLM's per-token-head write
    (``_reshape_cache_per_token_head`` in ``vllm/v1/attention/ops/
    triton_reshape_and_cache_flash.py``, vLLM 0.32 and 0.33), every step a float32 operation
    rounded to nearest even:

    - ``scale = max(amax(|x|) / high, 1e-6)``, the amax over the row's ``head_dim`` values and
      ``high`` = 127 (int8) or the FP8 finite max (448 e4m3, 57344 e5m2);
    - ``y = x * (1 / scale)`` (a reciprocal, then a product: not ``x / scale``);
    - int8: ``y + 0.5`` for ``y >= 0``, else ``y - 0.5``, clamped to [-128, 127] and truncated
      toward zero (round half away from zero, as the float32 sums round); FP8: ``y`` clamped to
      +-max and rounded to nearest even.

    A row holding NaN gets a NaN scale (so it reads back as NaN; int8 stores 0 where ``y`` is
    NaN, FP8 stores NaN): vLLM leaves that case to the hardware's max.

    Args:
        x: ``[..., head_dim]`` floating (bf16/fp16 K or V rows).
        cache_dtype: one of :data:`PER_TOKEN_HEAD_DTYPES`.
    Returns:
        ``(stored, scale)``: ``stored`` ``[..., head_dim]`` in ``cache_dtype`` and ``scale``
        float32 ``[...]``, the dequantisation multiplier (real x ~= stored * scale).
    """
    low, high = per_token_head_range(cache_dtype)
    x = x.float()
    scale = (x.abs().amax(dim=-1) / high).clamp_min(PER_TOKEN_HEAD_MIN_SCALE)
    scaled = x * torch.reciprocal(scale)[..., None]
    if cache_dtype == torch.int8:
        scaled = torch.where(scaled >= 0, scaled + 0.5, scaled - 0.5).clamp(low, high)
        # Float -> int truncates toward zero; NaN has no int8 code (the NaN scale carries it).
        return torch.where(scaled.isnan(), 0.0, scaled).to(torch.int8), scale
    return scaled.clamp(low, high).to(cache_dtype), scale


def dequantize(stored: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Load-side conversion of cache rows ``[..., num_kv_heads, head_dim]`` to float32 real
    values: ``scale`` is float32 ``[num_kv_heads]`` (per head) or ``[..., num_kv_heads]``, one
    per row (per token and head); int8 converts exactly."""
    return stored.float() * scale[..., None]
