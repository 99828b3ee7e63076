// Compile-time configuration of one mma.sync kernel (head dim, query dtype, cache dtype) and the
// register-level primitives it is built from: the m16n8k16 MMA, exact FP8 -> operand
// conversions and packing.
#pragma once

#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cute/arch/mma_sm80.hpp>

#include "../common/params.h"
#include "fp8_bits.h"
#include "index_maps.h"

namespace fp8nca::mma_sync {

template <int D, typename QT, int KV, int BM = kBlockM>
struct Traits {
  static constexpr bool kFp8 = KV == kE4M3 || KV == kE5M2;
  static constexpr TileShape kS = tile_shape(D, kFp8 ? 1 : 2, BM);  // tiles as copied
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

__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1, __nv_bfloat16) {
  cute::SM80_16x8x16_F32BF16BF16F32_TN::fma(c[0], c[1], c[2], c[3], a[0], a[1], a[2], a[3], b0,
                                            b1, c[0], c[1], c[2], c[3]);
}

__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1, __half) {
  cute::SM80_16x8x16_F32F16F16F32_TN::fma(c[0], c[1], c[2], c[3], a[0], a[1], a[2], a[3], b0,
                                          b1, c[0], c[1], c[2], c[3]);
}

// Two FP8 values (low byte first) -> two values of the operand dtype, exactly: the hardware
// conversion to f16x2 (sm_89+) is exact for e4m3 and e5m2, and every such value is a bf16 too
// (done once per CTA and tile, in dequantize_tile).
template <int KV, typename QT>
__device__ __forceinline__ uint32_t fp8x2_to(uint32_t x16) {
  uint32_t h2;
  const uint16_t x = static_cast<uint16_t>(x16);
  if constexpr (KV == kE4M3) {
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(x));
  } else {
    asm("cvt.rn.f16x2.e5m2x2 %0, %1;" : "=r"(h2) : "h"(x));
  }
  if constexpr (std::is_same_v<QT, __half>) {
    return h2;
  } else {
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h2));
    const __nv_bfloat162 b = __float22bfloat162_rn(f);
    return *reinterpret_cast<const uint32_t*>(&b);
  }
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

// The dtype code (common/params.h) of a 16-bit query type.
template <typename QT>
constexpr int kQDtype = std::is_same_v<QT, __nv_bfloat16> ? kBF16 : kFP16;

// x * 2^(127 - bias) on a bf16 pair (fp8_bits.h), exact for the scaled words: the product is an
// FP8 value, representable; bf16 FMA keeps subnormal inputs; adding -0 keeps the sign of zero.
template <int KV>
__device__ __forceinline__ uint32_t bf16x2_unscale(uint32_t x) {
  uint32_t y;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;"
      : "=r"(y)
      : "r"(x), "r"(fp8_to_bf16_scale(KV)), "r"(0x80008000u));
  return y;
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

}  // namespace fp8nca::mma_sync
