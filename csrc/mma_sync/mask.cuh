// The attention mask on one S tile (SPEC section 3): a key outside a row's visible range
// [lo, hi] (the causal or bidirectional bound and the sliding window, index_maps.h row_keys)
// gets -inf. Keys outside the CTA's visible range (past its last visible key, before a window's
// first) are zero-filled by the copy, and tiles outside its window are never loaded, so only the
// tiles that some row sees in part pay (the partial last tile of a bidirectional row; the
// diagonal of a causal one; a window's edges).
#pragma once

#include <cmath>

#include "tile_scheduler.cuh"

namespace fp8nca::mma_sync {

// s holds a warp's kNT n-tiles j0 .. j0 + kNT - 1 (its key group's share) of the key tile that
// starts at key n0.
template <int kNT>
__device__ __forceinline__ void apply_mask(float (&s)[kNT][4], int n0, int j0,
                                           const KeyRange& keys, const RowKeys (&row)[2],
                                           int lane) {
  if (!tile_needs_mask(keys, n0)) return;
  const int t = lane & 3;
#pragma unroll
  for (int j = 0; j < kNT; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      // Accumulator e of n-tile j0 + j is row g + 8 (e >> 1), key 8 (j0 + j) + 2t + (e & 1)
      // (PTX ISA layout).
      const int key = n0 + 8 * (j0 + j) + 2 * t + (e & 1);
      if (!key_visible(row[e >> 1], key)) s[j][e] = -INFINITY;
    }
  }
}

}  // namespace fp8nca::mma_sync
