// Compile-time configuration of one mma.sync kernel (head dim, query dtype, cache dtype) and the
// register-level primitives it is built from: the m16n8k16 MMA, exact FP8 / int8 -> operand
// conversions and packing.
#pragma once

#include <cstdint>
#include <type_traits>

#include "../common/device.cuh"
#include "../common/params.h"
#include "fp8_bits.h"
#include "index_maps.h"

namespace fp8nca::mma_sync {

template <int D, typename QT, int KV, int BM = kBlockM>
struct Traits {
  static constexpr bool kFp8 = KV == kE4M3 || KV == kE5M2;
  // 1-byte caches (FP8, or int8 with per-token-head scales) are dequantised to 16 bits per tile.
  static constexpr bool kNarrow = kFp8 || KV == kI8;
  static constexpr TileShape kS = tile_shape(D, kNarrow ? 1 : 2, BM);  // tiles as copied
  static constexpr TileShape kC = compute_shape(D, BM);              // tiles the MMAs read
  static constexpr int kThreads = kS.threads;
  // CTAs per SM the register allocation must allow (several in flight hide HBM latency): shared
  // memory admits 3 or more of the d64 kernels on sm_90 / sm_100 but at most 2 of the d128 /
  // d256 ones, so those get up to 255 registers (ptxas spills some at 168 on sm_89). The
  // 128-row tile (8 warps) asks for one: its warps are as many as two 64-row CTAs'.
  static constexpr int kMinBlocks = BM > kBlockM ? 1 : D == 64 ? 3 : 2;
  static_assert(D % (4 * kS.e) == 0, "head_dim must be a multiple of 4 units");
  static_assert(kS.block_n % 16 == 0, "key tile must hold whole mma k-steps");
  static_assert(kS.block_n * kS.units % kThreads == 0, "tile copy must split evenly");
  static_assert(kThreads % kS.units == 0, "a thread's copy slots must share one unit");
};

// Operand type of O += P V. fp16 wherever V is exact in it (FP8 and fp16 caches): P in [0, 1]
// keeps 3 more mantissa bits than in bf16, and FP8 -> fp16 is one instruction where FP8 -> bf16
// takes four. A bf16 cache stays bf16 under a bf16 query (no conversion at all).
template <typename QT, int KV>
using PVType = std::conditional_t<KV == kBF16 && std::is_same_v<QT, __nv_bfloat16>,
                                  __nv_bfloat16, __half>;

// ... and with per-token-head scales (kTokenScales), the query dtype: the value tile then holds
// each value times its own scale (dequantize_tile), rounded once, as a 16-bit cache of the
// query's dtype would hold it, so the P V product is that cache's; values written from the
// query's dtype stay in its range (fp16 could not hold a bf16 model's).
template <typename QT, int KV, bool kTokenScales>
using PVOperand = std::conditional_t<kTokenScales, QT, PVType<QT, KV>>;

__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1, __nv_bfloat16) {
  hw::mma_m16n8k16(c, a, b0, b1, __nv_bfloat16());
}

__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1, __half) {
  hw::mma_m16n8k16(c, a, b0, b1, __half());
}

// An fp16 pair -> the same values in QT, exactly for values that are bf16 too (FP8 and int8
// values are).
template <typename QT>
__device__ __forceinline__ uint32_t f16x2_to(uint32_t h2) {
  if constexpr (std::is_same_v<QT, __half>) {
    return h2;
  } else {
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h2));
    const __nv_bfloat162 b = __float22bfloat162_rn(f);
    return *reinterpret_cast<const uint32_t*>(&b);
  }
}

// Two FP8 values (low byte first) -> two values of the operand dtype, exactly: the hardware
// conversion to f16x2 (sm_89+) is exact for e4m3 and e5m2, and every such value is a bf16 too
// (done once per CTA and tile, in dequantize_tile).
template <int KV, typename QT>
__device__ __forceinline__ uint32_t fp8x2_to(uint32_t x16) {
  const uint16_t x = static_cast<uint16_t>(x16);
  return f16x2_to<QT>(KV == kE4M3 ? hw::cvt_f16x2_e4m3x2(x) : hw::cvt_f16x2_e5m2x2(x));
}

// Four FP8 values (low byte first) -> the pairs (0, 1), (2, 3) of the operand dtype, exactly:
// e5m2 into fp16 by byte moves (fp8_bits.h), otherwise fp8x2_to.
template <int KV, typename QT>
__device__ __forceinline__ void fp8x4_to(uint32_t w, uint32_t& lo, uint32_t& hi) {
  if constexpr (KV == kE5M2 && std::is_same_v<QT, __half>) {
    lo = e5m2x4_low_to_f16x2(w);
    hi = e5m2x4_high_to_f16x2(w);
  } else {
    lo = fp8x2_to<KV, QT>(w & 0xffffu);
    hi = fp8x2_to<KV, QT>(w >> 16);
  }
}

// Four int8 values (low byte first) -> the fp16 pairs (0, 1), (2, 3), exactly: byte moves
// (fp8_bits.h) and one fp16 subtraction per pair, no conversion instruction.
__device__ __forceinline__ void int8x4_to_f16x2(uint32_t w, uint32_t& lo, uint32_t& hi) {
  const __half2 bias = __float2half2_rn(kInt8F16Bias);
  const uint32_t lo_biased = int8x4_low_to_biased_f16x2(w);
  const uint32_t hi_biased = int8x4_high_to_biased_f16x2(w);
  const __half2 l = __hsub2(*reinterpret_cast<const __half2*>(&lo_biased), bias);
  const __half2 h = __hsub2(*reinterpret_cast<const __half2*>(&hi_biased), bias);
  lo = *reinterpret_cast<const uint32_t*>(&l);
  hi = *reinterpret_cast<const uint32_t*>(&h);
}

// Four values of a 1-byte cache (e4m3, e5m2 or int8; low byte first) -> the fp16 pairs (0, 1),
// (2, 3), exactly: each such value is an fp16.
template <int KV>
__device__ __forceinline__ void narrow_x4_to_f16x2(uint32_t w, uint32_t& lo, uint32_t& hi) {
  if constexpr (KV == kI8) {
    int8x4_to_f16x2(w, lo, hi);
  } else {
    fp8x4_to<KV, __half>(w, lo, hi);
  }
}

// The dtype code (common/params.h) of a 16-bit query type.
template <typename QT>
constexpr int kQDtype = std::is_same_v<QT, __nv_bfloat16> ? kBF16 : kFP16;

// x * 2^(127 - bias) on a bf16 pair (fp8_bits.h), exact for the scaled words: the product is an
// FP8 value, representable; bf16 FMA keeps subnormal inputs; adding -0 keeps the sign of zero.
template <int KV>
__device__ __forceinline__ uint32_t bf16x2_unscale(uint32_t x) {
  return hw::fma_rn_bf16x2(x, fp8_to_bf16_scale(KV), 0x80008000u);
}

template <typename QT>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (std::is_same_v<QT, __half>) {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&h);
  } else {
    const __nv_bfloat162 b = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&b);
  }
}

// An fp16 pair (exact cache values) times `scale` in fp32, rounded once to QT.
template <typename QT>
__device__ __forceinline__ uint32_t scaled_f16x2_to(uint32_t h2, float scale) {
  const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h2));
  return pack2<QT>(f.x * scale, f.y * scale);
}

}  // namespace fp8nca::mma_sync
