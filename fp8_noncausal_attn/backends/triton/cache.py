"""Triton ``reshape_and_cache``: quantise new K/V rows into the paged caches.

The conversion to the cache format is done with integer arithmetic on the fp32 bit pattern
(saturate to the finite max, round to nearest even, subnormals included) rather than a float
cast, so the GPU and Triton's CPU interpreter (whose fp32->fp8 and fp32->bf16 casts round
wrongly) give the same bytes as ``scales.quantize``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...problem import CacheWrite
from ...scales import PER_TOKEN_HEAD_MIN_SCALE, finite_max, per_token_head_range

# Cache format codes shared by the kernel and its launcher (int8: per-token-head scales only).
_FORMATS = {
    torch.float8_e4m3fn: 0, torch.float8_e5m2: 1, torch.bfloat16: 2, torch.float16: 3,
    torch.int8: 4,
}  # fmt: skip
_STORAGE = {0: torch.uint8, 1: torch.uint8, 2: torch.int16, 3: torch.float16, 4: torch.int8}
_INT8 = 4


@triton.jit
def _encode_fp8(x, MANT: tl.constexpr, BIAS: tl.constexpr, FMAX: tl.constexpr):
    """fp32 -> FP8 byte (sign, BIAS-biased exponent, MANT mantissa bits), saturating, RNE."""
    is_nan = x != x
    x = tl.minimum(tl.maximum(x, -FMAX), FMAX)
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    magnitude = tl.abs(x)
    # Below the smallest normal the format is fixed-point with step 2^(1 - BIAS - MANT): adding
    # and removing 2^23 rounds that fixed-point value to the nearest even integer in fp32.
    fixed = magnitude * (2.0 ** (BIAS + MANT - 1))
    subnormal = ((fixed + 8388608.0) - 8388608.0).to(tl.int32)
    shift: tl.constexpr = 23 - MANT
    mag_bits = magnitude.to(tl.int32, bitcast=True)
    rounded = mag_bits + ((1 << (shift - 1)) - 1) + ((mag_bits >> shift) & 1)
    exponent = (rounded >> 23) - 127 + BIAS
    normal = (exponent << MANT) | ((rounded >> shift) & ((1 << MANT) - 1))
    code = tl.where(magnitude < 2.0 ** (1 - BIAS), subnormal, normal) | sign
    return tl.where(is_nan, 0x7F, code).to(tl.uint8)


@triton.jit
def _encode_bf16(x):
    """fp32 -> bf16 bit pattern (as int16), round to nearest even; NaN stays NaN."""
    bits = x.to(tl.int32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return tl.where(x != x, (bits >> 16) | 0x40, rounded).to(tl.int16)


@triton.jit
def _saturate(x, FMAX: tl.constexpr):
    """Clamp to the format's finite max (SPEC §4: never inf from a finite input), NaN kept.

    Clamping before rounding gives what rounding would for every value below the overflow
    threshold; NaN is kept apart because min/max would turn it into FMAX on a GPU.
    """
    return tl.where(x != x, x, tl.minimum(tl.maximum(x, -FMAX), FMAX))


@triton.jit
def _encode(x, FORMAT: tl.constexpr, FMAX: tl.constexpr):
    if FORMAT == 0:
        return _encode_fp8(x, 3, 7, FMAX)
    elif FORMAT == 1:
        return _encode_fp8(x, 2, 15, FMAX)
    elif FORMAT == 2:
        return _encode_bf16(_saturate(x, FMAX))
    else:
        return _saturate(x, FMAX).to(tl.float16)


@triton.jit
def _quantize_per_token_head(x, FORMAT: tl.constexpr, FMAX: tl.constexpr,
                             MIN_SCALE: tl.constexpr):  # fmt: skip
    """One row's (codes, scale) as ``scales.quantize_per_token_head`` computes them.

    Both divisions are ``div_rn``: Triton's ``/`` is the approximate ``div.full.f32`` on a GPU
    (what vLLM's write runs there), which would part from the reference in the last bit.
    """
    is_nan = tl.max((x != x).to(tl.int32), axis=0) > 0
    scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), axis=0), FMAX), MIN_SCALE)
    scale = tl.where(is_nan, float("nan"), scale)
    y = x * tl.math.div_rn(tl.full([], 1.0, tl.float32), scale)
    if FORMAT == 4:  # int8, range [-128, 127]: round half away from zero, then truncate.
        # NaN is tested before the clamp: a GPU's min / max return the other operand.
        is_nan_code = y != y
        y = tl.where(y >= 0, y + 0.5, y - 0.5)
        y = tl.minimum(tl.maximum(y, -FMAX - 1.0), FMAX)
        codes = tl.where(is_nan_code, 0.0, y).to(tl.int8)
    else:
        codes = _encode(y, FORMAT, FMAX)
    return codes, scale


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
    k_scale_ptr, v_scale_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch,
    stride_vcb, stride_vcs, stride_vch,
    stride_ksb, stride_kss, stride_ksh,
    stride_vsb, stride_vss, stride_vsh,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    FORMAT: tl.constexpr,
    FMAX: tl.constexpr,
    PER_TOKEN_HEAD: tl.constexpr,
    MIN_SCALE: tl.constexpr,
):  # fmt: skip
    # int64 offsets: tokens x the token stride passes 2^31 elements in a long prefill.
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    dims = tl.arange(0, HEAD_DIM)
    k = tl.load(key_ptr + token * stride_kt + head * stride_kh + dims).to(tl.float32)
    v = tl.load(value_ptr + token * stride_vt + head * stride_vh + dims).to(tl.float32)
    # A per-head scale is addressed with block and slot strides 0.
    k_scale_at = k_scale_ptr + block * stride_ksb + offset * stride_kss + head * stride_ksh
    v_scale_at = v_scale_ptr + block * stride_vsb + offset * stride_vss + head * stride_vsh
    if PER_TOKEN_HEAD:
        k_codes, k_scale = _quantize_per_token_head(k, FORMAT, FMAX, MIN_SCALE)
        v_codes, v_scale = _quantize_per_token_head(v, FORMAT, FMAX, MIN_SCALE)
        tl.store(k_scale_at, k_scale)
        tl.store(v_scale_at, v_scale)
    else:
        k_codes = _encode(tl.math.div_rn(k, tl.load(k_scale_at)), FORMAT, FMAX)
        v_codes = _encode(tl.math.div_rn(v, tl.load(v_scale_at)), FORMAT, FMAX)
    k_dst = key_cache_ptr + block * stride_kcb + offset * stride_kcs + head * stride_kch
    v_dst = value_cache_ptr + block * stride_vcb + offset * stride_vcs + head * stride_vch
    tl.store(k_dst + dims, k_codes)
    tl.store(v_dst + dims, v_codes)


def _scale_strides(scale: torch.Tensor) -> tuple[int, int, int]:
    """(block, slot, head) strides of a per-token-head scale, or (0, 0, 1) for per-head."""
    return scale.stride() if scale.dim() == 3 else (0, 0, scale.stride(0))


def reshape_and_cache(write: CacheWrite) -> None:
    """Same contract as ``reference.reshape_and_cache``: per-head scales (rank 1), or scales per
    token and head (rank 3, any strides) that this write computes and stores."""
    key, value, key_cache, value_cache = write.key, write.value, write.key_cache, write.value_cache
    slot_mapping, k_scale, v_scale = write.slot_mapping, write.k_scale, write.v_scale
    fmt = _FORMATS[key_cache.dtype]
    kc = key_cache.view(_STORAGE[fmt])
    vc = value_cache.view(_STORAGE[fmt])
    per_token_head = k_scale.dim() == 3
    high = per_token_head_range(key_cache.dtype)[1] if fmt == _INT8 else finite_max(key_cache.dtype)
    num_tokens, num_kv_heads, head_dim = key.shape
    _reshape_and_cache_kernel[(num_tokens, num_kv_heads)](
        key, value, kc, vc, slot_mapping, k_scale, v_scale,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2),
        vc.stride(0), vc.stride(1), vc.stride(2),
        *_scale_strides(k_scale), *_scale_strides(v_scale),
        BLOCK_SIZE=key_cache.shape[1],
        HEAD_DIM=head_dim,
        FORMAT=fmt,
        FMAX=high,
        PER_TOKEN_HEAD=per_token_head,
        MIN_SCALE=PER_TOKEN_HEAD_MIN_SCALE,
        # Each product and sum rounded on its own, as the reference computes them: no FMA.
        enable_fp_fusion=False,
    )  # fmt: skip
