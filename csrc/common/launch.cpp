#include "launch.h"

#include "../cascade/merge.h"
#include "../mma_sync/api.h"

namespace fp8nca {

namespace {

cudaError_t launch_mma_sync(const AttnParams& p, dim3 grid, int head_dim, int block_m,
                            int q_dtype, int kv_dtype, cudaStream_t stream, int* ctas) {
  switch (head_dim) {
    case 64: return mma_sync::launch_d64(p, grid, block_m, q_dtype, kv_dtype, stream, ctas);
    case 128: return mma_sync::launch_d128(p, grid, block_m, q_dtype, kv_dtype, stream, ctas);
    case 256: return mma_sync::launch_d256(p, grid, block_m, q_dtype, kv_dtype, stream, ctas);
    default: return cudaErrorInvalidValue;
  }
}

// The kernels that also write the unsplit LSE (into p.ws_lse).
cudaError_t launch_mma_sync_lse(const AttnParams& p, dim3 grid, int head_dim, int block_m,
                                int q_dtype, int kv_dtype, cudaStream_t stream) {
  switch (head_dim) {
    case 64:
      return mma_sync::launch_d64_lse(p, grid, block_m, q_dtype, kv_dtype, stream, nullptr);
    case 128:
      return mma_sync::launch_d128_lse(p, grid, block_m, q_dtype, kv_dtype, stream, nullptr);
    case 256:
      return mma_sync::launch_d256_lse(p, grid, block_m, q_dtype, kv_dtype, stream, nullptr);
    default: return cudaErrorInvalidValue;
  }
}

// The per-token-head kernels (they write p.ws_lse when set and unsplit).
cudaError_t launch_mma_sync_pth(const AttnParams& p, const TokenScaleParams& ts, dim3 grid,
                                int head_dim, int block_m, int q_dtype, int kv_dtype,
                                cudaStream_t stream, int* ctas) {
  switch (head_dim) {
    case 64:
      return mma_sync::launch_d64_pth(p, ts, grid, block_m, q_dtype, kv_dtype, stream, ctas);
    case 128:
      return mma_sync::launch_d128_pth(p, ts, grid, block_m, q_dtype, kv_dtype, stream, ctas);
    case 256:
      return mma_sync::launch_d256_pth(p, ts, grid, block_m, q_dtype, kv_dtype, stream, ctas);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

cudaError_t launch_attention(const Plan& plan, const AttnParams& p, const TokenScaleParams& ts,
                             int q_dtype, int kv_dtype, float* lse, cudaStream_t stream) {
  if (p.num_splits != plan.num_splits) return cudaErrorInvalidValue;
  const dim3 grid(plan.grid_x, plan.grid_y, plan.grid_z);
  cudaError_t err = cudaSuccess;
  if (ts.scale_mode == kScalePerTokenHead) {
    // Unsplit, its epilogue writes the LSE into ws_lse (null: none); split, the merge does.
    AttnParams with_lse = p;
    if (plan.num_splits == 1) with_lse.ws_lse = lse;
    err = launch_mma_sync_pth(with_lse, ts, grid, p.head_dim, plan.block_m, q_dtype, kv_dtype,
                              stream, nullptr);
    if (err == cudaSuccess && plan.num_splits > 1) {
      err = launch_merge(p, q_dtype, MergeOutputs{lse, p.num_q_heads, 1}, stream);
    }
    return err;
  }
  if (ts.scale_mode != kScalePerHead) return cudaErrorInvalidValue;
  if (plan.num_splits == 1 && lse != nullptr) {
    // Unsplit, the kernel that writes each row's LSE in its epilogue, into ws_lse (unused
    // unsplit otherwise).
    AttnParams with_lse = p;
    with_lse.ws_lse = lse;
    return launch_mma_sync_lse(with_lse, grid, p.head_dim, plan.block_m, q_dtype, kv_dtype,
                               stream);
  }
  err = launch_mma_sync(p, grid, p.head_dim, plan.block_m, q_dtype, kv_dtype, stream, nullptr);
  if (err == cudaSuccess && plan.num_splits > 1) {
    err = launch_merge(p, q_dtype, MergeOutputs{lse, p.num_q_heads, 1}, stream);
  }
  return err;
}

cudaError_t ctas_per_sm(int head_dim, int block_m, int q_dtype, int kv_dtype, int* ctas) {
  // An int8 cache has per-token-head kernels only; an FP8 one's take the same registers,
  // threads and shared memory per CTA under the same launch bounds as its per-head kernel.
  if (kv_dtype == kI8) {
    return launch_mma_sync_pth(AttnParams{}, TokenScaleParams{}, dim3(1), head_dim, block_m,
                               q_dtype, kv_dtype, nullptr, ctas);
  }
  return launch_mma_sync(AttnParams{}, dim3(1), head_dim, block_m, q_dtype, kv_dtype, nullptr,
                         ctas);
}

}  // namespace fp8nca
