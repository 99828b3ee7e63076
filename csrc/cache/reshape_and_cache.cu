// Cache write: one CTA per (token, KV head) writes that head's K and V row. Small next to the
// attention it feeds (one row per new token), so plain element loads and stores.
#include <cstdint>

#include "../common/device.cuh"
#include "quantize.h"
#include "reshape_and_cache.h"

namespace fp8nca {

namespace {

constexpr int kThreads = 128;

__device__ __forceinline__ float load_16bit(const void* base, int64_t index, int dtype) {
  const uint16_t raw = static_cast<const uint16_t*>(base)[index];
  return dtype == kBF16 ? __bfloat162float(__ushort_as_bfloat16(raw))
                        : __half2float(__ushort_as_half(raw));
}

__device__ __forceinline__ void store(void* base, int64_t index, uint32_t code, int dtype) {
  if (dtype_bytes(dtype) == 1) {
    static_cast<uint8_t*>(base)[index] = static_cast<uint8_t>(code);
  } else {
    static_cast<uint16_t*>(base)[index] = static_cast<uint16_t>(code);
  }
}

__global__ void __launch_bounds__(kThreads) reshape_and_cache_kernel(const CacheWriteParams p) {
  const int token = blockIdx.x;
  const int head = blockIdx.y;
  const int64_t slot = p.slot_mapping[token * p.slot_stride];
  if (slot < 0) return;
  const int64_t block = slot / p.block_size;
  const int64_t offset = slot % p.block_size;
  const float k_scale = p.k_scale[head];
  const float v_scale = p.v_scale[head];
  const int64_t k_in = token * p.key_stride_t + head * p.key_stride_h;
  const int64_t v_in = token * p.value_stride_t + head * p.value_stride_h;
  const int64_t k_out = block * p.kc_stride_b + offset * p.kc_stride_s + head * p.kc_stride_h;
  const int64_t v_out = block * p.vc_stride_b + offset * p.vc_stride_s + head * p.vc_stride_h;
  for (int d = threadIdx.x; d < p.head_dim; d += kThreads) {
    const float k = load_16bit(p.key, k_in + d, p.in_dtype);
    const float v = load_16bit(p.value, v_in + d, p.in_dtype);
    store(p.key_cache, k_out + d, cache::quantize(k, k_scale, p.cache_dtype), p.cache_dtype);
    store(p.value_cache, v_out + d, cache::quantize(v, v_scale, p.cache_dtype), p.cache_dtype);
  }
}

}  // namespace

cudaError_t launch_reshape_and_cache(const CacheWriteParams& p, cudaStream_t stream) {
  if (p.num_tokens == 0 || p.num_kv_heads == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>(p.num_tokens), static_cast<unsigned>(p.num_kv_heads));
  FP8NCA_LAUNCH(reshape_and_cache_kernel, grid, kThreads, 0, stream, p);
  return cudaGetLastError();
}

}  // namespace fp8nca
