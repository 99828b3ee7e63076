// Family dispatch (the Arch axis): one plan -> the family's kernel for the head dim, then the
// split-KV merge. Host C++.
#pragma once

#include <cuda_runtime_api.h>

#include "params.h"
#include "plan.h"

namespace fp8nca {

// Launches attention (and the merge when plan.num_splits > 1) on `stream`; p.num_splits must
// equal plan.num_splits. No host synchronisation.
cudaError_t launch_attention(const Plan& plan, const AttnParams& p, int q_dtype, int kv_dtype,
                             cudaStream_t stream);

// CTAs of a family's kernel for (head_dim, tile of block_m rows, dtypes) resident on one SM of
// the current device.
cudaError_t ctas_per_sm(Family family, int head_dim, int block_m, int q_dtype, int kv_dtype,
                        int* ctas);

}  // namespace fp8nca
