// Kernels for head_dim 64 (one translation unit per head dim so the build runs in parallel).
#include "attention.cuh"

namespace fp8nca {

cudaError_t launch_attention_d64(const AttnParams& p, int q_dtype, int kv_dtype, cudaStream_t s,
                                 int* ctas_per_sm) {
  return launch_attention_for_dim<64>(p, q_dtype, kv_dtype, s, ctas_per_sm);
}

}  // namespace fp8nca
