// Split-KV (flash decoding) merge: out = sum_s w_s O_s with w_s = 2^(lse_s - max) / (sum of w
// + 2^(sink - max)), the attention sink's term counted once here (none without sinks). Each
// split's O_s is already normalised and scaled by v_scale; lse and sink are in log2 units.
// Rows past cu_seqlens_q[num_seqs] (vLLM's padding under CUDA graphs) get zeros.
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "../common/index_tensors.h"
#include "merge.h"

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

// One warp per (token, query head) row.
template <typename QT>
__global__ void __launch_bounds__(kMergeWarps * 32) merge_splits_kernel(const AttnParams p) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kMergeWarps + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= static_cast<int64_t>(p.num_tokens) * p.num_q_heads) return;
  const int tok = static_cast<int>(row / p.num_q_heads);
  const int head = static_cast<int>(row % p.num_q_heads);
  QT* orow = static_cast<QT*>(p.out) + tok * p.o_stride_t + head * p.o_stride_h;
  if (tok >= cu_seqlens_at(p, p.num_seqs)) {
    for (int d = lane; d < p.head_dim; d += 32) orow[d] = from_float<QT>(0.f);
    return;
  }

  const int64_t split_stride = static_cast<int64_t>(p.num_tokens) * p.num_q_heads;
  // The attention sink (SPEC section 3) joins the denominator here, once, as one more term
  // 2^sink with no value (log2 units, like lse); without sinks it is 2^-inf = 0.
  const float sink = p.sinks != nullptr ? p.sinks[head] * kLog2e : -INFINITY;
  float lse_max = sink;
  for (int s = 0; s < p.num_splits; ++s) lse_max = fmaxf(lse_max, p.ws_lse[s * split_stride + row]);
  if (lse_max == -INFINITY) lse_max = 0.f;
  float wsum = exp2f(sink - lse_max);
  for (int s = 0; s < p.num_splits; ++s) wsum += exp2f(p.ws_lse[s * split_stride + row] - lse_max);
  const float inv = wsum > 0.f ? 1.f / wsum : 0.f;

  for (int d = lane; d < p.head_dim; d += 32) {
    float acc = 0.f;
    for (int s = 0; s < p.num_splits; ++s) {
      const float w = exp2f(p.ws_lse[s * split_stride + row] - lse_max);
      acc += w * p.ws_o[(s * split_stride + row) * p.head_dim + d];
    }
    orow[d] = from_float<QT>(acc * inv);
  }
}

}  // namespace

cudaError_t launch_merge(const AttnParams& p, int q_dtype, cudaStream_t stream) {
  const int64_t rows = static_cast<int64_t>(p.num_tokens) * p.num_q_heads;
  const dim3 grid(static_cast<unsigned>((rows + kMergeWarps - 1) / kMergeWarps));
  if (grid.x == 0) return cudaSuccess;
  if (q_dtype == kBF16) {
    merge_splits_kernel<__nv_bfloat16><<<grid, kMergeWarps * 32, 0, stream>>>(p);
  } else if (q_dtype == kFP16) {
    merge_splits_kernel<__half><<<grid, kMergeWarps * 32, 0, stream>>>(p);
  } else {
    return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace fp8nca
