// The CPU twin of what the kernels take from CUDA (the SIMT executor's build only; nvcc never
// sees this file): the kernel qualifiers, the vector and 16-bit types with their conversions,
// the built-in indices, the warp intrinsics and __syncthreads, the slice of the runtime API the
// launch code calls, and the hardware primitives of csrc/common/device.cuh, each from the PTX
// ISA's definition. Warp collectives, barriers and cp.async are served by the executor
// (runtime.h); the rest is plain arithmetic here. Every name the kernels call keeps its CUDA
// spelling, so the kernel source compiles unchanged under a host C++ compiler.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "runtime.h"

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) alignas(n)

#define CUDART_VERSION 0

// ---- vector types and indices ----

struct uint3 {
  unsigned x, y, z;
};
struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
struct alignas(8) uint2 {
  unsigned x, y;
};
struct alignas(8) float2 {
  float x, y;
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }
inline float2 make_float2(float x, float y) { return {x, y}; }

#define threadIdx (::fp8nca::simt::thread_index())
#define blockIdx (::fp8nca::simt::block_index())
#define blockDim (::fp8nca::simt::block_dim())
#define gridDim (::fp8nca::simt::grid_dim())

using std::max;
using std::min;
inline float __log2f(float x) { return std::log2(x); }  // lg2.approx: within its error

// ---- 16-bit floating types (IEEE binary16 and bfloat16, bits held as they are) ----

struct __half {
  uint16_t bits;
};
struct alignas(4) __half2 {
  __half x, y;
};
struct __nv_bfloat16 {
  uint16_t bits;
};
struct alignas(4) __nv_bfloat162 {
  __nv_bfloat16 x, y;
};

namespace fp8nca::simt {

// The bits of `from` read as a `To` of the same size (std::bit_cast, which C++17 lacks).
template <typename To, typename From>
inline To bit_cast(const From& from) {
  static_assert(sizeof(To) == sizeof(From), "bit_cast between types of one size");
  To to;
  std::memcpy(&to, &from, sizeof(To));
  return to;
}
inline uint32_t float_bits(float x) { return bit_cast<uint32_t>(x); }
inline float bits_float(uint32_t u) { return bit_cast<float>(u); }
// Round to nearest even (the compiler's _Float16 conversion is IEEE's).
inline uint16_t half_bits_rn(float x) { return bit_cast<uint16_t>(static_cast<_Float16>(x)); }
inline float half_value(uint16_t u) { return static_cast<float>(bit_cast<_Float16>(u)); }
// bf16 shares fp32's exponent: rounding the fp32 bits to the top 16 is the IEEE rounding,
// subnormals included; NaN stays a quiet NaN.
inline uint16_t bf16_bits_rn(float x) {
  const uint32_t u = float_bits(x);
  if (std::isnan(x)) return static_cast<uint16_t>((u >> 16) | 0x40u);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
inline float bf16_value(uint16_t u) { return bits_float(uint32_t{u} << 16); }
inline uint16_t bf16_bits_rn(double x) {
  // Rounded once from the double (exact for a product of two bf16 plus a third).
  const double mag = std::fabs(x);
  if (std::isnan(x)) return 0x7fc0u;
  const uint16_t sign = std::signbit(x) ? 0x8000u : 0u;
  if (mag == 0.0) return sign;
  int e;
  std::frexp(mag, &e);  // mag = f 2^e, f in [0.5, 1)
  const int step_exp = std::max(e - 8, -133);  // 8 significant bits; subnormal step 2^-133
  const double units = std::nearbyint(std::ldexp(mag, -step_exp));  // ties to even
  const double rounded = std::ldexp(units, step_exp);
  return static_cast<uint16_t>(sign | bf16_bits_rn(static_cast<float>(rounded)));
}

}  // namespace fp8nca::simt

inline float __half2float(__half h) { return fp8nca::simt::half_value(h.bits); }
inline __half __float2half_rn(float x) { return {fp8nca::simt::half_bits_rn(x)}; }
inline float __bfloat162float(__nv_bfloat16 b) { return fp8nca::simt::bf16_value(b.bits); }
inline __nv_bfloat16 __float2bfloat16_rn(float x) { return {fp8nca::simt::bf16_bits_rn(x)}; }
inline __half __ushort_as_half(unsigned short u) { return {u}; }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short u) { return {u}; }
inline float2 __half22float2(__half2 h) { return {__half2float(h.x), __half2float(h.y)}; }
inline __half2 __floats2half2_rn(float lo, float hi) {
  return {__float2half_rn(lo), __float2half_rn(hi)};
}
inline __half2 __float2half2_rn(float x) { return __floats2half2_rn(x, x); }
inline __nv_bfloat162 __floats2bfloat162_rn(float lo, float hi) {
  return {__float2bfloat16_rn(lo), __float2bfloat16_rn(hi)};
}
inline __nv_bfloat162 __float22bfloat162_rn(float2 f) { return __floats2bfloat162_rn(f.x, f.y); }
// The difference of two fp16 values is exact in fp32, so one rounding gives IEEE's result.
inline __half2 __hsub2(__half2 a, __half2 b) {
  return {__float2half_rn(__half2float(a.x) - __half2float(b.x)),
          __float2half_rn(__half2float(a.y) - __half2float(b.y))};
}

// prmt.b32 (default mode): byte i of the result is byte selector[i] of {b, a} (a: bytes 0-3),
// with bit 3 of the selector nibble replicating that byte's sign bit.
inline unsigned __byte_perm(unsigned a, unsigned b, unsigned selector) {
  const uint64_t bytes = (uint64_t{b} << 32) | a;
  unsigned result = 0;
  for (int i = 0; i < 4; ++i) {
    const unsigned nibble = (selector >> (4 * i)) & 0xfu;
    unsigned byte = static_cast<unsigned>(bytes >> (8 * (nibble & 7u))) & 0xffu;
    if (nibble & 8u) byte = (byte & 0x80u) ? 0xffu : 0u;
    result |= byte << (8 * i);
  }
  return result;
}

// ---- warp intrinsics and the barrier (the executor's, with the call site for its reports) ----

template <typename T>
T __shfl_sync(unsigned mask, T var, int src_lane, int width = 32,
              const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  return fp8nca::simt::shuffle(mask, var, src_lane, width, fp8nca::simt::ShuffleMode::kIndex,
                               {file, line, "__shfl_sync"});
}
template <typename T>
T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = 32,
                  const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  return fp8nca::simt::shuffle(mask, var, lane_mask, width, fp8nca::simt::ShuffleMode::kXor,
                               {file, line, "__shfl_xor_sync"});
}
inline int __any_sync(unsigned mask, int predicate, const char* file = __builtin_FILE(),
                      int line = __builtin_LINE()) {
  return fp8nca::simt::vote_any(mask, predicate != 0, {file, line, "__any_sync"});
}
inline void __syncthreads(const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  fp8nca::simt::sync_threads({file, line, "__syncthreads"});
}

// ---- the runtime API the launch code calls ----

enum cudaError_t : int {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorLaunchFailure = 719,
};
using cudaStream_t = struct CUstream_st*;
enum cudaFuncAttribute : int { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };

inline cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}
inline cudaError_t cudaSetDevice(int) { return cudaSuccess; }
inline cudaError_t cudaDriverGetVersion(int* version) {
  *version = 0;
  return cudaSuccess;
}
template <typename F>
cudaError_t cudaFuncSetAttribute(F, cudaFuncAttribute, int) {
  return cudaSuccess;
}
// The executor has no SMs: one CTA "fits", so plans made on it are valid (and small).
template <typename F>
cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* ctas, F, int, size_t) {
  *ctas = 1;
  return cudaSuccess;
}
inline cudaError_t cudaGetLastError() {
  return static_cast<cudaError_t>(fp8nca::simt::take_launch_error());
}
inline const char* cudaGetErrorString(cudaError_t err) {
  return err == cudaErrorLaunchFailure  ? fp8nca::simt::last_report()
         : err == cudaErrorInvalidValue ? "invalid argument"
         : err == cudaSuccess           ? "no error"
                                        : "unknown error";
}

// ---- the hardware primitives of csrc/common/device.cuh ----

namespace fp8nca::hw {

inline void cp_async_cg_16(void* smem, const void* gmem, bool ok,
                           const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  simt::cp_async(smem, gmem, 16, ok ? 16 : 0, {file, line, "cp.async.cg"});
}
template <typename T>
void cp_async_ca(T* smem, const T* gmem, bool ok, const char* file = __builtin_FILE(),
                 int line = __builtin_LINE()) {
  static_assert(sizeof(T) == 4 || sizeof(T) == 8 || sizeof(T) == 16, "cp.async: 4, 8 or 16");
  simt::cp_async(smem, gmem, sizeof(T), ok ? sizeof(T) : 0, {file, line, "cp.async.ca"});
}
inline void cp_async_fence() { simt::cp_async_commit(); }
template <int N>
void cp_async_wait() {
  simt::cp_async_wait(N);
}

inline void mma_m16n8k16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1,
                         __nv_bfloat16, const char* file = __builtin_FILE(),
                         int line = __builtin_LINE()) {
  simt::mma_m16n8k16(c, a, b0, b1, simt::MmaType::kBF16, {file, line, "mma.sync"});
}
inline void mma_m16n8k16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1, __half,
                         const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  simt::mma_m16n8k16(c, a, b0, b1, simt::MmaType::kF16, {file, line, "mma.sync"});
}

inline uint32_t shared_address(const void* p) { return simt::shared_offset(p); }

inline void ldmatrix_x4_trans(uint32_t (&d)[4], uint32_t smem_address,
                              const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  simt::ldmatrix_x4_trans(d, smem_address, {file, line, "ldmatrix.x4.trans"});
}

// ex2.approx.ftz.f32: exp2 (correctly rounded, inside the instruction's 2 ulp) with
// subnormal inputs read as zero and subnormal results flushed to (signed) zero.
inline float ex2_approx_ftz(float x) {
  if (std::fpclassify(x) == FP_SUBNORMAL) x = 0.f;
  const float y = std::exp2(x);
  return std::fpclassify(y) == FP_SUBNORMAL ? std::copysign(0.f, y) : y;
}

// One e4m3 byte (bias 7, no infinities, S.1111.111 NaN) -> its fp16 bits, exactly.
inline uint16_t e4m3_to_half_bits(uint8_t byte) {
  const bool negative = byte & 0x80u;
  const int exponent = (byte >> 3) & 0xf;
  const int mantissa = byte & 0x7;
  if (exponent == 0xf && mantissa == 0x7) return negative ? 0xffffu : 0x7fffu;
  const float magnitude = exponent == 0 ? std::ldexp(static_cast<float>(mantissa), -9)
                                        : std::ldexp(1.f + mantissa / 8.f, exponent - 7);
  return simt::half_bits_rn(negative ? -magnitude : magnitude);
}

// The byte at bits 8..15 of x goes to the upper half of the result (PTX ISA cvt).
inline uint32_t cvt_f16x2_e4m3x2(uint16_t x) {
  return e4m3_to_half_bits(static_cast<uint8_t>(x)) |
         uint32_t{e4m3_to_half_bits(static_cast<uint8_t>(x >> 8))} << 16;
}
// e5m2 is the top byte of an fp16 (same exponent width and bias).
inline uint32_t cvt_f16x2_e5m2x2(uint16_t x) {
  return (uint32_t{x} & 0xffu) << 8 | (uint32_t{x} & 0xff00u) << 16;
}

inline uint32_t fma_rn_bf16x2(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d = 0;
  for (int half = 0; half < 2; ++half) {
    const auto value = [half](uint32_t w) {
      return static_cast<double>(simt::bf16_value(static_cast<uint16_t>(w >> (16 * half))));
    };
    d |= uint32_t{simt::bf16_bits_rn(value(a) * value(b) + value(c))} << (16 * half);
  }
  return d;
}

template <typename T>
T* dynamic_smem() {
  return static_cast<T*>(simt::dynamic_smem());
}

}  // namespace fp8nca::hw

#define FP8NCA_LAUNCH(kernel, grid, block, smem, stream, ...) \
  ::fp8nca::simt::launch<kernel>(grid, block, smem, __VA_ARGS__)

namespace fp8nca::simt {

template <auto Kernel>
const char* kernel_signature() {
  return __PRETTY_FUNCTION__;  // "... [with auto Kernel = <the kernel>]"
}

// Runs Kernel(args...) over the grid, CTA after CTA, each CTA's threads as fibers. Returns
// cudaErrorLaunchFailure (last_report() says why) when a check fails; the failure is also
// what the next cudaGetLastError() returns, as a launch error is on a GPU.
template <auto Kernel, typename... Args>
cudaError_t launch(dim3 grid, dim3 block, size_t smem, const Args&... args) {
  auto call = [&]() { Kernel(args...); };
  using Call = decltype(call);
  const GridShape shape{{grid.x, grid.y, grid.z}, {block.x, block.y, block.z}, smem};
  return static_cast<cudaError_t>(run_grid(
      kernel_signature<Kernel>(), shape, [](void* c) { (*static_cast<Call*>(c))(); }, &call));
}

}  // namespace fp8nca::simt
