// Split-KV (flash decoding) merge of partial attention states, shared by every kernel family.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "../common/params.h"

namespace fp8nca {

// The merge's own output code for float32 rows (merge_attention_states merges fp32 states);
// bf16 and fp16 rows use the element codes of params.h.
constexpr int kMergeFP32 = 4;

// What the merge writes besides the uses of AttnParams: the merged state's natural-log LSE
// (lse[tok * lse_stride_t + head * lse_stride_h], nullptr: none; -inf for padded rows and rows
// no split saw) and whether it writes `out` at all (false: the LSE only, after the attention
// launch already merged `out`).
struct MergeOutputs {
  float* lse;
  int64_t lse_stride_t, lse_stride_h;
  bool write_out;
};

// out[row] = merge over p.num_splits of (ws_o, ws_lse); padded rows (past the last sequence)
// written as zeros. `out_dtype`: kBF16, kFP16 or kMergeFP32. Asynchronous on `stream`.
cudaError_t launch_merge(const AttnParams& p, int out_dtype, const MergeOutputs& outputs,
                         cudaStream_t stream);

// The attention launch's merge: `out` only.
inline cudaError_t launch_merge(const AttnParams& p, int q_dtype, cudaStream_t stream) {
  return launch_merge(p, q_dtype, MergeOutputs{nullptr, 0, 0, true}, stream);
}

}  // namespace fp8nca
