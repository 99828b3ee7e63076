// The head_dim 64 kernels of attention_d64.cu whose unsplit epilogue also writes the LSE.
#include <type_traits>

#include "../common/dispatch.h"
#include "api.h"
#include "kernel.cuh"

namespace fp8nca::mma_sync {

cudaError_t launch_d64_lse(const AttnParams& p, dim3 grid, int block_m, int q_dtype,
                           int kv_dtype, cudaStream_t stream, int* ctas_per_sm) {
  FP8NCA_DISPATCH_QUERY(q_dtype, QT, FP8NCA_DISPATCH_CACHE(kv_dtype, QT, KV, {
    return launch_tile<64, QT, KV, true>(p, {}, grid, block_m, stream, ctas_per_sm);
  }))
}

}  // namespace fp8nca::mma_sync
