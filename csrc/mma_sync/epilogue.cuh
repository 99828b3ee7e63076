// Epilogue of the mma.sync family: normalises O by the row sum (plus the attention sink, when
// given) and the per-head v_scale and writes it to `out` (one split) or to the split-KV
// workspace with its log-sum-exp (several splits, merged with the sink by
// csrc/cascade/merge.cu); and the padded rows past the last sequence, written as zeros. Unsplit,
// it also writes each row's natural-log LSE whenever ws_lse is set (FA3's epilogue_fwd.hpp: a
// branch on a pointer uniform over the launch), into ws_lse read as [num_tokens, num_q_heads]:
// asking for the LSE then costs no split, no second pass and no kernel of its own.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "softmax.cuh"
#include "tile_scheduler.cuh"
#include "traits.cuh"

namespace fp8nca::mma_sync {

// kTokenScales: the values were scaled per key in the dequantised tile, so no v_scale here.
template <int D, typename QT, bool kTokenScales>
__device__ __forceinline__ void store_output(const AttnParams& p, const WorkTile& w,
                                             const WarpRole& role, const RowState& st,
                                             const float (&o)[compute_shape(D).ot][4],
                                             float scale_log2, int lane) {
  constexpr TileShape S = compute_shape(D);
  const int g = lane >> 2;
  const int t = lane & 3;
  const float v_scale = kTokenScales ? 1.f : p.v_scale[w.kvh];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = w.row0 + 16 * role.wm + g + 8 * h;
    if (row >= w.rows) continue;
    const int tok = w.q_start + row / p.group;
    const int head = w.kvh * p.group + row % p.group;
    float l = st.l[h];
    float scale = v_scale;
    if (p.num_splits == 1 && p.sinks != nullptr) {
      // The sink joins the denominator (SPEC section 3): O / (l + 2^(sink - m)) in log2 units,
      // taken at m' = max(m, sink) so that neither term overflows, as O a / (l a + 2^(sink - m'))
      // with a = 2^(m - m'). Split, the merge adds it once instead (cascade/merge.cu). m is
      // finite: every row sees at least its own position.
      const float m = st.m[h] * scale_log2;
      const float sink = p.sinks[head] * kLog2e;
      const float m_sink = fmaxf(m, sink);
      const float a = ex2(m - m_sink);
      l = l * a + ex2(sink - m_sink);
      scale *= a;
    }
    const float inv = l > 0.f ? scale / l : 0.f;
    if (p.num_splits == 1) {
      QT* orow = static_cast<QT*>(p.out) + tok * p.o_stride_t + head * p.o_stride_h;
#pragma unroll
      for (int j = 0; j < S.ot; ++j) {
        // Accumulators 2h, 2h + 1 of n-tile j: dims out_dim(j, t), +1 of this row.
        const uint32_t packed = pack2<QT>(o[j][2 * h] * inv, o[j][2 * h + 1] * inv);
        QT* dst = orow + out_dim(j, t);
        if (p.out_align >= 4) {
          *reinterpret_cast<uint32_t*>(dst) = packed;
        } else {
          // An out tensor the caller allocated at an odd element offset: element stores.
          reinterpret_cast<uint16_t*>(dst)[0] = static_cast<uint16_t>(packed);
          reinterpret_cast<uint16_t*>(dst)[1] = static_cast<uint16_t>(packed >> 16);
        }
      }
      // FA3's convention: natural log, the sink inside, -inf where no key (and no sink) was
      // seen; a NaN l passes on as NaN. l is relative to max(m, sink) when a sink joined it
      // (recomputed here, off the path of the launches that ask for no LSE).
      if (t == 0 && p.ws_lse != nullptr) {
        const float m = st.m[h] * scale_log2;
        const float top = p.sinks != nullptr ? fmaxf(m, p.sinks[head] * kLog2e) : m;
        p.ws_lse[static_cast<int64_t>(tok) * p.num_q_heads + head] =
            l != 0.f ? (top + __log2f(l)) * kLn2 : -INFINITY;
      }
    } else {
      const int64_t ws_row =
          (static_cast<int64_t>(w.split) * p.num_tokens + tok) * p.num_q_heads + head;
      float* wrow = p.ws_o + ws_row * D;
#pragma unroll
      for (int j = 0; j < S.ot; ++j) {
        *reinterpret_cast<float2*>(wrow + out_dim(j, t)) =
            make_float2(o[j][2 * h] * inv, o[j][2 * h + 1] * inv);
      }
      // -inf marks a split that saw no key (l == 0: the merge skips it); a NaN l (a NaN in the
      // cache) gives a NaN lse, which the merge passes on as the unsplit path does.
      if (t == 0) p.ws_lse[ws_row] = l != 0.f ? st.m[h] * scale_log2 + __log2f(l) : -INFINITY;
    }
  }
}

// Rows [cu_seqlens_q[num_seqs], num_tokens) belong to no sequence (vLLM pads the batch under
// CUDA graphs): written as zeros (and, with ws_lse set, their LSE as -inf: an empty state), the
// bound read on the device. The CTAs of the grid's last z slice share them; used when there is
// one split (the merge kernel does it otherwise).
template <typename QT>
__device__ __forceinline__ void zero_padded_rows(const AttnParams& p) {
  const int first = cu_seqlens_at(p, p.num_seqs);
  const int64_t count = static_cast<int64_t>(p.num_tokens - first) * p.num_q_heads * p.head_dim;
  const int64_t step = static_cast<int64_t>(gridDim.x) * gridDim.y * blockDim.x;
  for (int64_t i = (static_cast<int64_t>(blockIdx.y) * gridDim.x + blockIdx.x) * blockDim.x +
                   threadIdx.x;
       i < count; i += step) {
    const int d = static_cast<int>(i % p.head_dim);
    const int64_t row = i / p.head_dim;
    const int head = static_cast<int>(row % p.num_q_heads);
    const int64_t tok = first + row / p.num_q_heads;
    reinterpret_cast<uint16_t*>(p.out)[tok * p.o_stride_t + head * p.o_stride_h + d] = 0;
    if (d == 0 && p.ws_lse != nullptr) p.ws_lse[tok * p.num_q_heads + head] = -INFINITY;
  }
}

}  // namespace fp8nca::mma_sync
