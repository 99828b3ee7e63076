// The plan: tiles, split-KV count, grid and workspace of one batch, decided on the host from
// host-side sizes only (no device read), like FlashAttention-3's get_scheduler_metadata. The
// CUDA backend calls it through python/bindings.cpp and passes its num_splits back to the
// launch; each CTA still derives its own key range from the device-side seq_lens, so a plan made
// for max_seqlen_k holds for any shorter real lengths. The split-KV rule (key_tiles_per_cta,
// choose_splits) is the one planner of every CUDA kernel family: the CUTLASS-DSL families call
// it through _C too, with their own tile sizes.
#pragma once

#include <cstdint>

#include "params.h"

namespace fp8nca {

// Grid z is sequences x splits (+ 1 slice for the padded rows when unsplit): at most 65535.
constexpr int kMaxGridZ = 65535;
constexpr int kMaxSeqs = kMaxGridZ - 1;
constexpr int kMaxSplits = 32;
// A split should stream at least this many key tiles, or the merge costs more than it saves.
constexpr int kMinTilesPerSplit = 4;
// Split-KV takes the fewest splits whose CTAs fill the resident slots (CTAs per SM x SMs) in
// whole waves to at least this fraction: a last wave left mostly empty idles most SMs.
constexpr double kWaveFill = 0.9;

struct PlanInput {
  int num_seqs = 0, num_tokens = 0, num_q_heads = 0, num_kv_heads = 0, head_dim = 0;
  int cache_dtype = kE4M3;
  int max_seqlen_q = 0, max_seqlen_k = 0;
  // The sliding window (-1 = unbounded side) and whether every sequence is causal (a launch-wide
  // flag; per-sequence flags live on the device, so a plan assumes bidirectional): the split
  // count is sized from the keys a CTA's window spans, not the whole context.
  int window_left = -1, window_right = -1;
  bool all_causal = false;
  int64_t resident_ctas = 0;  // the kernel's CTAs resident on the whole GPU (occupancy x SMs)
  int num_splits = 0;         // > 0 forces the split count (tests), clamped to what fits
};

struct Plan {
  int block_m, block_n;       // query rows and keys per tile
  int threads, smem_bytes;    // per CTA
  int m_tiles, num_splits;
  unsigned grid_x, grid_y, grid_z;
  int64_t ws_o_elems;    // fp32 partial O [num_splits, num_tokens, num_q_heads, head_dim]
  int64_t ws_lse_elems;  // fp32 LSE [num_splits, num_tokens, num_q_heads]; both 0 unsplit
};

// Query rows per CTA for R = q_len x group rows per KV head (the batch's longest): the 128-row
// tile (one KV pass, the 1-byte tile dequantised once) when R > 64 on a 1-byte cache (FP8, or
// int8 with per-token-head scales) at head_dim 128, else 64. Not compiled for the others: at head_dim 64 the 8-warp CTA takes 168-186 registers,
// so one CTA (8 warps) per SM where the 64-row tile keeps three (12 warps), and it would add
// ~5% to the build; head_dim 256's would not fit the 99 KB of shared memory of sm_89 / sm_120;
// 16-bit caches have no dequantisation to share.
int block_m_for(int head_dim, int cache_dtype, int64_t rows_per_kv_head);

// The split count the planner picks: 1 unless (sequences x KV heads x M tiles) CTAs leave the
// resident slots underused, else the fewest splits filling whole waves to kWaveFill.
int choose_splits(int64_t ctas, int key_tiles, int num_seqs, int64_t resident_ctas);

// Key tiles one CTA streams at most: those of max_seqlen_k, or, under a window bounded on the
// left, those of left + the CTA's tokens + right (the right side capped by the context's end).
int key_tiles_per_cta(const PlanInput& in, int block_m, int block_n);

// The split-KV count of CTAs holding block_m query rows of one KV head that stream keys in
// tiles of block_n: in.num_splits when forced, else choose_splits over the batch's CTAs and the
// key tiles one CTA streams; never more than the grid's z holds.
int plan_splits(const PlanInput& in, int block_m, int block_n);

// The whole plan. Needs no GPU.
Plan make_plan(const PlanInput& in);

}  // namespace fp8nca
