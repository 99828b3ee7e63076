// Mainloop of the mma.sync family: the Q fragments, the paged K/V tile copy (cp.async, 16-byte
// units, page ids read once per page and shared across the warp; per-token-head scales copied
// with their keys), the once-per-CTA dequantisation of a 1-byte tile to 16 bits, and the two
// MMAs of a key tile, S = Q K^T and O += P V.
#pragma once

#include <cstdint>

#include "../common/device.cuh"
#include "tile_scheduler.cuh"
#include "traits.cuh"

namespace fp8nca::mma_sync {

// Q fragments for all D / 16 k-steps, permuted as the K fragments are (index_maps.h; and within
// groups of 4 dims as fp8_bits.h bf16_k_dim where K is dequantised by bit moves). They live in
// shared memory in fragment order (one 16-byte slot per lane and k-step, conflict-free reads);
// each thread reads back only what it wrote, so no barrier.
template <int D, typename QT, int KV>
__device__ __forceinline__ void load_q_fragments(const AttnParams& p, const WorkTile& w,
                                                 const WarpRole& role, int lane, uint4* q_frag) {
  constexpr TileShape S = compute_shape(D);
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
        uint2 v = make_uint2(0, 0);
        if constexpr (bit_dequant_k(kQDtype<QT>, KV)) {
          // Positions dim .. dim + 3 hold head dims bf16_k_dim(dim + 0..3), as K's do.
          const uint16_t* q16 = reinterpret_cast<const uint16_t*>(qrow);
          if (ok) {
            v = make_uint2(q16[bf16_k_dim(dim)] | uint32_t{q16[bf16_k_dim(dim + 1)]} << 16,
                           q16[bf16_k_dim(dim + 2)] | uint32_t{q16[bf16_k_dim(dim + 3)]} << 16);
          }
        } else if (ok) {
          v = *reinterpret_cast<const uint2*>(qrow + dim);
        }
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

// The per-token-head kernels' mark: attention_cta, handed one, copies each key's K and V scale
// with its tile (read through p's ks_stride_* / vs_stride_*).
struct PerTokenHeadScales {};

// Where one KV head's per-token-head scales lie (the per-token-head kernels): k_scale + kv_head
// * ks_stride_h, and the block and slot strides (elements).
struct ScaleSource {
  const float* k_head;
  const float* v_head;
  int64_t k_stride_b, k_stride_s, v_stride_b, v_stride_s;
};

__device__ __forceinline__ ScaleSource scale_source(const AttnParams& p, int kvh,
                                                    PerTokenHeadScales) {
  return ScaleSource{p.k_scale + kvh * p.ks_stride_h, p.v_scale + kvh * p.vs_stride_h,
                     p.ks_stride_b, p.ks_stride_s, p.vs_stride_b, p.vs_stride_s};
}

// Copies key row `tid`'s K and V scale (zero outside `keys`, as load_kv_tile's data) of the
// key tile from key n0 into the stage's scales past the V tile (index_maps.h
// scale_smem_offset). Threads below block_n, whole warps (it shuffles the page id from
// `my_page`, as load_kv_tile does).
template <int D, typename QT, int KV, int BM>
__device__ __forceinline__ void load_scales(const AttnParams& p, const ScaleSource& scales,
                                            int my_page, int n0, const KeyRange& keys,
                                            uint8_t* vs, int tid) {
  constexpr TileShape S = Traits<D, QT, KV, BM>::kS;
  static_assert(S.block_n % 32 == 0 && S.block_n <= S.threads, "one scale row per thread");
  if (tid >= S.block_n) return;
  const int r = tid;
  const bool ok = key_in_range(keys, n0 + r);
  const int64_t page = __shfl_sync(0xffffffffu, my_page, tile_page(r, p.block_shift));
  const float* kscale = scales.k_head;
  const float* vscale = scales.v_head;
  if (ok) {
    const int64_t off = page_key(n0, r, p.block_size);
    kscale += page * scales.k_stride_b + off * scales.k_stride_s;
    vscale += page * scales.v_stride_b + off * scales.v_stride_s;
  }
  hw::cp_async_ca(reinterpret_cast<float*>(vs + scale_smem_offset(S, r, 0)), kscale, ok);
  hw::cp_async_ca(reinterpret_cast<float*>(vs + scale_smem_offset(S, r, 1)), vscale, ok);
}

// Copies key tile `tile` into one K and one V stage, and with `scales` (the per-token-head
// kernels) each key's K and V scale (load_scales). Keys outside `keys` (past the CTA's last
// visible key, or before a window's first key in the window's first tile) are zero-filled,
// never read: their slots may never have been written (SPEC section 5; vLLM points the pages
// before a window at a null page that may hold NaN), and their -inf scores give P = 0, which
// only zeros keep from 0 * NaN = NaN in P V. The page ids of pages past the last key are not
// read either (they may lie past the block table's row); those before the window are (the
// row holds them), but no address is formed from them. Every thread of the CTA calls it (it
// shuffles).
template <int D, typename QT, int KV, int BM, typename... Scales>
__device__ __forceinline__ void load_kv_tile(const AttnParams& p, const KVSource& src,
                                             const KeyRange& keys, int tile, uint8_t* ks,
                                             int tid, const Scales&... scales) {
  constexpr TileShape S = Traits<D, QT, KV, BM>::kS;
  uint8_t* vs = ks + S.block_n * S.k_row;
  const int lane = tid & 31;
  const int n0 = tile * S.block_n;
  // A tile spans at most block_n / 8 pages: lane l reads the page id of the tile's l-th page.
  const int first_page = n0 >> p.block_shift;
  int my_page = 0;
  if (lane < S.block_n / 8 && ((first_page + lane) << p.block_shift) < keys.n_keys) {
    my_page = src.bt_row[(first_page + lane) * p.bt_stride_b];
  }
  const int r0 = copy_row(S, tid);
  const int u = copy_unit(S, tid);
#pragma unroll
  for (int i = 0; i < copy_slots(S); ++i) {
    const int r = r0 + i * copy_row_step(S);  // copy_row(S, tid + i * S.threads)
    const int key = n0 + r;
    const bool ok = key_in_range(keys, key);
    const int64_t page = __shfl_sync(0xffffffffu, my_page, tile_page(r, p.block_shift));
    const uint8_t* ksrc = src.k_head;
    const uint8_t* vsrc = src.v_head;
    if (ok) {
      const int64_t off = page_key(n0, r, p.block_size);
      ksrc += (page * p.k_stride_b + off * p.k_stride_s) * S.elt + u * 16;
      vsrc += (page * p.v_stride_b + off * p.v_stride_s) * S.elt + u * 16;
    }
    hw::cp_async_cg_16(ks + k_smem_offset(S, r, u), ksrc, ok);
    hw::cp_async_cg_16(vs + v_smem_offset(S, r, u), vsrc, ok);
  }
  (load_scales<D, QT, KV, BM>(p, scales, my_page, n0, keys, vs, tid), ...);
}

// Dequantises the 1-byte K and V tile of one stage, once for the whole CTA (every thread
// converts its share: one 16-byte unit of K and of V per copy slot), into the 16-bit tile the
// MMAs read: K to the query dtype, exactly (fp8x4_to, fp8_bits.h; int8 values are 16-bit
// values too), V to the P V operand dtype, exactly, or with kTokenScales times its key's scale
// in fp32, rounded once (PVOperand).
template <int D, typename QT, int KV, int BM, bool kTokenScales>
__device__ __forceinline__ void dequantize_tile(const uint8_t* ks8, uint8_t* k16, int tid) {
  constexpr TileShape S = Traits<D, QT, KV, BM>::kS;
  constexpr TileShape C = Traits<D, QT, KV, BM>::kC;
  using VT = PVOperand<QT, KV, kTokenScales>;
  const uint8_t* vs8 = ks8 + S.block_n * S.k_row;
  uint8_t* v16 = k16 + C.block_n * C.k_row;
  const int r0 = copy_row(S, tid);
  const int u = copy_unit(S, tid);
#pragma unroll
  for (int i = 0; i < copy_slots(S); ++i) {
    const int r = r0 + i * copy_row_step(S);  // copy_row(S, tid + i * S.threads)
    const uint4 k = *reinterpret_cast<const uint4*>(ks8 + k_smem_offset(S, r, u));
    const uint4 v = *reinterpret_cast<const uint4*>(vs8 + v_smem_offset(S, r, u));
    const uint32_t kw[4] = {k.x, k.y, k.z, k.w};
    const uint32_t vw[4] = {v.x, v.y, v.z, v.w};
    uint32_t kx[8], vx[8];
    if constexpr (bit_dequant_k(kQDtype<QT>, KV)) {
      // K by bit moves (fp8_bits.h), dims in bf16_k_dim order; a unit holding an Inf or NaN
      // (a cache written from finite values has none) takes the hardware conversion instead,
      // in the same order, so they stay Inf and NaN.
      const uint32_t special = fp8x4_special_bits(kw[0], KV) | fp8x4_special_bits(kw[1], KV) |
                               fp8x4_special_bits(kw[2], KV) | fp8x4_special_bits(kw[3], KV);
      if (special == 0) {
#pragma unroll
        for (int w = 0; w < 4; ++w) {
          kx[2 * w] = bf16x2_unscale<KV>(fp8x4_even_to_bf16x2_scaled(kw[w], KV));
          kx[2 * w + 1] = bf16x2_unscale<KV>(fp8x4_odd_to_bf16x2_scaled(kw[w], KV));
        }
      } else {
#pragma unroll
        for (int w = 0; w < 4; ++w) {
          kx[2 * w] = fp8x2_to<KV, QT>(__byte_perm(kw[w], 0, 0x20));      // bytes 0, 2
          kx[2 * w + 1] = fp8x2_to<KV, QT>(__byte_perm(kw[w], 0, 0x31));  // bytes 1, 3
        }
      }
    } else if constexpr (KV == kI8) {
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        int8x4_to_f16x2(kw[w], kx[2 * w], kx[2 * w + 1]);
        kx[2 * w] = f16x2_to<QT>(kx[2 * w]);
        kx[2 * w + 1] = f16x2_to<QT>(kx[2 * w + 1]);
      }
    } else {
#pragma unroll
      for (int w = 0; w < 4; ++w) fp8x4_to<KV, QT>(kw[w], kx[2 * w], kx[2 * w + 1]);
    }
    if constexpr (kTokenScales) {
      const float scale = *reinterpret_cast<const float*>(vs8 + scale_smem_offset(S, r, 1));
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        narrow_x4_to_f16x2<KV>(vw[w], vx[2 * w], vx[2 * w + 1]);
        vx[2 * w] = scaled_f16x2_to<VT>(vx[2 * w], scale);
        vx[2 * w + 1] = scaled_f16x2_to<VT>(vx[2 * w + 1], scale);
      }
    } else {
#pragma unroll
      for (int w = 0; w < 4; ++w) fp8x4_to<KV, VT>(vw[w], vx[2 * w], vx[2 * w + 1]);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      *reinterpret_cast<uint4*>(k16 + k_smem_offset(C, r, wide_unit(u, h))) =
          make_uint4(kx[4 * h], kx[4 * h + 1], kx[4 * h + 2], kx[4 * h + 3]);
      *reinterpret_cast<uint4*>(v16 + v_smem_offset(C, r, wide_unit(u, h))) =
          make_uint4(vx[4 * h], vx[4 * h + 1], vx[4 * h + 2], vx[4 * h + 3]);
    }
  }
}

// S = Q K^T for this warp's 16 rows and its key group's kNT n-tiles (j0 .. j0 + kNT - 1) of one
// 16-bit key tile (QT).
template <int D, typename QT, int kNT>
__device__ __forceinline__ void qk_tile(const uint8_t* ks, const uint4* q_frag, int j0, int lane,
                                        float (&s)[kNT][4]) {
  constexpr TileShape C = compute_shape(D);
#pragma unroll
  for (int j = 0; j < kNT; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
  for (int c = 0; c < C.groups; ++c) {
    uint32_t qf[C.steps_per_unit][4];
#pragma unroll
    for (int kk = 0; kk < C.steps_per_unit; ++kk) {
      const uint4 q = q_frag[(c * C.steps_per_unit + kk) * 32];
      qf[kk][0] = q.x;
      qf[kk][1] = q.y;
      qf[kk][2] = q.z;
      qf[kk][3] = q.w;
    }
#pragma unroll
    for (int j = 0; j < kNT; ++j) {
      const uint4 kr = *reinterpret_cast<const uint4*>(ks + k_frag_offset(C, j0 + j, c, lane));
      const uint32_t kw[4] = {kr.x, kr.y, kr.z, kr.w};
#pragma unroll
      for (int kk = 0; kk < C.steps_per_unit; ++kk) {
        mma16816(s[j], qf[kk], kw[2 * kk], kw[2 * kk + 1], QT());
      }
    }
  }
}

// O += P V on one 16-bit value tile (VT) for the key group's kNT n-tiles from j0; P (already
// exponentiated in s) is the A operand: the S accumulators of n-tiles 2kk, 2kk+1 are the A
// fragment of k-step kk. The V operand comes straight from shared memory, transposed by
// ldmatrix (index_maps.h v_ldsm_offset). v_ldsm_offset is a lane part plus a (kk, jp) part
// (tests/test_cuda_kernel_emulation.py checks it), so the lane's row address is formed once
// and every ldmatrix takes its (kk, jp) offset as an immediate.
template <int D, typename VT, int kNT>
__device__ __forceinline__ void pv_tile(const uint8_t* vs, const float (&s)[kNT][4], int j0,
                                        int lane, float (&o)[compute_shape(D).ot][4]) {
  constexpr TileShape C = compute_shape(D);
  static_assert(kNT % 2 == 0, "a key group holds whole P V k-steps");
  const uint32_t lane_addr =
      hw::shared_address(vs + (j0 / 2) * v_ldsm_offset(C, 1, 0, 0)) +
      v_ldsm_offset(C, 0, 0, lane);
#pragma unroll
  for (int kk = 0; kk < kNT / 2; ++kk) {
    const uint32_t a[4] = {pack2<VT>(s[2 * kk][0], s[2 * kk][1]),
                           pack2<VT>(s[2 * kk][2], s[2 * kk][3]),
                           pack2<VT>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                           pack2<VT>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
    for (int jp = 0; jp < C.ot / 2; ++jp) {
      uint32_t b[4];
      hw::ldmatrix_x4_trans(b, lane_addr + v_ldsm_offset(C, kk, jp, 0));
      mma16816(o[2 * jp], a, b[0], b[1], VT());
      mma16816(o[2 * jp + 1], a, b[2], b[3], VT());
    }
  }
}

}  // namespace fp8nca::mma_sync
