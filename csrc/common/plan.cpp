#include "plan.h"

#include <algorithm>

#include "../mma_sync/index_maps.h"

namespace fp8nca {

int block_m_for(int head_dim, int cache_dtype, int64_t rows_per_kv_head) {
  const bool wide =
      rows_per_kv_head > mma_sync::kBlockM && cache_bytes(cache_dtype) == 1 && head_dim == 128;
  return wide ? mma_sync::kBlockMWide : mma_sync::kBlockM;
}

int choose_splits(int64_t ctas, int key_tiles, int num_seqs, int64_t resident_ctas) {
  const int max_splits = std::min({key_tiles / kMinTilesPerSplit, kMaxSplits,
                                   kMaxGridZ / std::max(num_seqs, 1)});
  if (ctas == 0 || ctas >= resident_ctas || max_splits <= 1) return 1;
  int best = 1;
  double best_fill = 0.0;
  for (int splits = 1; splits <= max_splits; ++splits) {
    const int64_t total = ctas * splits;
    const int64_t waves = (total + resident_ctas - 1) / resident_ctas;
    const double fill = static_cast<double>(total) / static_cast<double>(waves * resident_ctas);
    if (fill >= kWaveFill) return splits;
    if (fill > best_fill) {
      best = splits;
      best_fill = fill;
    }
  }
  return best;
}

int key_tiles_per_cta(const PlanInput& in, int block_m, int block_n) {
  const int64_t context_tiles = (std::max(in.max_seqlen_k, 1) + block_n - 1) / block_n;
  if (in.window_left < 0) return static_cast<int>(context_tiles);
  // A CTA's block_m rows hold at most (block_m - 1) / group + 2 consecutive tokens; its keys run
  // from the first one's position - left to the last one's position + right (+ 0 if causal),
  // and never past the context, whose last max_seqlen_q positions hold every query token.
  const int group = in.num_kv_heads > 0 ? std::max(in.num_q_heads / in.num_kv_heads, 1) : 1;
  const int64_t q_len = std::max(in.max_seqlen_q, 1);
  const int64_t tokens = std::min<int64_t>(q_len, (block_m - 1) / group + 2);
  const int64_t right = in.all_causal ? 0 : in.window_right;
  const int64_t keys = in.window_left + (right >= 0 ? std::min(q_len, tokens + right) : q_len);
  // An unaligned run of `keys` keys touches at most one tile more than an aligned one.
  return static_cast<int>(std::min(context_tiles, (keys + block_n - 2) / block_n + 1));
}

namespace {

// Query rows per KV head of the batch's longest sequence (R = max_seqlen_q x group).
int64_t rows_per_kv_head(const PlanInput& in) {
  const int group = in.num_kv_heads > 0 ? in.num_q_heads / in.num_kv_heads : 0;
  return static_cast<int64_t>(std::max(in.max_seqlen_q, 1)) * group;
}

int64_t row_tiles(const PlanInput& in, int block_m) {
  return (rows_per_kv_head(in) + block_m - 1) / block_m;
}

}  // namespace

int plan_splits(const PlanInput& in, int block_m, int block_n) {
  const int key_tiles = key_tiles_per_cta(in, block_m, block_n);
  const int64_t ctas =
      static_cast<int64_t>(in.num_seqs) * in.num_kv_heads * row_tiles(in, block_m);
  const int splits = in.num_splits > 0
                         ? in.num_splits
                         : choose_splits(ctas, key_tiles, in.num_seqs, in.resident_ctas);
  return std::max(1, std::min(splits, kMaxGridZ / std::max(in.num_seqs, 1)));
}

Plan make_plan(const PlanInput& in) {
  const int block_m = block_m_for(in.head_dim, in.cache_dtype, rows_per_kv_head(in));
  const mma_sync::TileShape shape =
      mma_sync::tile_shape(in.head_dim, cache_bytes(in.cache_dtype), block_m);
  Plan plan{};
  plan.block_m = shape.block_m;
  plan.block_n = shape.block_n;
  plan.threads = shape.threads;
  plan.smem_bytes = shape.smem;
  plan.m_tiles = static_cast<int>(row_tiles(in, plan.block_m));
  const int splits = plan_splits(in, plan.block_m, plan.block_n);
  plan.num_splits = splits;
  plan.grid_x = static_cast<unsigned>(plan.m_tiles);
  plan.grid_y = static_cast<unsigned>(in.num_kv_heads);
  // Unsplit, one more z slice zeroes the padded rows; split, the merge kernel does.
  plan.grid_z = static_cast<unsigned>(in.num_seqs * splits + (splits == 1 ? 1 : 0));
  if (splits > 1) {
    plan.ws_lse_elems = static_cast<int64_t>(splits) * in.num_tokens * in.num_q_heads;
    plan.ws_o_elems = plan.ws_lse_elems * in.head_dim;
  }
  return plan;
}

}  // namespace fp8nca
