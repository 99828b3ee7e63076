// Split-KV (flash decoding) merge: one warp per (token, query head) row, by merge_row.h's
// formula (the attention sink's term counted once here), and, when asked, the merged state's
// natural-log LSE. Rows past cu_seqlens_q[num_seqs] (vLLM's padding under CUDA graphs) get zeros
// and an LSE of -inf (an empty state).
#include <cstdint>

#include "../common/device.cuh"
#include "../common/index_tensors.h"
#include "merge.h"
#include "merge_row.h"

namespace fp8nca {

namespace {

constexpr int kMergeWarps = 4;

template <typename QT>
__device__ __forceinline__ QT from_float(float x);
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}

// One warp per (token, query head) row.
template <typename QT>
__global__ void __launch_bounds__(kMergeWarps * 32)
    merge_splits_kernel(const AttnParams p, const MergeOutputs outputs) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kMergeWarps + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= static_cast<int64_t>(p.num_tokens) * p.num_q_heads) return;
  const int tok = static_cast<int>(row / p.num_q_heads);
  const int head = static_cast<int>(row % p.num_q_heads);
  QT* orow = static_cast<QT*>(p.out) + tok * p.o_stride_t + head * p.o_stride_h;
  float* lse_out = outputs.lse != nullptr
                       ? outputs.lse + tok * outputs.lse_stride_t + head * outputs.lse_stride_h
                       : nullptr;
  if (tok >= cu_seqlens_at(p, p.num_seqs)) {
    for (int d = lane; d < p.head_dim; d += 32) orow[d] = from_float<QT>(0.f);
    if (lse_out != nullptr && lane == 0) *lse_out = -INFINITY;
    return;
  }

  const int64_t split_stride = static_cast<int64_t>(p.num_tokens) * p.num_q_heads;
  // The attention sink (SPEC section 3) in log2 units, like lse; without sinks 2^-inf = 0.
  const float sink = p.sinks != nullptr ? p.sinks[head] * kLog2e : -INFINITY;
  const float* lse = p.ws_lse + row;
  const MergeScale scale = merge_scale(lse, split_stride, p.num_splits, sink);
  if (lse_out != nullptr && lane == 0) *lse_out = scale.lse * kLn2;
  for (int d = lane; d < p.head_dim; d += 32) {
    orow[d] = from_float<QT>(merge_element(p.ws_o + row * p.head_dim + d,
                                           split_stride * p.head_dim, lse, split_stride,
                                           p.num_splits, scale));
  }
}

}  // namespace

cudaError_t launch_merge(const AttnParams& p, int out_dtype, const MergeOutputs& outputs,
                         cudaStream_t stream) {
  const int64_t rows = static_cast<int64_t>(p.num_tokens) * p.num_q_heads;
  const dim3 grid(static_cast<unsigned>((rows + kMergeWarps - 1) / kMergeWarps));
  if (grid.x == 0) return cudaSuccess;
  if (out_dtype == kBF16) {
    FP8NCA_LAUNCH(merge_splits_kernel<__nv_bfloat16>, grid, kMergeWarps * 32, 0, stream, p, outputs);
  } else if (out_dtype == kFP16) {
    FP8NCA_LAUNCH(merge_splits_kernel<__half>, grid, kMergeWarps * 32, 0, stream, p, outputs);
  } else if (out_dtype == kMergeFP32) {
    FP8NCA_LAUNCH(merge_splits_kernel<float>, grid, kMergeWarps * 32, 0, stream, p, outputs);
  } else {
    return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace fp8nca
