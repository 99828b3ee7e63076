// Kernels for head_dim 64 (one translation unit per head dim so the build runs in parallel).
#include "attention.cuh"

namespace fp8nca {

cudaError_t launch_attention_d64(const AttnParams& p, int q_dtype, int kv_dtype, cudaStream_t s) {
  return launch_attention_for_dim<64>(p, q_dtype, kv_dtype, s);
}

}  // namespace fp8nca
