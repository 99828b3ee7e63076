// mma.sync kernels for head_dim 128 (one translation unit per head dim: the build runs them in
// parallel): query bf16 / fp16 x cache e4m3 / e5m2 / the query's own 16-bit dtype.
#include <type_traits>

#include "../common/dispatch.h"
#include "api.h"
#include "kernel.cuh"

namespace fp8nca::mma_sync {

cudaError_t launch_d128(const AttnParams& p, dim3 grid, int block_m, int q_dtype, int cache_dtype,
                       cudaStream_t stream, int* ctas_per_sm) {
  FP8NCA_DISPATCH_QUERY(q_dtype, QT, FP8NCA_DISPATCH_CACHE(cache_dtype, QT, KV, {
    return launch_tile<128, QT, KV>(p, grid, block_m, stream, ctas_per_sm);
  }))
}

}  // namespace fp8nca::mma_sync
