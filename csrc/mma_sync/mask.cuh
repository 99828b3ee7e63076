// The attention mask on one S tile (SPEC section 3): a key past a row's last visible key gets
// -inf. Bidirectional rows see [0, kv_len); keys past kv_len are already excluded by the tile
// range and the zero-filled copy, so only tiles reaching past the CTA's smallest limit pay.
#pragma once

#include <cmath>

#include "tile_scheduler.cuh"

namespace fp8nca::mma_sync {

template <int kNT>
__device__ __forceinline__ void apply_mask(float (&s)[kNT][4], int n0, int block_n,
                                           const KeyRange& keys, const int (&limit)[2],
                                           const WarpRole& role, int lane) {
  if (n0 + block_n - 1 <= keys.min_limit) return;
  const int t = lane & 3;
#pragma unroll
  for (int j = 0; j < kNT; ++j) {
    if (j < role.j_lo || j >= role.j_hi) continue;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      // Accumulator e of n-tile j is row g + 8 (e >> 1), key 8j + 2t + (e & 1) (PTX ISA layout).
      const int key = n0 + 8 * j + 2 * t + (e & 1);
      if (key > limit[e >> 1]) s[j][e] = -INFINITY;
    }
  }
}

}  // namespace fp8nca::mma_sync
