// Exact e4m3 -> bf16 by bit moves (no conversion instruction), for the K tile of an e4m3 cache
// under a bf16 query: the hardware path (e4m3 -> f16x2, two f16 -> f32, f32x2 -> bf16x2) issues
// two conversion-pipe instructions per pair, the slowest pipe on sm_90 / sm_100 (16 results per
// clock per SM). FP8NCA_HD functions: the kernels call them and so does the host test
// (tests/test_cuda_kernel_emulation.py, through python/bindings.cpp), which checks every byte.
#pragma once

#include <cstdint>

#include "../common/host_device.h"
#include "../common/params.h"

namespace fp8nca::mma_sync {

// Whether the kernel dequantises K by bit moves (and stores it in bf16_k_dim order) for this
// query and cache dtype.
FP8NCA_HD constexpr bool bit_dequant_k(int q_dtype, int kv_dtype) {
  return q_dtype == kBF16 && kv_dtype == kE4M3;
}

// The e4m3 bytes in the high byte of each 16-bit half of q, as bf16x2 bits of the value times
// 2^-120: the sign to bit 15, the 4 exponent and 3 mantissa bits to the low exponent bits and
// the top mantissa bits of bf16 (exponent bias 7 -> 127; an e4m3 subnormal becomes a bf16
// subnormal of the same scaled value), so one multiply by 2^120 restores the e4m3 value
// exactly. A NaN byte (magnitude 0x7f) gives 480 after the multiply: callers test
// e4m3x4_has_nan first.
FP8NCA_HD constexpr uint32_t e4m3_high_bytes_to_bf16x2_scaled(uint32_t q) {
  return (q & 0x80008000u) | ((q & 0x7f007f00u) >> 4);
}

// The four e4m3 bytes b0..b3 (low first) of w as two bf16x2 words scaled by 2^-120:
// even = (b0, b2), odd = (b1, b3). Stored even then odd, head dims 4m + {0, 2, 1, 3} land at
// positions 4m + {0, 1, 2, 3} of the 16-bit row (bf16_k_dim).
FP8NCA_HD constexpr uint32_t e4m3x4_even_to_bf16x2_scaled(uint32_t w) {
  return e4m3_high_bytes_to_bf16x2_scaled(w << 8);
}
FP8NCA_HD constexpr uint32_t e4m3x4_odd_to_bf16x2_scaled(uint32_t w) {
  return e4m3_high_bytes_to_bf16x2_scaled(w);
}

// 2^120 as a bf16 pair (exponent field 247), the multiplier of the scaled words.
constexpr uint32_t kBf16x2TwoPow120 = 0x7b807b80u;

// Whether a byte of w is an e4m3 NaN (magnitude 0x7f): adding 1 to each 7-bit magnitude
// carries into bit 7 only for 0x7f, never into the next byte.
FP8NCA_HD constexpr uint32_t e4m3x4_nan_bits(uint32_t w) {
  return ((w & 0x7f7f7f7fu) + 0x01010101u) & 0x80808080u;
}

// Head dim at position p of a row of the bit-dequantised bf16 K tile, and so of the Q
// fragments that meet it in S = Q K^T (a permutation inside each group of 4 adjacent dims:
// the reduction is unchanged).
FP8NCA_HD constexpr int bf16_k_dim(int p) { return (p & ~3) | ((p & 1) << 1) | ((p >> 1) & 1); }

}  // namespace fp8nca::mma_sync
