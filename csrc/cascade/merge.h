// Split-KV (flash decoding) merge of partial attention states, shared by every kernel family.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "../common/params.h"

namespace fp8nca {

// The merge's own output code for float32 rows (merge_attention_states merges fp32 states);
// bf16 and fp16 rows use the element codes of params.h.
constexpr int kMergeFP32 = 4;

// What the merge writes besides `out`: the merged state's natural-log LSE
// (lse[tok * lse_stride_t + head * lse_stride_h], nullptr: none; -inf for padded rows and rows
// no split saw).
struct MergeOutputs {
  float* lse;
  int64_t lse_stride_t, lse_stride_h;
};

// out[row] = merge over p.num_splits of (ws_o, ws_lse); padded rows (past the last sequence)
// written as zeros. `out_dtype`: kBF16, kFP16 or kMergeFP32. Asynchronous on `stream`.
cudaError_t launch_merge(const AttnParams& p, int out_dtype, const MergeOutputs& outputs,
                         cudaStream_t stream);

}  // namespace fp8nca
