// Host entry points of the mma.sync family (host C++ may include this header).
#pragma once

#include <cuda_runtime_api.h>

#include "../common/params.h"

namespace fp8nca::mma_sync {

// Launch the attention kernel for one head dim and tile of `block_m` query rows (64, or 128 for
// FP8 caches at head_dim 128) on `grid` (plan.h), or with `ctas_per_sm` set launch nothing
// and report the kernel's resident CTAs per SM on the current device. Unsplit, the kernel also
// writes each row's natural-log LSE into p.ws_lse ([num_tokens, num_q_heads]) when it is set.
// cudaErrorInvalidValue for a dtype pair that is not compiled. No host synchronisation.
cudaError_t launch_d64(const AttnParams& p, dim3 grid, int block_m, int q_dtype, int cache_dtype,
                       cudaStream_t stream, int* ctas_per_sm);
cudaError_t launch_d128(const AttnParams& p, dim3 grid, int block_m, int q_dtype, int cache_dtype,
                        cudaStream_t stream, int* ctas_per_sm);
cudaError_t launch_d256(const AttnParams& p, dim3 grid, int block_m, int q_dtype, int cache_dtype,
                        cudaStream_t stream, int* ctas_per_sm);

// The launches of the per-token-head kernels (cache_dtype e4m3, e5m2 or int8; k_scale / v_scale
// [num_blocks, block_size, num_kv_heads] through p's ks_stride_* / vs_stride_*),
// attention_d<D>_pth.cu.
cudaError_t launch_d64_pth(const AttnParams& p, dim3 grid, int block_m, int q_dtype,
                           int cache_dtype, cudaStream_t stream, int* ctas_per_sm);
cudaError_t launch_d128_pth(const AttnParams& p, dim3 grid, int block_m, int q_dtype,
                            int cache_dtype, cudaStream_t stream, int* ctas_per_sm);
cudaError_t launch_d256_pth(const AttnParams& p, dim3 grid, int block_m, int q_dtype,
                            int cache_dtype, cudaStream_t stream, int* ctas_per_sm);

}  // namespace fp8nca::mma_sync
