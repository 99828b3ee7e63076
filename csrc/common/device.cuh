// Every hardware primitive the CUDA kernels use, in one place: cp.async (cute's SM80 atoms),
// mma.sync m16n8k16, ldmatrix .x4 .trans, ex2.approx, the FP8 -> f16x2 conversions,
// fma.rn.bf16x2, dynamic shared memory and the kernel launch. Under nvcc these are the real
// instructions. Under a host C++ compiler (the SIMT executor, csrc/simt/) the CPU twin in
// csrc/simt/cuda_twin.h implements each one from the PTX ISA's definition, and also CUDA's own
// intrinsics the kernels call by their CUDA names (__shfl_sync, __shfl_xor_sync, __any_sync,
// __syncthreads, threadIdx / blockIdx / blockDim / gridDim, the 16-bit types).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cute/arch/copy_sm80.hpp>
#include <cute/arch/mma_sm80.hpp>

namespace fp8nca::hw {

// cp.async.cg of 16 bytes (L2 only) into shared memory; with !ok nothing is read and the 16
// bytes are zero-filled. Completes at the cp_async_wait that covers its group.
__device__ __forceinline__ void cp_async_cg_16(void* smem, const void* gmem, bool ok) {
  cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<uint4>::copy(*static_cast<const uint4*>(gmem),
                                                     *static_cast<uint4*>(smem), ok);
}

// cp.async.ca of one T (4, 8 or 16 bytes), zero-filled with !ok.
template <typename T>
__device__ __forceinline__ void cp_async_ca(T* smem, const T* gmem, bool ok) {
  cute::SM80_CP_ASYNC_CACHEALWAYS_ZFILL<T>::copy(*gmem, *smem, ok);
}

// cp.async.commit_group: the thread's copies since the last one form a group.
__device__ __forceinline__ void cp_async_fence() { cute::cp_async_fence(); }

// cp.async.wait_group N (N > 0): all but the newest N committed groups are complete;
// N == 0 is cp.async.wait_all (uncommitted copies too).
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  cute::cp_async_wait<N>();
}

// mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32: c += A B over the warp's
// fragments (PTX ISA layouts), the operand dtype picked by the tag.
__device__ __forceinline__ void mma_m16n8k16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1, __nv_bfloat16) {
  cute::SM80_16x8x16_F32BF16BF16F32_TN::fma(c[0], c[1], c[2], c[3], a[0], a[1], a[2], a[3], b0,
                                            b1, c[0], c[1], c[2], c[3]);
}
__device__ __forceinline__ void mma_m16n8k16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1, __half) {
  cute::SM80_16x8x16_F32F16F16F32_TN::fma(c[0], c[1], c[2], c[3], a[0], a[1], a[2], a[3], b0,
                                          b1, c[0], c[1], c[2], c[3]);
}

// The shared-memory address (the .shared window) of a generic pointer into shared memory.
__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16: lanes 8i..8i+7 give the rows of matrix i.
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&d)[4], uint32_t smem_address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
               : "r"(smem_address));
}

// ex2.approx.ftz.f32: 2^x, subnormal inputs and results flushed to zero.
__device__ __forceinline__ float ex2_approx_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// cvt.rn.f16x2.e4m3x2 / .e5m2x2: two FP8 values (low byte first) -> an f16 pair, exactly.
__device__ __forceinline__ uint32_t cvt_f16x2_e4m3x2(uint16_t x) {
  uint32_t h2;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(x));
  return h2;
}
__device__ __forceinline__ uint32_t cvt_f16x2_e5m2x2(uint16_t x) {
  uint32_t h2;
  asm("cvt.rn.f16x2.e5m2x2 %0, %1;" : "=r"(h2) : "h"(x));
  return h2;
}

// fma.rn.bf16x2: a * b + c on each bf16 half, rounded once.
__device__ __forceinline__ uint32_t fma_rn_bf16x2(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

// The CTA's dynamic shared memory (the launch's smem bytes), 128-byte aligned.
template <typename T>
__device__ __forceinline__ T* dynamic_smem() {
  extern __shared__ __align__(128) uint8_t fp8nca_dynamic_smem[];
  return reinterpret_cast<T*>(fp8nca_dynamic_smem);
}

}  // namespace fp8nca::hw

// kernel<<<grid, block, smem, stream>>>(args...).
#define FP8NCA_LAUNCH(kernel, grid, block, smem, stream, ...) \
  kernel<<<grid, block, smem, stream>>>(__VA_ARGS__)

#else

#include "../simt/cuda_twin.h"

#endif
