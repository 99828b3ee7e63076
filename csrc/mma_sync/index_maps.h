// Tile shapes and index maps of the mma.sync family, as FP8NCA_HD functions: the kernels call
// them, and so do the plan function and the CPU emulation test (through tests/ext/host_hooks.cpp),
// so the host replays the kernels' own data movement rather than a copy of it.
//
// Layout (see kernel.cuh): one CTA = (M tile of query rows, KV head, sequence x KV split); row r
// of the M tile is query token r / group, query head r % group of the KV head. block_m / 16 warps
// own 16 rows each and run mma.sync m16n8k16. Tiles are copied to shared memory in the cache's own
// format; an FP8 tile is then dequantised once per CTA, by every thread, into a 16-bit tile (16
// bytes of FP8 = units 2u, 2u + 1 of the 16-bit row), and the MMAs read 16-bit tiles only, with
// wide loads that permute reduction and output indices without changing the result:
//  * S = Q K^T: thread t of a quad loads 16 bytes of one key row (e = 8 elements) and feeds them
//    to 2 consecutive mma k-steps; in each step its four B values (logical k = 2t, 2t+1, 2t+8,
//    2t+9) are four adjacent head dims. The Q fragment is loaded with the same map.
//  * O = P V: one ldmatrix.x4.trans per k-step and pair of output n-tiles loads the V operand
//    (8x8 blocks of the row-major V tile, transposed: lane (g, t) gets keys 2t, 2t + 1 of head
//    dim g); output n-tile j is head dims 8j .. 8j + 7 and lane (g, t) owns dims 8j + 2t, +1.
// K rows are XOR-swizzled in 16-byte units and 16-bit V rows padded by 16 bytes so both read
// patterns are free of bank conflicts; a 1-byte stage ends with its keys' per-token-head scales.
#pragma once

#include "../common/host_device.h"

namespace fp8nca::mma_sync {

// Query rows per CTA: 64 (4 warps), or 128 (8 warps) where R = q_len x group exceeds 64 rows of
// an FP8 cache, so that one CTA streams and dequantises the KV once for all R rows instead of
// two 64-row CTAs doing it twice (plan.cpp block_m_for). The 128-row tile never shares keys
// among warps (key_groups).
constexpr int kBlockM = 64;
constexpr int kBlockMWide = 128;
// A CTA's shared memory stays within this so that three CTAs fit an SM on sm_90/sm_100 with
// three stages; larger tiles drop to two stages (two CTAs per SM there, one on sm_89/sm_120,
// whose SMs hold 100 KB).
constexpr int kSmemBudgetThreeStages = 72 * 1024;

struct TileShape {
  int block_m;         // query rows per CTA
  int warps;           // block_m / 16, each holding 16 rows
  int threads;
  int head_dim;
  int elt;             // bytes per element of the tile as copied (1: FP8, 2: bf16/fp16)
  int block_n;         // keys per tile
  int units;           // 16-byte units per K/V row
  int e;               // elements per unit
  int steps_per_unit;  // mma k-steps fed by one unit
  int groups;          // groups of 4 units (one per quad lane)
  int k_row;           // bytes per K row in shared memory (swizzled, unpadded)
  int v_row;           // bytes per V row in shared memory (16-bit rows padded by 16)
  int scale_bytes;     // a 1-byte stage's per-token-head K and V scales (0 for 16-bit ones)
  int nt;              // S n-tiles per key tile
  int ot;              // O n-tiles
  int max_key_groups;  // warps one row warp's keys can be shared among
  int stage_bytes;
  int stages;
  int q_bytes;         // Q fragments of every warp
  int wide_bytes;      // the dequantised 16-bit K and V tile (FP8 caches; 0 for 16-bit ones)
  int smem;            // Q fragments, the stages, then the 16-bit tile
};

constexpr int block_n_for(int head_dim) { return head_dim == 256 ? 32 : 64; }

constexpr TileShape tile_shape(int head_dim, int elt, int block_m = kBlockM) {
  TileShape s{};
  s.block_m = block_m;
  s.warps = block_m / 16;
  s.threads = s.warps * 32;
  s.head_dim = head_dim;
  s.elt = elt;
  s.block_n = block_n_for(head_dim);
  s.units = head_dim * elt / 16;
  s.e = 16 / elt;
  s.steps_per_unit = s.e / 4;
  s.groups = head_dim / (4 * s.e);
  s.k_row = head_dim * elt;
  // ldmatrix reads 16-bit V rows 8 at a time: the pad (4 banks) puts the 8 on distinct banks. A
  // 1-byte V tile is read only by the dequantisation, 16 bytes of consecutive rows a thread
  // (copy slots), which an unpadded tile keeps on distinct banks and a padded one would not.
  s.v_row = head_dim * elt + (elt == 2 ? 16 : 0);
  s.scale_bytes = elt == 1 ? s.block_n * 2 * 4 : 0;
  s.nt = s.block_n / 8;
  s.ot = head_dim / 8;
  s.max_key_groups =
      block_m > kBlockM ? 1 : s.block_n / 16 < s.warps ? s.block_n / 16 : s.warps;
  s.stage_bytes = s.block_n * (s.k_row + s.v_row) + s.scale_bytes;
  s.q_bytes = block_m * head_dim * 2;
  s.wide_bytes = elt == 1 ? s.block_n * (2 * head_dim * 2 + 16) : 0;
  s.stages = s.q_bytes + s.wide_bytes + 3 * s.stage_bytes <= kSmemBudgetThreeStages ? 3 : 2;
  s.smem = s.q_bytes + s.stages * s.stage_bytes + s.wide_bytes;
  return s;
}

// The 16-bit shape the MMAs of a tile with `head_dim` read (the dequantised tile of an FP8
// cache, or the 16-bit cache's own tile).
constexpr TileShape compute_shape(int head_dim, int block_m = kBlockM) {
  return tile_shape(head_dim, 2, block_m);
}

// --- shared-memory tile maps -----------------------------------------------------------------

FP8NCA_HD constexpr int k_swizzle(const TileShape& s, int row) {
  return s.units >= 8 ? (row & 1) << 2 : 0;
}

// Byte offset of 16-byte unit u of key row r in a K stage.
FP8NCA_HD constexpr int k_smem_offset(const TileShape& s, int r, int u) {
  return r * s.k_row + ((u ^ k_swizzle(s, r)) * 16);
}

// Byte offset of 16-byte unit u of value row r in a V stage.
FP8NCA_HD constexpr int v_smem_offset(const TileShape& s, int r, int u) {
  return r * s.v_row + u * 16;
}

// Byte offset in a V stage of key row r's per-token-head scale (which: 0 K, 1 V), copied with
// the tile into the stage's scale_bytes past the V tile: the K scales of the tile's keys in
// order, then the V scales. A warp's copy (32 consecutive rows) and its reads (scale_key_columns:
// 8 consecutive keys; dequantize_tile: the consecutive rows of its copy slots) fall on distinct
// banks or share a word.
FP8NCA_HD constexpr int scale_smem_offset(const TileShape& s, int r, int which) {
  return s.block_n * s.v_row + 4 * (which * s.block_n + r);
}

// Copy slot `slot` (= thread + i * threads) of a tile copy moves unit slot % units of key row
// slot / units.
FP8NCA_HD constexpr int copy_row(const TileShape& s, int slot) { return slot / s.units; }
FP8NCA_HD constexpr int copy_unit(const TileShape& s, int slot) { return slot % s.units; }
// A thread's copy slots of a tile are tid + i * threads, i < copy_slots: one unit of rows
// copy_row_step apart (threads is a multiple of the units per row), so the kernel forms its
// row and stage offsets once and steps them by constants (the emulation test checks the maps
// allow it).
FP8NCA_HD constexpr int copy_slots(const TileShape& s) { return s.block_n * s.units / s.threads; }
FP8NCA_HD constexpr int copy_row_step(const TileShape& s) { return s.threads / s.units; }

// Unit i (0, 1) of the 16-bit row that FP8 unit u of the same row dequantises into.
FP8NCA_HD constexpr int wide_unit(int u, int i) { return 2 * u + i; }

// Key n0 + r of a key tile (n0 a multiple of block_n; pages of 2^block_shift keys, a power of
// two): the tile either starts a page (pages <= block_n) or lies inside one, so the key is in
// the tile's tile_page-th page (counting from the page of n0) at page_key within it. Each
// thread's rows r are fixed, so both are formed from loop-invariant parts.
FP8NCA_HD constexpr int tile_page(int r, int block_shift) { return r >> block_shift; }
FP8NCA_HD constexpr int page_key(int n0, int r, int block_size) {
  return (n0 & (block_size - 1)) + (r & (block_size - 1));
}

// --- fragment maps ---------------------------------------------------------------------------

// First of the four adjacent head dims quad lane t feeds to k-step kk of unit group c, in the
// A (Q) and B (K) operands of S = Q K^T.
FP8NCA_HD constexpr int qk_dim(const TileShape& s, int c, int kk, int t) {
  return c * 4 * s.e + s.e * t + 4 * kk;
}

// Byte offset in a K stage of the 16 bytes lane (g, t) reads for S n-tile j, unit group c.
FP8NCA_HD constexpr int k_frag_offset(const TileShape& s, int j, int c, int lane) {
  return k_smem_offset(s, 8 * j + (lane >> 2), 4 * c + (lane & 3));
}

// Row address (byte offset in a V tile) lane `lane` gives ldmatrix.x4.trans for P V k-step kk
// and output n-tiles 2 jp, 2 jp + 1: matrix m = lane / 8 is keys 16 kk + 8 (m & 1) + 0..7 of head
// dims 8 (2 jp + m / 2) + 0..7, so the four registers are B fragments b0, b1 of n-tile 2 jp,
// then b0, b1 of n-tile 2 jp + 1.
FP8NCA_HD constexpr int v_ldsm_offset(const TileShape& s, int kk, int jp, int lane) {
  return (16 * kk + 8 * ((lane >> 3) & 1) + (lane & 7)) * s.v_row +
         8 * (2 * jp + (lane >> 4)) * s.elt;
}

// First of the 2 adjacent output dims quad lane t owns in output n-tile j.
FP8NCA_HD constexpr int out_dim(int j, int t) { return 8 * j + 2 * t; }

// --- work decomposition ----------------------------------------------------------------------

// Warps the rows leave idle share the keys instead: with row_warps warps holding rows, the
// CTA's warps form this many key groups (each a set of row warps taking an equal share of every
// key tile's n-tiles, at least one P V k-step of 16 keys). The 128-row tile (max_key_groups 1)
// runs when the batch's longest R exceeds 64 rows: it never splits keys (the warps a shorter
// sequence leaves idle still copy and dequantise their share of every tile).
FP8NCA_HD constexpr int key_groups(const TileShape& s, int rows_in_tile) {
  const int row_warps = (rows_in_tile + 15) / 16;
  return s.max_key_groups == 1 ? 1 : row_warps == 1 ? s.max_key_groups : row_warps == 2 ? 2 : 1;
}

// A sliding window (SPEC section 3): the row at position pos sees keys [pos - left, pos + right]
// on top of its mask; -1 leaves that side unbounded.
struct Window {
  int left, right;
};

struct RowKeys {
  int lo, hi;  // the keys one row sees: lo <= key <= hi
};

// Keys row `row` sees (masking.py visible_range): its token row / group sits at position
// pos = kv_len - q_len + row / group; causal rows see up to pos, bidirectional ones up to
// kv_len - 1, and the window narrows both sides. The window is compared before it is added, so
// any int window is safe. Never empty for a valid row: pos itself is visible.
FP8NCA_HD constexpr RowKeys row_keys(const Window& win, bool causal, int kv_len, int q_len,
                                     int row, int group) {
  const int pos = kv_len - q_len + row / group;
  const int hi = causal ? pos : kv_len - 1;
  return RowKeys{win.left >= 0 && win.left < pos ? pos - win.left : 0,
                 win.right >= 0 && win.right < hi - pos ? pos + win.right : hi};
}

// Whether `key` is visible to a row: lo <= key <= hi in one unsigned comparison (the mask's
// per-element test costs what the causal-only test did).
FP8NCA_HD constexpr bool key_visible(const RowKeys& r, int key) {
  return static_cast<unsigned>(key - r.lo) <= static_cast<unsigned>(r.hi - r.lo);
}

struct KeyRange {
  int first;       // the first key any row of the CTA sees
  int n_keys;      // one past the last such key; keys outside [first, n_keys) are
                   // zero-filled, never read (key_in_range)
  int free_first;  // a key tile starting at n0 needs no mask when
  int free_count;  //   0 <= n0 - free_first < free_count: every row sees all of its keys
};

// Keys seen by rows [row0, last_row] of a sequence. Both bounds of row_keys grow with the row,
// so the union of the rows' ranges is [lo(row0), hi(last_row)] (contiguous: each range holds
// its row's position), and a tile is seen whole by every row when it lies inside
// [lo(last_row), hi(row0)].
FP8NCA_HD constexpr KeyRange cta_keys(const Window& win, bool causal, int kv_len, int q_len,
                                      int row0, int last_row, int group, int block_n) {
  const RowKeys first = row_keys(win, causal, kv_len, q_len, row0, group);
  const RowKeys last = row_keys(win, causal, kv_len, q_len, last_row, group);
  const int free_count = first.hi - last.lo - block_n + 2;
  return KeyRange{first.lo, last.hi + 1, last.lo, free_count > 0 ? free_count : 0};
}

// Whether `key` is one the CTA's tiles load: first <= key < n_keys (one unsigned comparison).
FP8NCA_HD constexpr bool key_in_range(const KeyRange& k, int key) {
  return static_cast<unsigned>(key - k.first) < static_cast<unsigned>(k.n_keys - k.first);
}

// Whether the key tile starting at key n0 needs the mask (one unsigned comparison per tile).
FP8NCA_HD constexpr bool tile_needs_mask(const KeyRange& k, int n0) {
  return static_cast<unsigned>(n0 - k.free_first) >= static_cast<unsigned>(k.free_count);
}

struct TileRange {
  int begin, end;  // key tiles [begin, end) (empty when begin >= end)
};

// The key tiles holding a CTA's keys: whole tiles outside its window are never loaded.
FP8NCA_HD constexpr TileRange cta_tiles(const KeyRange& k, int block_n) {
  return TileRange{k.first / block_n, (k.n_keys + block_n - 1) / block_n};
}

// Split `split` of `num_splits` takes an equal run of the CTA's tiles, derived on the device
// from the real lengths, so a plan made for a longer max_seqlen_k still splits evenly.
FP8NCA_HD constexpr TileRange split_tiles(const TileRange& tiles, int num_splits, int split) {
  const int per_split = (tiles.end - tiles.begin + num_splits - 1) / num_splits;
  const int begin = tiles.begin + split * per_split;
  return TileRange{begin, begin + per_split < tiles.end ? begin + per_split : tiles.end};
}

}  // namespace fp8nca::mma_sync
