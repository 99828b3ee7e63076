// Online softmax of the mma.sync family (FlashAttention-2, fp32, log2 domain): per-token-head K
// scales on the score columns, the per-tile row update with O rescaled only when a row max of
// the warp moved, and the merge of the key groups that share one row warp's keys.
#pragma once

#include <cmath>
#include <cstdint>

#include "../common/device.cuh"
#include "tile_scheduler.cuh"

namespace fp8nca::mma_sync {

// 2^x with flush-to-zero (one MUFU.EX2; exp2f adds subnormal range handling around it). The
// arguments are <= 0 (max-subtracted) and results below 2^-126 are negligible next to the row's
// maximum term, which is 1.
__device__ __forceinline__ float ex2(float x) { return hw::ex2_approx_ftz(x); }

// Running state of this thread's two rows (g and g + 8 of its warp's 16).
struct RowState {
  float m[2];  // raw score max (before scale_log2); -inf while every key so far is masked
  float l[2];  // this thread's share of the row sum (reduced over the quad at the end)
};

// Per-token-head K scales: multiplies each score column of the warp's kNT n-tiles (from j0) by
// its key's k_scale, in fp32, before the mask and the row max: s_ij = (q_i . k_j) * k_scale_j.
// `stage_v` is the tile's V stage, which the scales follow (index_maps.h scale_smem_offset);
// lane (g, t) holds keys 8 (j0 + j) + 2t, + 1 of n-tile j (PTX ISA layout).
template <int kNT>
__device__ __forceinline__ void scale_key_columns(float (&s)[kNT][4], const uint8_t* stage_v,
                                                  const TileShape& shape, int j0, int lane) {
  const int t = lane & 3;
#pragma unroll
  for (int j = 0; j < kNT; ++j) {
    const int key = 8 * (j0 + j) + 2 * t;
    const float k0 = *reinterpret_cast<const float*>(stage_v + scale_smem_offset(shape, key, 0));
    const float k1 =
        *reinterpret_cast<const float*>(stage_v + scale_smem_offset(shape, key + 1, 0));
    s[j][0] *= k0;
    s[j][1] *= k1;
    s[j][2] *= k0;
    s[j][3] *= k1;
  }
}

// Exponentiates the warp's kNT n-tiles of one S tile in place (P = 2^(s * scale_log2 - m)),
// updates m and l, and rescales O when the max of any row of the warp moved. Rows are reduced
// over the 4 lanes of a quad.
template <int kNT, int kOT>
__device__ __forceinline__ void softmax_update(float (&s)[kNT][4], RowState& st,
                                               float (&o)[kOT][4], float scale_log2) {
  float alpha[2];
  bool moved = false;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < kNT; ++j) {
      mx = fmaxf(mx, fmaxf(s[j][2 * h], s[j][2 * h + 1]));
    }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(st.m[h], mx);
    // A row with every key masked so far keeps m = -inf; subtracting 0 keeps 2^x at 0.
    const float m_scaled = m_new == -INFINITY ? 0.f : m_new * scale_log2;
    const bool row_moved = m_new > st.m[h];
    alpha[h] = row_moved ? ex2(st.m[h] * scale_log2 - m_scaled) : 1.f;
    moved = moved || row_moved;
    st.m[h] = m_new;
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < kNT; ++j) {
      s[j][2 * h] = ex2(fmaf(s[j][2 * h], scale_log2, -m_scaled));
      s[j][2 * h + 1] = ex2(fmaf(s[j][2 * h + 1], scale_log2, -m_scaled));
      sum += s[j][2 * h] + s[j][2 * h + 1];
    }
    st.l[h] = st.l[h] * alpha[h] + sum;
  }
  // Once the maxima settle (after the first few tiles) the warp skips the rescale.
  if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
    for (int n = 0; n < kOT; ++n) {
      o[n][0] *= alpha[0];
      o[n][1] *= alpha[0];
      o[n][2] *= alpha[1];
      o[n][3] *= alpha[1];
    }
  }
}

// Full row sums: the quad's four partial sums.
__device__ __forceinline__ void reduce_row_sums(RowState& st) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    st.l[h] += __shfl_xor_sync(0xffffffffu, st.l[h], 1);
    st.l[h] += __shfl_xor_sync(0xffffffffu, st.l[h], 2);
  }
}

// Merges the key groups of each row warp into group 0 at the joint max, reusing the CTA's shared
// memory (`scratch`: Q fragments and KV stages, no longer read; at least
// (kWarps - 1) * 32 * kOT * 16 + kWarps * 128 bytes, kWarps the CTA's warps). Every
// thread of the CTA calls it (it has barriers). Returns false for the warps of groups 1.., which
// are done.
template <int kOT, int kWarps>
__device__ __forceinline__ bool merge_key_groups(float (&o)[kOT][4], RowState& st,
                                                 float scale_log2, const WarpRole& role,
                                                 uint8_t* scratch, int warp, int lane) {
  const int g = lane >> 2;
  const int t = lane & 3;
  float* o_buf = reinterpret_cast<float*>(scratch);
  float* ml_buf = o_buf + (kWarps - 1) * 32 * kOT * 4;
  __syncthreads();  // every warp is done reading Q and the KV stages
  if (t == 0) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      ml_buf[(warp * 16 + g + 8 * h) * 2] = st.m[h];
      ml_buf[(warp * 16 + g + 8 * h) * 2 + 1] = st.l[h];
    }
  }
  __syncthreads();
  float f[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float m_tot = -INFINITY;
    for (int gg = 0; gg < role.n_groups; ++gg) {
      m_tot = fmaxf(m_tot, ml_buf[((role.wm + gg * role.m_span) * 16 + g + 8 * h) * 2]);
    }
    const float m_scaled = m_tot == -INFINITY ? 0.f : m_tot * scale_log2;
    float l_tot = 0.f;
    for (int gg = 0; gg < role.n_groups; ++gg) {
      const float* ml = ml_buf + ((role.wm + gg * role.m_span) * 16 + g + 8 * h) * 2;
      l_tot += ml[1] * ex2(ml[0] * scale_log2 - m_scaled);
    }
    f[h] = ex2(st.m[h] * scale_log2 - m_scaled);
    st.m[h] = m_tot;
    st.l[h] = l_tot;
  }
  if (role.ng > 0 && role.active) {
    float* dst = o_buf + ((role.ng - 1) * role.m_span + role.wm) * 32 * kOT * 4 + lane;
#pragma unroll
    for (int n = 0; n < kOT; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) dst[(n * 4 + e) * 32] = o[n][e] * f[e >> 1];
    }
  }
  __syncthreads();
  if (role.ng > 0) return false;
#pragma unroll
  for (int n = 0; n < kOT; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) o[n][e] *= f[e >> 1];
  }
  for (int gg = 1; gg < role.n_groups; ++gg) {
    const float* src = o_buf + ((gg - 1) * role.m_span + role.wm) * 32 * kOT * 4 + lane;
#pragma unroll
    for (int n = 0; n < kOT; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) o[n][e] += src[(n * 4 + e) * 32];
    }
  }
  return true;
}

}  // namespace fp8nca::mma_sync
