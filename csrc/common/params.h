// Launch parameters of the mma.sync kernels, the split-KV merge and the cache write, filled by the
// pybind11 binding (python/bindings.cpp). Host-only C++ may include this header.
#pragma once

#include <cstdint>

namespace fp8nca {

// Element type codes (_C.DTYPE_CODES; fp8_noncausal_attn/backends/cuda/extension.py maps torch
// dtypes to them, and a test ties the two).
enum DType : int { kBF16 = 0, kFP16 = 1, kE4M3 = 2, kE5M2 = 3 };

constexpr int dtype_bytes(int dtype) { return dtype == kE4M3 || dtype == kE5M2 ? 1 : 2; }

// log2(e): the kernels run the softmax in log2 units (2^x is one instruction), so natural-log
// quantities such as the attention-sink logits are multiplied by it.
constexpr float kLog2e = 1.4426950408889634f;

// One paged attention launch. Strides are in elements of the tensor they index. Index tensors
// (block_table, cu_seqlens_q, seq_lens, causal) are read where they lie, through their strides:
// vLLM passes slices of persistent buffers it updates in place between CUDA-graph replays.
struct AttnParams {
  const void* q;         // [num_tokens, num_q_heads, head_dim]
  const void* k;         // [num_blocks, block_size, num_kv_heads, head_dim]
  const void* v;         // same shape as k, own strides
  void* out;             // [num_tokens, num_q_heads, head_dim], query dtype
  const int32_t* block_table;   // [num_seqs, max_blocks_per_seq]
  const int32_t* cu_seqlens_q;  // [num_seqs + 1]; rows from cu_seqlens_q[num_seqs] on are padding
  const int32_t* seq_lens;      // [num_seqs]
  const float* k_scale;         // [num_kv_heads]
  const float* v_scale;         // [num_kv_heads]
  const void* causal_per_seq;   // [num_seqs] bool or int32 (nonzero = causal), or nullptr
  const float* sinks;           // [num_q_heads] fp32 attention-sink logits, or nullptr
  float* ws_o;    // [num_splits, num_tokens, num_q_heads, head_dim] fp32 when num_splits > 1
  float* ws_lse;  // [num_splits, num_tokens, num_q_heads] fp32 (log2 domain)
  int64_t q_stride_t, q_stride_h;
  int64_t o_stride_t, o_stride_h;
  int64_t k_stride_b, k_stride_s, k_stride_h;
  int64_t v_stride_b, v_stride_s, v_stride_h;
  int64_t bt_stride_s, bt_stride_b;
  int64_t cu_stride, sl_stride, causal_stride;
  int causal_bytes;  // element size of causal_per_seq: 1 (bool) or 4 (int32)
  int out_align;     // bytes: largest power of two (<= 16) dividing out's pointer and strides
  int num_tokens, num_seqs, num_q_heads, num_kv_heads, group, head_dim, block_size;
  int block_shift;   // log2(block_size): validation admits powers of two only
  int max_seqlen_q, num_splits, causal;
  // Sliding window (SPEC section 3): row at position pos sees keys [pos - left, pos + right];
  // -1 = unbounded on that side.
  int window_left, window_right;
  float softmax_scale;
};

// One cache write: new K/V rows -> the paged caches at slot_mapping (negative = skipped).
struct CacheWriteParams {
  const void* key;    // [num_tokens, num_kv_heads, head_dim] bf16 / fp16
  const void* value;  // same shape, own strides
  void* key_cache;    // [num_blocks, block_size, num_kv_heads, head_dim]
  void* value_cache;
  const int64_t* slot_mapping;  // [num_tokens]
  const float* k_scale;         // [num_kv_heads] dequantisation multipliers
  const float* v_scale;
  int64_t key_stride_t, key_stride_h, value_stride_t, value_stride_h;
  int64_t kc_stride_b, kc_stride_s, kc_stride_h;
  int64_t vc_stride_b, vc_stride_s, vc_stride_h;
  int64_t slot_stride;
  int num_tokens, num_kv_heads, head_dim, block_size;
  int in_dtype, cache_dtype;
};

}  // namespace fp8nca
