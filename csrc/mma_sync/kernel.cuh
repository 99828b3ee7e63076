// The mma.sync kernel family (sm_89+): paged attention over an FP8 / BF16 / FP16 KV cache with a
// BF16 / FP16 query (SPEC section 3), composed from its parts:
//   tile_scheduler.cuh  which (sequence, KV head, M tile, split) a CTA computes, its key range
//   mainloop.cuh        Q fragments, the paged cp.async K/V tile copy, the once-per-CTA
//                       dequantisation of FP8 tiles to 16 bits, S = Q K^T and O += P V
//   mask.cuh            the mask (causal or bidirectional, sliding window) on an S tile
//   softmax.cuh         the online softmax and the merge of key groups
//   epilogue.cuh        O normalised (attention sinks joining the denominator) into `out`, or
//                       into the split-KV workspace; padded rows zeroed
// index_maps.h holds every index map (host and device), traits.cuh the per-variant constants.
// One CTA streams its split's KV range through shared memory, kStages deep; every warp runs
// mma.sync m16n8k16 with fp32 accumulation (FlashAttention-2). Warps the rows leave idle (a
// drafter's 8 tokens x group 4 fill two of four) take a share of every key tile instead. Two
// tiles of query rows (BM): 64 rows in 4 warps (paged_attention_kernel), and 128 rows in 8 warps
// (paged_attention_kernel_m128, FP8 caches, head_dim 128) so that R = 65..128 rows of a KV
// head stream and dequantise its KV once. Every kernel's unsplit epilogue writes each row's LSE
// when ws_lse is set (FA3's): no kernel of its own for it. The per-token-head kernels
// (paged_attention_kernel_pth, paged_attention_kernel_m128_pth: e4m3, e5m2 and int8 caches with
// a scale per key and KV head) are the same CTA with kTokenScales, in translation units of
// their own: each key's K scale multiplies its score column, each value's V scale its row of
// the dequantised value tile.
#pragma once

#include <atomic>
#include <cstdint>

#include "../common/device.cuh"
#include "epilogue.cuh"
#include "mainloop.cuh"
#include "mask.cuh"
#include "softmax.cuh"
#include "tile_scheduler.cuh"
#include "traits.cuh"

namespace fp8nca::mma_sync {

// The key-tile loop of one CTA: every warp copies and dequantises its share of each tile, and
// the warps holding rows compute S = Q K^T, the softmax and O += P V on their key group's kNG-th
// of the tile's n-tiles. kNG (the CTA's key-group count, key_groups()) is a template argument so
// that each warp's share is fixed at compile time: no per-n-tile guards, no predicated MMAs.
// `scales` (one ScaleSource, in the per-token-head kernels only) adds each key's scales.
template <int D, typename QT, int KV, int BM, int kNG, typename... Scales>
__device__ __forceinline__ void stream_keys(const AttnParams& p, const WorkTile& w,
                                            const WarpRole& role, const KVSource& src,
                                            const RowKeys (&row_range)[2], const uint4* q_frag,
                                            uint8_t* kv_smem, uint8_t* wide, int tid,
                                            float scale_log2,
                                            float (&o)[compute_shape(D).ot][4], RowState& st,
                                            const Scales&... scales) {
  constexpr bool kTokenScales = sizeof...(Scales) > 0;
  using T = Traits<D, QT, KV, BM>;
  constexpr TileShape S = T::kS;
  constexpr TileShape C = T::kC;
  constexpr int kNT = C.nt / kNG;  // n-tiles of each key tile this warp computes
  static_assert(C.nt % kNG == 0, "key groups must split the n-tiles evenly");
  const int lane = tid & 31;
  const int j0 = role.j_lo;

#pragma unroll
  for (int stage = 0; stage < S.stages - 1; ++stage) {
    if (w.tiles.begin + stage < w.tiles.end) {
      load_kv_tile<D, QT, KV, BM>(p, src, w.keys, w.tiles.begin + stage,
                                  kv_smem + stage * S.stage_bytes, tid, scales...);
    }
    hw::cp_async_fence();
  }

  for (int tile = w.tiles.begin; tile < w.tiles.end; ++tile) {
    const int it = tile - w.tiles.begin;
    hw::cp_async_wait<S.stages - 2>();
    __syncthreads();
    if (tile + S.stages - 1 < w.tiles.end) {
      load_kv_tile<D, QT, KV, BM>(p, src, w.keys, tile + S.stages - 1,
                                  kv_smem + ((it + S.stages - 1) % S.stages) * S.stage_bytes,
                                  tid, scales...);
    }
    hw::cp_async_fence();

    const uint8_t* stage = kv_smem + (it % S.stages) * S.stage_bytes;
    const uint8_t* ks = stage;
    if constexpr (T::kNarrow) {
      // Every warp, idle rows or not, dequantises its share once for the whole CTA; the
      // barrier at the loop's top keeps the 16-bit tile (and the stage's scales) until every
      // warp has used it.
      dequantize_tile<D, QT, KV, BM, kTokenScales>(ks, wide, tid);
      __syncthreads();
      ks = wide;
    }
    if (!role.active) continue;
    float s[kNT][4];
    qk_tile<D, QT, kNT>(ks, q_frag, j0, lane, s);
    if constexpr (kTokenScales) scale_key_columns(s, stage + S.block_n * S.k_row, S, j0, lane);
    apply_mask(s, tile * C.block_n, j0, w.keys, row_range, lane);
    softmax_update(s, st, o, scale_log2);
    pv_tile<D, PVOperand<QT, KV, kTokenScales>, kNT>(ks + C.block_n * C.k_row, s, j0, lane, o);
  }
  hw::cp_async_wait<0>();
}

// After the key loop: row sums, the merge of key groups (tiles that have them), the output.
template <int D, typename QT, int KV, int BM, bool kTokenScales>
__device__ __forceinline__ void finish_cta(const AttnParams& p, const WorkTile& w,
                                           const WarpRole& role, uint8_t* smem, float scale_log2,
                                           float (&o)[compute_shape(D).ot][4], RowState& st,
                                           int warp, int lane) {
  constexpr TileShape S = Traits<D, QT, KV, BM>::kS;
  constexpr TileShape C = Traits<D, QT, KV, BM>::kC;
  reduce_row_sums(st);
  if constexpr (C.max_key_groups > 1) {
    if (role.n_groups > 1) {
      static_assert((C.warps - 1) * 32 * C.ot * 4 * 4 + C.warps * 16 * 2 * 4 <= S.smem,
                    "key-group merge must fit in shared memory");
      if (!merge_key_groups<C.ot, C.warps>(o, st, scale_log2, role, smem, warp, lane)) return;
    }
  }
  if (!role.active) return;
  store_output<D, QT, kTokenScales>(p, w, role, st, o, scale_log2, lane);
}

// One CTA of either tile (BM query rows); the kernels below are its entry points. `ts`: the
// per-token-head kernels' PerTokenHeadScales mark, an empty pack in the others (which then
// hold no scale code), likewise the scale source handed down to stream_keys and load_kv_tile.
template <int D, typename QT, int KV, int BM, typename... TokenScales>
__device__ __forceinline__ void attention_cta(const AttnParams& p, TokenScales... ts) {
  constexpr bool kTokenScales = sizeof...(TokenScales) > 0;
  using T = Traits<D, QT, KV, BM>;
  constexpr TileShape S = T::kS;  // tiles as copied (the cache's format)
  constexpr TileShape C = T::kC;  // 16-bit tiles the MMAs read
  uint8_t* smem = hw::dynamic_smem<uint8_t>();
  if (blockIdx.z == p.num_seqs * p.num_splits) {
    zero_padded_rows<QT>(p);
    return;
  }
  WorkTile w;
  if (!schedule_tile<BM, C.block_n>(p, w)) return;

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const WarpRole role = warp_role<C.nt>(C, w, warp);
  // Keys each of this thread's two rows sees (rows past `rows` clamped; never stored).
  const int g = lane >> 2;
  RowKeys row_range[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = min(w.row0 + 16 * role.wm + g + 8 * h, w.rows - 1);
    row_range[h] = row_keys(w.window, w.causal, w.kv_len, w.q_len, row, p.group);
  }

  uint4* q_frag = reinterpret_cast<uint4*>(smem) + warp * (D / 16) * 32 + lane;
  uint8_t* kv_smem = smem + S.q_bytes;
  uint8_t* wide = kv_smem + S.stages * S.stage_bytes;  // the dequantised tile (1-byte caches)
  load_q_fragments<D, QT, KV>(p, w, role, lane, q_frag);

  const KVSource src{
      static_cast<const uint8_t*>(p.k) + w.kvh * p.k_stride_h * S.elt,
      static_cast<const uint8_t*>(p.v) + w.kvh * p.v_stride_h * S.elt,
      p.block_table + w.seq * p.bt_stride_s};

  float o[C.ot][4];
#pragma unroll
  for (int n = 0; n < C.ot; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  RowState st{{-INFINITY, -INFINITY}, {0.f, 0.f}};
  // Per-token-head K scales multiply the score columns instead (scale_key_columns).
  const float scale_log2 = kTokenScales
                               ? p.softmax_scale * 1.4426950408889634f
                               : p.softmax_scale * p.k_scale[w.kvh] * 1.4426950408889634f;

  // key_groups() gives 1, 2 or max_key_groups (always 1 in the 128-row tile); the branch is
  // uniform over the CTA. Each branch runs to the end (no merge point: the register allocation
  // of one does not constrain another).
  if constexpr (C.max_key_groups == 1) {
    stream_keys<D, QT, KV, BM, 1>(p, w, role, src, row_range, q_frag, kv_smem, wide, tid,
                                  scale_log2, o, st, scale_source(p, w.kvh, ts)...);
    finish_cta<D, QT, KV, BM, kTokenScales>(p, w, role, smem, scale_log2, o, st, warp, lane);
  } else if (role.n_groups == 1) {
    stream_keys<D, QT, KV, BM, 1>(p, w, role, src, row_range, q_frag, kv_smem, wide, tid,
                                  scale_log2, o, st, scale_source(p, w.kvh, ts)...);
    finish_cta<D, QT, KV, BM, kTokenScales>(p, w, role, smem, scale_log2, o, st, warp, lane);
  } else if (C.max_key_groups == 2 || role.n_groups == 2) {
    stream_keys<D, QT, KV, BM, 2>(p, w, role, src, row_range, q_frag, kv_smem, wide, tid,
                                  scale_log2, o, st, scale_source(p, w.kvh, ts)...);
    finish_cta<D, QT, KV, BM, kTokenScales>(p, w, role, smem, scale_log2, o, st, warp, lane);
  } else {
    stream_keys<D, QT, KV, BM, C.max_key_groups>(p, w, role, src, row_range, q_frag, kv_smem,
                                                 wide, tid, scale_log2, o, st,
                                                 scale_source(p, w.kvh, ts)...);
    finish_cta<D, QT, KV, BM, kTokenScales>(p, w, role, smem, scale_log2, o, st, warp, lane);
  }
}

// The 64-row tile: 4 warps.
template <int D, typename QT, int KV>
__global__ void __launch_bounds__(Traits<D, QT, KV>::kThreads, Traits<D, QT, KV>::kMinBlocks)
    paged_attention_kernel(const AttnParams p) {
  attention_cta<D, QT, KV, kBlockM>(p);
}

// The 128-row tile: 8 warps (1-byte caches, head_dim 128; plan.cpp block_m_for).
template <int D, typename QT, int KV>
__global__ void __launch_bounds__(Traits<D, QT, KV, kBlockMWide>::kThreads,
                                  Traits<D, QT, KV, kBlockMWide>::kMinBlocks)
    paged_attention_kernel_m128(const AttnParams p) {
  attention_cta<D, QT, KV, kBlockMWide>(p);
}

// The per-token-head kernels (k_scale / v_scale [num_blocks, block_size, num_kv_heads] through
// p's ks_stride_* / vs_stride_*).
template <int D, typename QT, int KV>
__global__ void __launch_bounds__(Traits<D, QT, KV>::kThreads, Traits<D, QT, KV>::kMinBlocks)
    paged_attention_kernel_pth(const AttnParams p) {
  attention_cta<D, QT, KV, kBlockM>(p, PerTokenHeadScales{});
}

template <int D, typename QT, int KV>
__global__ void __launch_bounds__(Traits<D, QT, KV, kBlockMWide>::kThreads,
                                  Traits<D, QT, KV, kBlockMWide>::kMinBlocks)
    paged_attention_kernel_m128_pth(const AttnParams p) {
  attention_cta<D, QT, KV, kBlockMWide>(p, PerTokenHeadScales{});
}

// The kernel of tile BM: the per-head one or the per-token-head one.
template <int D, typename QT, int KV, int BM, bool kTokenScales>
constexpr auto kernel_of() {
  // if constexpr throughout: a kernel named in a discarded branch is not instantiated.
  if constexpr (BM == kBlockM && kTokenScales) {
    return &paged_attention_kernel_pth<D, QT, KV>;
  } else if constexpr (BM == kBlockM) {
    return &paged_attention_kernel<D, QT, KV>;
  } else if constexpr (kTokenScales) {
    return &paged_attention_kernel_m128_pth<D, QT, KV>;
  } else {
    return &paged_attention_kernel_m128<D, QT, KV>;
  }
}

// Raises the kernel's dynamic shared-memory limit, once per device (on the first, eager call,
// so that graph capture sees only launches).
template <int D, typename QT, int KV, int BM, bool kTokenScales>
cudaError_t prepare_kernel() {
  constexpr TileShape S = Traits<D, QT, KV, BM>::kS;
  if (S.smem <= 48 * 1024) return cudaSuccess;
  static std::atomic<uint64_t> raised{0};
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  const uint64_t bit = uint64_t{1} << (device & 63);
  if (raised.load(std::memory_order_acquire) & bit) return cudaSuccess;
  err = cudaFuncSetAttribute(kernel_of<D, QT, KV, BM, kTokenScales>(),
                             cudaFuncAttributeMaxDynamicSharedMemorySize, S.smem);
  if (err == cudaSuccess) raised.fetch_or(bit, std::memory_order_acq_rel);
  return err;
}

// Launches the kernel of tile BM on `grid` (from the plan, csrc/common/plan.h), or with
// `ctas_per_sm` set only reports how many of its CTAs fit on one SM of the current device.
template <int D, typename QT, int KV, int BM, bool kTokenScales>
cudaError_t launch(const AttnParams& p, dim3 grid, cudaStream_t stream, int* ctas_per_sm) {
  using T = Traits<D, QT, KV, BM>;
  constexpr auto kernel = kernel_of<D, QT, KV, BM, kTokenScales>();
  const cudaError_t err = prepare_kernel<D, QT, KV, BM, kTokenScales>();
  if (err != cudaSuccess) return err;
  if (ctas_per_sm != nullptr) {
    return cudaOccupancyMaxActiveBlocksPerMultiprocessor(ctas_per_sm, kernel, T::kThreads,
                                                         T::kS.smem);
  }
  FP8NCA_LAUNCH(kernel, grid, T::kThreads, T::kS.smem, stream, p);
  return cudaGetLastError();
}

// The launch for `block_m` (the plan's): the 128-row tile exists for 1-byte caches at head_dim
// 128 only (plan.cpp block_m_for); kTokenScales: the per-token-head kernel.
template <int D, typename QT, int KV, bool kTokenScales = false>
cudaError_t launch_tile(const AttnParams& p, dim3 grid, int block_m, cudaStream_t stream,
                        int* ctas_per_sm) {
  if (block_m == kBlockM) {
    return launch<D, QT, KV, kBlockM, kTokenScales>(p, grid, stream, ctas_per_sm);
  }
  if constexpr (Traits<D, QT, KV>::kNarrow && D == 128) {
    if (block_m == kBlockMWide) {
      return launch<D, QT, KV, kBlockMWide, kTokenScales>(p, grid, stream, ctas_per_sm);
    }
  }
  return cudaErrorInvalidValue;
}

}  // namespace fp8nca::mma_sync

