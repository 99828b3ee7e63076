// Mainloop of the mma.sync family: the Q fragments, the paged K/V tile copy (cp.async, 16-byte
// units, page ids read once per page and shared across the warp), and the two MMAs of a key
// tile, S = Q K^T and O += P V, on FP8 or 16-bit tiles dequantised in registers.
#pragma once

#include <cstdint>

#include <cute/arch/copy_sm80.hpp>

#include "tile_scheduler.cuh"
#include "traits.cuh"

namespace fp8nca::mma_sync {

// Q fragments for all D / 16 k-steps, permuted as the K fragments are (index_maps.h). They live
// in shared memory in fragment order (one 16-byte slot per lane and k-step, conflict-free
// reads); each thread reads back only what it wrote, so no barrier.
template <int D, typename QT, int KV>
__device__ __forceinline__ void load_q_fragments(const AttnParams& p, const WorkTile& w,
                                                 const WarpRole& role, int lane, uint4* q_frag) {
  constexpr TileShape S = Traits<D, QT, KV>::kS;
  const int g = lane >> 2;
  const int t = lane & 3;
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) q_frag[ks * 32] = make_uint4(0, 0, 0, 0);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row_raw = w.row0 + 16 * role.wm + g + 8 * h;
    const bool ok = row_raw < w.rows;
    const int row = min(row_raw, w.rows - 1);
    const QT* qrow = static_cast<const QT*>(p.q) + (w.q_start + row / p.group) * p.q_stride_t +
                     (w.kvh * p.group + row % p.group) * p.q_stride_h;
#pragma unroll
    for (int c = 0; c < S.groups; ++c) {
#pragma unroll
      for (int kk = 0; kk < S.steps_per_unit; ++kk) {
        const int dim = qk_dim(S, c, kk, t);
        const uint2 v = ok ? *reinterpret_cast<const uint2*>(qrow + dim) : make_uint2(0, 0);
        uint32_t* slot = reinterpret_cast<uint32_t*>(q_frag + (c * S.steps_per_unit + kk) * 32);
        slot[h] = v.x;
        slot[2 + h] = v.y;
      }
    }
  }
}

// Where the KV of one (sequence, KV head) lies.
struct KVSource {
  const uint8_t* k_head;  // key_cache + kv_head * stride_h, in bytes
  const uint8_t* v_head;
  const int32_t* bt_row;  // block_table row of the sequence
};

// Copies key tile `tile` (keys past n_keys zero-filled: they are masked, and zeros keep 0 * V
// finite) into one K and one V stage. Every thread of the CTA calls it (it shuffles).
template <int D, typename QT, int KV>
__device__ __forceinline__ void load_kv_tile(const AttnParams& p, const KVSource& src,
                                             int n_keys, int tile, uint8_t* ks, int tid) {
  constexpr TileShape S = Traits<D, QT, KV>::kS;
  uint8_t* vs = ks + S.block_n * S.k_row;
  const int lane = tid & 31;
  const int n0 = tile * S.block_n;
  // A tile spans at most block_n / 8 pages: lane l reads the page id of the tile's l-th page.
  const int first_page = n0 >> p.block_shift;
  int my_page = 0;
  if (lane < S.block_n / 8 && ((first_page + lane) << p.block_shift) < n_keys) {
    my_page = src.bt_row[(first_page + lane) * p.bt_stride_b];
  }
  const int in_page = p.block_size - 1;
#pragma unroll
  for (int i = 0; i < S.block_n * S.units / kThreads; ++i) {
    const int slot = tid + i * kThreads;
    const int r = copy_row(S, slot);
    const int u = copy_unit(S, slot);
    const int key = n0 + r;
    const bool ok = key < n_keys;
    const int64_t page = __shfl_sync(0xffffffffu, my_page, (key >> p.block_shift) - first_page);
    const uint8_t* ksrc = src.k_head;
    const uint8_t* vsrc = src.v_head;
    if (ok) {
      const int64_t off = key & in_page;
      ksrc += (page * p.k_stride_b + off * p.k_stride_s) * S.elt + u * 16;
      vsrc += (page * p.v_stride_b + off * p.v_stride_s) * S.elt + u * 16;
    }
    cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<uint4>::copy(
        *reinterpret_cast<const uint4*>(ksrc),
        *reinterpret_cast<uint4*>(ks + k_smem_offset(S, r, u)), ok);
    cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<uint4>::copy(
        *reinterpret_cast<const uint4*>(vsrc),
        *reinterpret_cast<uint4*>(vs + v_smem_offset(S, r, u)), ok);
  }
}

// S = Q K^T for this warp's 16 rows and its key group's n-tiles of one key tile.
template <int D, typename QT, int KV>
__device__ __forceinline__ void qk_tile(const uint8_t* ks, const uint4* q_frag,
                                        const WarpRole& role, int lane,
                                        float (&s)[Traits<D, QT, KV>::kS.nt][4]) {
  constexpr TileShape S = Traits<D, QT, KV>::kS;
#pragma unroll
  for (int j = 0; j < S.nt; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
  for (int c = 0; c < S.groups; ++c) {
    uint32_t qf[S.steps_per_unit][4];
#pragma unroll
    for (int kk = 0; kk < S.steps_per_unit; ++kk) {
      const uint4 q = q_frag[(c * S.steps_per_unit + kk) * 32];
      qf[kk][0] = q.x;
      qf[kk][1] = q.y;
      qf[kk][2] = q.z;
      qf[kk][3] = q.w;
    }
#pragma unroll
    for (int j = 0; j < S.nt; ++j) {
      if (j < role.j_lo || j >= role.j_hi) continue;
      const uint4 kr = *reinterpret_cast<const uint4*>(ks + k_frag_offset(S, j, c, lane));
      const uint32_t kw[4] = {kr.x, kr.y, kr.z, kr.w};
#pragma unroll
      for (int kk = 0; kk < S.steps_per_unit; ++kk) {
        uint32_t b0, b1;
        if constexpr (Traits<D, QT, KV>::kFp8) {
          b0 = fp8x2_to<KV, QT>(kw[kk] & 0xffffu);
          b1 = fp8x2_to<KV, QT>(kw[kk] >> 16);
        } else {
          b0 = half2_to<KV, QT>(kw[2 * kk]);
          b1 = half2_to<KV, QT>(kw[2 * kk + 1]);
        }
        mma16816(s[j], qf[kk], b0, b1, QT());
      }
    }
  }
}

// O += P V; P (already exponentiated in s) is the A operand: the S accumulators of n-tiles
// 2kk, 2kk+1 are the A fragment of k-step kk.
template <int D, typename QT, int KV>
__device__ __forceinline__ void pv_tile(const uint8_t* vs, const float (&s)[Traits<D, QT, KV>::kS.nt][4],
                                        const WarpRole& role, int lane,
                                        float (&o)[Traits<D, QT, KV>::kS.ot][4]) {
  constexpr TileShape S = Traits<D, QT, KV>::kS;
  using VT = PVType<QT, KV>;
#pragma unroll
  for (int kk = 0; kk < S.block_n / 16; ++kk) {
    if (2 * kk < role.j_lo || 2 * kk >= role.j_hi) continue;
    const uint32_t a[4] = {pack2<VT>(s[2 * kk][0], s[2 * kk][1]),
                           pack2<VT>(s[2 * kk][2], s[2 * kk][3]),
                           pack2<VT>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                           pack2<VT>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
    for (int J = 0; J < D / (8 * S.epw); ++J) {
      uint32_t w[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        w[i] = *reinterpret_cast<const uint32_t*>(vs + v_frag_offset(S, kk, J, lane, i));
      }
      if constexpr (Traits<D, QT, KV>::kFp8) {
#pragma unroll
        for (int i = 0; i < 4; i += 2) {
          // Bytes i of (w0, w1) and of (w2, w3) for n-tile i, bytes i+1 for n-tile i+1.
          const uint32_t x01 = prmt(w[0], w[1], fp8_pv_select(i));
          const uint32_t x23 = prmt(w[2], w[3], fp8_pv_select(i));
          mma16816(o[4 * J + i], a, fp8x2_to<KV, VT>(x01 & 0xffffu),
                   fp8x2_to<KV, VT>(x23 & 0xffffu), VT());
          mma16816(o[4 * J + i + 1], a, fp8x2_to<KV, VT>(x01 >> 16), fp8x2_to<KV, VT>(x23 >> 16),
                   VT());
        }
      } else {
#pragma unroll
        for (int n = 0; n < 2; ++n) {
          mma16816(o[2 * J + n], a, half2_to<KV, VT>(prmt(w[0], w[1], half_pv_select(n))),
                   half2_to<KV, VT>(prmt(w[2], w[3], half_pv_select(n))), VT());
        }
      }
    }
  }
}

}  // namespace fp8nca::mma_sync
