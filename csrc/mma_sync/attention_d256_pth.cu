// The head_dim 256 kernels over per-token-head caches (e4m3, e5m2, int8 with a scale per key and
// KV head), in a translation unit of their own.
#include "../common/dispatch.h"
#include "api.h"
#include "kernel.cuh"

namespace fp8nca::mma_sync {

cudaError_t launch_d256_pth(const AttnParams& p, dim3 grid, int block_m, int q_dtype,
                            int cache_dtype, cudaStream_t stream, int* ctas_per_sm) {
  FP8NCA_DISPATCH_QUERY(q_dtype, QT, FP8NCA_DISPATCH_TOKEN_SCALED_CACHE(cache_dtype, KV, {
    return launch_tile<256, QT, KV, true>(p, grid, block_m, stream, ctas_per_sm);
  }))
}

}  // namespace fp8nca::mma_sync
