// Store-side conversion of the cache write (SPEC section 4, reshape_and_cache): fp32 -> the
// cache format, saturating to the format's finite max (16-bit caches too: never inf from a
// finite input), round to nearest even, subnormals kept, NaN stays NaN. Integer arithmetic on
// the fp32 bit pattern, the same on host and device, so the CPU test (tests/ext/host_hooks.cpp
// quantize_host) checks the bytes the kernel writes against fp8_noncausal_attn/scales.quantize.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "../common/host_device.h"
#include "../common/params.h"

namespace fp8nca::cache {

FP8NCA_HD uint32_t bits_of(float x) {
  uint32_t u;
  memcpy(&u, &x, sizeof(u));
  return u;
}

FP8NCA_HD float float_of(uint32_t u) {
  float x;
  memcpy(&x, &u, sizeof(x));
  return x;
}

// Largest finite value of a cache format.
FP8NCA_HD float finite_max(int dtype) {
  switch (dtype) {
    case kE4M3: return 448.f;
    case kE5M2: return 57344.f;
    case kFP16: return 65504.f;
    default: return float_of(0x7f7f0000u);  // bf16: (2 - 2^-7) * 2^127
  }
}

// fp32 -> an IEEE-style float with `mant` mantissa and `exp_bits` exponent bits (e4m3: 3, 4;
// e5m2: 2, 5; fp16: 10, 5), |x| already <= its finite max. Returns sign | exponent | mantissa.
FP8NCA_HD uint32_t encode_small(float x, int mant, int exp_bits) {
  const int bias = (1 << (exp_bits - 1)) - 1;
  const uint32_t sign = (bits_of(x) >> 31) << (mant + exp_bits);
  const float mag = fabsf(x);
  const float min_normal = ldexpf(1.f, 1 - bias);
  if (mag < min_normal) {
    // Below the smallest normal the format is fixed point with step 2^(1 - bias - mant).
    return sign | static_cast<uint32_t>(rintf(mag * ldexpf(1.f, bias + mant - 1)));
  }
  const uint32_t mb = bits_of(mag);
  const int shift = 23 - mant;
  const uint32_t rounded = mb + ((1u << (shift - 1)) - 1) + ((mb >> shift) & 1u);
  const uint32_t exponent = (rounded >> 23) - 127 + bias;
  return sign | (exponent << mant) | ((rounded >> shift) & ((1u << mant) - 1));
}

// fp32 -> the stored bit pattern of `dtype` (kE4M3 / kE5M2: one byte; kBF16 / kFP16: two).
FP8NCA_HD uint32_t encode(float x, int dtype) {
  if (x != x) {  // NaN: the format's (torch's) canonical quiet NaN
    return dtype == kBF16 ? 0x7fc0u : dtype == kFP16 ? 0x7e00u : 0x7fu;
  }
  const float fmax = finite_max(dtype);
  x = fminf(fmaxf(x, -fmax), fmax);
  switch (dtype) {
    case kE4M3: return encode_small(x, 3, 4);
    case kE5M2: return encode_small(x, 2, 5);
    case kFP16: return encode_small(x, 10, 5);
    default: {
      const uint32_t b = bits_of(x);
      return (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
    }
  }
}

// The whole store-side conversion of one element: divide by the per-head scale (IEEE fp32
// division, as torch does), then encode.
FP8NCA_HD uint32_t quantize(float x, float scale, int dtype) { return encode(x / scale, dtype); }

}  // namespace fp8nca::cache
