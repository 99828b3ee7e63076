#include "launch.h"

#include "../cascade/merge.h"
#include "../mma_sync/api.h"

namespace fp8nca {

namespace {

cudaError_t launch_mma_sync(const AttnParams& p, dim3 grid, int head_dim, int block_m,
                            int q_dtype, int cache_dtype, cudaStream_t stream, int* ctas) {
  switch (head_dim) {
    case 64: return mma_sync::launch_d64(p, grid, block_m, q_dtype, cache_dtype, stream, ctas);
    case 128: return mma_sync::launch_d128(p, grid, block_m, q_dtype, cache_dtype, stream, ctas);
    case 256: return mma_sync::launch_d256(p, grid, block_m, q_dtype, cache_dtype, stream, ctas);
    default: return cudaErrorInvalidValue;
  }
}

// The per-token-head kernels.
cudaError_t launch_mma_sync_pth(const AttnParams& p, dim3 grid, int head_dim, int block_m,
                                int q_dtype, int cache_dtype, cudaStream_t stream, int* ctas) {
  switch (head_dim) {
    case 64:
      return mma_sync::launch_d64_pth(p, grid, block_m, q_dtype, cache_dtype, stream, ctas);
    case 128:
      return mma_sync::launch_d128_pth(p, grid, block_m, q_dtype, cache_dtype, stream, ctas);
    case 256:
      return mma_sync::launch_d256_pth(p, grid, block_m, q_dtype, cache_dtype, stream, ctas);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

cudaError_t launch_attention(const Plan& plan, const AttnParams& p, int q_dtype, int cache_dtype,
                             float* lse, cudaStream_t stream) {
  if (p.num_splits != plan.num_splits) return cudaErrorInvalidValue;
  const dim3 grid(plan.grid_x, plan.grid_y, plan.grid_z);
  // Unsplit, the kernel's epilogue writes the LSE into ws_lse (unused unsplit otherwise; null:
  // none); split, the merge does.
  AttnParams launched = p;
  if (plan.num_splits == 1) launched.ws_lse = lse;
  cudaError_t err = cudaErrorInvalidValue;
  if (p.scale_mode == kScalePerTokenHead) {
    err = launch_mma_sync_pth(launched, grid, p.head_dim, plan.block_m, q_dtype, cache_dtype, stream,
                              nullptr);
  } else if (p.scale_mode == kScalePerHead) {
    err = launch_mma_sync(launched, grid, p.head_dim, plan.block_m, q_dtype, cache_dtype, stream,
                          nullptr);
  }
  if (err == cudaSuccess && plan.num_splits > 1) {
    err = launch_merge(p, q_dtype, MergeOutputs{lse, p.num_q_heads, 1}, stream);
  }
  return err;
}

cudaError_t ctas_per_sm(int head_dim, int block_m, int q_dtype, int cache_dtype, int* ctas) {
  // An int8 cache has per-token-head kernels only; an FP8 one's take the same registers,
  // threads and shared memory per CTA under the same launch bounds as its per-head kernel.
  if (cache_dtype == kI8) {
    return launch_mma_sync_pth(AttnParams{}, dim3(1), head_dim, block_m, q_dtype, cache_dtype,
                               nullptr, ctas);
  }
  return launch_mma_sync(AttnParams{}, dim3(1), head_dim, block_m, q_dtype, cache_dtype, nullptr,
                         ctas);
}

}  // namespace fp8nca
