// The mma.sync launch: one plan -> the kernel for the head dim, then the split-KV merge. Host
// C++. (The CUTLASS-DSL families launch through their own libraries, see
// fp8_noncausal_attn/backends/cuda/dsl.py.)
#pragma once

#include <cuda_runtime_api.h>

#include "params.h"
#include "plan.h"

namespace fp8nca {

// Launches attention (and the merge when plan.num_splits > 1) on `stream`; p.num_splits must
// equal plan.num_splits. p.scale_mode picks the per-head or the per-token-head kernels (which
// read ts's scale strides). A non-null `lse` (fp32 [num_tokens, num_q_heads], contiguous)
// receives each row's natural-log LSE in the same passes: from the attention kernel's epilogue
// when unsplit, from the merge when split. No host synchronisation.
cudaError_t launch_attention(const Plan& plan, const AttnParams& p, int q_dtype, int cache_dtype,
                             float* lse, cudaStream_t stream);

// CTAs of the kernel for (head_dim, tile of block_m rows, dtypes) resident on one SM of the
// current device.
cudaError_t ctas_per_sm(int head_dim, int block_m, int q_dtype, int cache_dtype, int* ctas);

}  // namespace fp8nca
