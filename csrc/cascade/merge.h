// Split-KV (flash decoding) merge of partial attention states, shared by every kernel family.
#pragma once

#include <cuda_runtime_api.h>

#include "../common/params.h"

namespace fp8nca {

// out[row] = merge over p.num_splits of (ws_o, ws_lse); padded rows (past the last sequence)
// written as zeros. Asynchronous on `stream`.
cudaError_t launch_merge(const AttnParams& p, int q_dtype, cudaStream_t stream);

}  // namespace fp8nca
