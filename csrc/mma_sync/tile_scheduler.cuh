// Work decomposition of the mma.sync family: which (sequence, KV head, M tile, split) a CTA
// computes, its key range derived on the device from the real sequence lengths and the sliding
// window (only the key tiles the window touches are split and loaded), and how its
// warps share rows and keys. The grid is (M tiles, KV heads, sequences x splits [+ 1]); the
// optional last z slice writes the padded rows (see epilogue.cuh).
#pragma once

#include <cstdint>

#include "../common/index_tensors.h"
#include "../common/params.h"
#include "index_maps.h"

namespace fp8nca::mma_sync {

// One CTA's share of the work.
struct WorkTile {
  int seq, kvh, split;
  int q_start, q_len, kv_len;
  bool causal;
  Window window;
  int rows;              // query rows of this KV head in the sequence (q_len x group)
  int row0;              // first row of the CTA's M tile
  int rows_in_tile;
  KeyRange keys;         // keys any row of the CTA sees (mask and window combined)
  TileRange tiles;       // key tiles of this split, inside the window
};

// Fills `w` for this CTA; false when its M tile lies past the sequence's rows.
template <int kRows, int kBlockN>
__device__ __forceinline__ bool schedule_tile(const AttnParams& p, WorkTile& w) {
  w.kvh = blockIdx.y;
  w.seq = blockIdx.z / p.num_splits;
  w.split = blockIdx.z % p.num_splits;
  w.q_start = cu_seqlens_at(p, w.seq);
  w.q_len = cu_seqlens_at(p, w.seq + 1) - w.q_start;
  w.rows = w.q_len * p.group;
  w.row0 = blockIdx.x * kRows;
  if (w.row0 >= w.rows) return false;
  w.rows_in_tile = min(kRows, w.rows - w.row0);
  w.kv_len = seq_len_at(p, w.seq);
  w.causal = seq_is_causal(p, w.seq);
  w.window = Window{p.window_left, p.window_right};
  w.keys = cta_keys(w.window, w.causal, w.kv_len, w.q_len, w.row0, w.row0 + w.rows_in_tile - 1,
                    p.group, kBlockN);
  w.tiles = split_tiles(cta_tiles(w.keys, kBlockN), p.num_splits, w.split);
  return true;
}

// A warp's role: which 16 rows it holds (row warp wm) and which n-tiles of every key tile
// (key group ng) it computes.
struct WarpRole {
  int wm, ng, n_groups, m_span, j_lo, j_hi;
  bool active;  // its rows exist
};

template <int kNT>
__device__ __forceinline__ WarpRole warp_role(const TileShape& s, const WorkTile& w, int warp) {
  WarpRole r;
  r.n_groups = key_groups(s, w.rows_in_tile);
  r.m_span = s.warps / r.n_groups;
  r.wm = warp % r.m_span;
  r.ng = warp / r.m_span;
  r.j_lo = r.ng * (kNT / r.n_groups);
  r.j_hi = r.j_lo + kNT / r.n_groups;
  r.active = w.row0 + 16 * r.wm < w.rows;
  return r;
}

}  // namespace fp8nca::mma_sync
