// Exact FP8 -> bf16 by bit moves (no conversion instruction), for the K tile of an FP8 cache
// under a bf16 query: the hardware path (FP8 -> f16x2, two f16 -> f32, f32x2 -> bf16x2) issues
// two conversion-pipe instructions per pair, the slowest pipe on sm_90 / sm_100 (16 results per
// clock per SM). Also int8 -> fp16 by byte moves (per-token-head caches). FP8NCA_HD functions:
// the kernels call them and so does the host test (tests/test_cuda_kernel_emulation.py, through
// tests/ext/host_hooks.cpp), which checks every byte.
#pragma once

#include <cstdint>

#include "../common/host_device.h"
#include "../common/params.h"

namespace fp8nca::mma_sync {

// Whether the kernel dequantises K by bit moves (and stores it in bf16_k_dim order) for this
// query and cache dtype.
FP8NCA_HD constexpr bool bit_dequant_k(int q_dtype, int cache_dtype) {
  return q_dtype == kBF16 && (cache_dtype == kE4M3 || cache_dtype == kE5M2);
}

// Right shift that moves an FP8 byte's exponent and mantissa bits (below its sign) to the low
// exponent bits and top mantissa bits of a bf16 whose sign is the byte's sign.
FP8NCA_HD constexpr int fp8_to_bf16_shift(int cache_dtype) { return cache_dtype == kE4M3 ? 4 : 3; }

// The FP8 bytes in the high byte of each 16-bit half of q, as bf16x2 bits of the value times
// 2^-(127 - bias) (e4m3: bias 7, 2^-120; e5m2: bias 15, 2^-112): an FP8 subnormal becomes a bf16
// subnormal of the same scaled value, so one multiply by 2^(127 - bias) (fp8_to_bf16_scale)
// restores the FP8 value exactly. Inf and NaN bytes come out finite: callers test
// fp8x4_special_bits first.
FP8NCA_HD constexpr uint32_t fp8_high_bytes_to_bf16x2_scaled(uint32_t q, int cache_dtype) {
  return (q & 0x80008000u) | ((q & 0x7f007f00u) >> fp8_to_bf16_shift(cache_dtype));
}

// The four FP8 bytes b0..b3 (low first) of w as two scaled bf16x2 words: even = (b0, b2),
// odd = (b1, b3). Stored even then odd, head dims 4m + {0, 2, 1, 3} land at positions
// 4m + {0, 1, 2, 3} of the 16-bit row (bf16_k_dim).
FP8NCA_HD constexpr uint32_t fp8x4_even_to_bf16x2_scaled(uint32_t w, int cache_dtype) {
  return fp8_high_bytes_to_bf16x2_scaled(w << 8, cache_dtype);
}
FP8NCA_HD constexpr uint32_t fp8x4_odd_to_bf16x2_scaled(uint32_t w, int cache_dtype) {
  return fp8_high_bytes_to_bf16x2_scaled(w, cache_dtype);
}

// 2^(127 - bias) as a bf16 pair (exponent field 247 for e4m3, 239 for e5m2): the multiplier of
// the scaled words.
FP8NCA_HD constexpr uint32_t fp8_to_bf16_scale(int cache_dtype) {
  return cache_dtype == kE4M3 ? 0x7b807b80u : 0x77807780u;
}

// Nonzero when a byte of w is special: an e4m3 NaN (magnitude 0x7f), an e5m2 Inf or NaN
// (magnitude >= 0x7c). Adding the distance to 0x80 to each 7-bit magnitude carries into bit 7
// exactly for those, never into the next byte.
FP8NCA_HD constexpr uint32_t fp8x4_special_bits(uint32_t w, int cache_dtype) {
  return ((w & 0x7f7f7f7fu) + (cache_dtype == kE4M3 ? 0x01010101u : 0x04040404u)) & 0x80808080u;
}

// e5m2 is the high byte of an IEEE fp16 (1 sign, 5 exponent, 2 mantissa bits, the same bias):
// the four e5m2 bytes b0..b3 of w -> the fp16 pairs (b0, b1) and (b2, b3), exactly, subnormals,
// Inf and NaN included. One byte permute per pair instead of a conversion-pipe
// cvt.rn.f16x2.e5m2x2.
FP8NCA_HD constexpr uint32_t e5m2x4_low_to_f16x2(uint32_t w) {
#if defined(__CUDA_ARCH__)
  return __byte_perm(w, 0, 0x1404);  // bytes (b1, 0, b0, 0)
#else
  return ((w & 0xffu) << 8) | ((w & 0xff00u) << 16);
#endif
}
FP8NCA_HD constexpr uint32_t e5m2x4_high_to_f16x2(uint32_t w) {
#if defined(__CUDA_ARCH__)
  return __byte_perm(w, 0, 0x3424);  // bytes (b3, 0, b2, 0)
#else
  return ((w >> 8) & 0xff00u) | (w & 0xff000000u);
#endif
}

// int8 (per-token-head caches) -> fp16 by byte moves: the four int8 bytes b0..b3 of w, each
// biased to b + 128 (flipping its top bit), under the fp16 exponent of 1024, whose unit in the
// last place is 1: the fp16 pairs (1024 + b0 + 128, 1024 + b1 + 128), (.. b2 .., .. b3 ..),
// exactly. Less kInt8F16Bias (an fp16 subtraction, exact: the difference is an integer of at
// most 8 bits) they are b0..b3.
constexpr float kInt8F16Bias = 1152.f;  // 1024 + 128
FP8NCA_HD constexpr uint32_t int8x4_low_to_biased_f16x2(uint32_t w) {
#if defined(__CUDA_ARCH__)
  return __byte_perm(w ^ 0x80808080u, 0x64646464u, 0x4140);  // bytes (0x64, b1, 0x64, b0)
#else
  return ((w ^ 0x80u) & 0xffu) | 0x6400u | ((((w >> 8) ^ 0x80u) & 0xffu) << 16) | 0x64000000u;
#endif
}
FP8NCA_HD constexpr uint32_t int8x4_high_to_biased_f16x2(uint32_t w) {
#if defined(__CUDA_ARCH__)
  return __byte_perm(w ^ 0x80808080u, 0x64646464u, 0x4342);  // bytes (0x64, b3, 0x64, b2)
#else
  return int8x4_low_to_biased_f16x2(w >> 16);
#endif
}

// Head dim at position p of a row of the bit-dequantised bf16 K tile, and so of the Q
// fragments that meet it in S = Q K^T (a permutation inside each group of 4 adjacent dims:
// the reduction is unchanged).
FP8NCA_HD constexpr int bf16_k_dim(int p) { return (p & ~3) | ((p & 1) << 1) | ((p >> 1) & 1); }

}  // namespace fp8nca::mma_sync
