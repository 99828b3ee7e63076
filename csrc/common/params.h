// Launch parameters of the mma.sync kernels, the split-KV merge and the cache write, filled by the
// pybind11 binding (python/bindings.cpp). Host-only C++ may include this header.
#pragma once

#include <cstdint>

namespace fp8nca {

// Element type codes (_C.DTYPE_CODES; fp8_noncausal_attn/backends/cuda/extension.py maps torch
// dtypes to them, and a test ties the two). int8 caches hold per-token-head scales only (vLLM's
// int8_per_token_head); 4 is the merge's float32 output code (cascade/merge.h kMergeFP32).
enum DType : int { kBF16 = 0, kFP16 = 1, kE4M3 = 2, kE5M2 = 3, kI8 = 5 };

// Bytes per element of the formats the cache write takes (it writes no int8 cache).
constexpr int dtype_bytes(int dtype) { return dtype == kE4M3 || dtype == kE5M2 ? 1 : 2; }
// Bytes per element of a cache the attention kernels read.
constexpr int cache_bytes(int dtype) { return dtype == kI8 ? 1 : dtype_bytes(dtype); }

// How k_scale / v_scale index the cache (TokenScaleParams::scale_mode): one scale per KV head,
// [num_kv_heads], or one per token and KV head, [num_blocks, block_size, num_kv_heads] through
// their strides (vLLM's fp8_per_token_head / int8_per_token_head pages keep them inline).
enum ScaleMode : int { kScalePerHead = 0, kScalePerTokenHead = 1 };

// log2(e): the kernels run the softmax in log2 units (2^x is one instruction), so natural-log
// quantities such as the attention-sink logits are multiplied by it.
constexpr float kLog2e = 1.4426950408889634f;
// ln(2): an LSE the kernels computed in log2 units leaves them as the API's natural log.
constexpr float kLn2 = 0.6931471805599453f;

// One paged attention launch. Strides are in elements of the tensor they index. Index tensors
// (block_table, cu_seqlens_q, seq_lens, causal) are read where they lie, through their strides:
// vLLM passes slices of persistent buffers it updates in place between CUDA-graph replays.
//
// FP8NCA_ATTN_FIELDS(X) is the one list of its fields: X(type, name, source) for each, in the
// order of AttnParams then TokenScaleParams. source is Given (the caller's value:
// python/bindings.cpp takes each by name from the dict fp8_noncausal_attn/backends/cuda/mma_sync.py
// passes, and exports the names as _C.ATTN_FIELDS) or Derived (the binding computes it).
#define FP8NCA_ATTN_FIELDS(X) FP8NCA_LAUNCH_FIELDS(X) FP8NCA_TOKEN_SCALE_FIELDS(X)

#define FP8NCA_LAUNCH_FIELDS(X)                                                                  \
  X(const void*, q, Given)     /* [num_tokens, num_q_heads, head_dim] */                          \
  X(const void*, k, Given)     /* [num_blocks, block_size, num_kv_heads, head_dim] */             \
  X(const void*, v, Given)     /* same shape as k, own strides */                                 \
  X(void*, out, Given)         /* [num_tokens, num_q_heads, head_dim], query dtype */             \
  X(const int32_t*, block_table, Given)  /* [num_seqs, max_blocks_per_seq] */                     \
  X(const int32_t*, cu_seqlens_q, Given) /* [num_seqs + 1]; rows from [num_seqs] on: padding */   \
  X(const int32_t*, seq_lens, Given)     /* [num_seqs] */                                         \
  X(const float*, k_scale, Given)        /* [num_kv_heads], or per token (TokenScaleParams) */    \
  X(const float*, v_scale, Given)        /* likewise */                                           \
  X(const void*, causal_per_seq, Given)  /* [num_seqs] bool or int32 (nonzero: causal), or null */\
  X(const float*, sinks, Given)          /* [num_q_heads] fp32 sink logits, or null */            \
  X(float*, ws_o, Given)   /* [num_splits, num_tokens, num_q_heads, head_dim] fp32 when split */  \
  X(float*, ws_lse, Given) /* [num_splits, num_tokens, num_q_heads] fp32 (log2 domain); an */   \
  /* unsplit launch asked for the LSE points it at [num_tokens, num_q_heads] (natural log) */     \
  X(int64_t, q_stride_t, Given) X(int64_t, q_stride_h, Given)                                    \
  X(int64_t, o_stride_t, Given) X(int64_t, o_stride_h, Given)                                    \
  X(int64_t, k_stride_b, Given) X(int64_t, k_stride_s, Given) X(int64_t, k_stride_h, Given)      \
  X(int64_t, v_stride_b, Given) X(int64_t, v_stride_s, Given) X(int64_t, v_stride_h, Given)      \
  X(int64_t, bt_stride_s, Given) X(int64_t, bt_stride_b, Given)                                  \
  X(int64_t, cu_stride, Given) X(int64_t, sl_stride, Given) X(int64_t, causal_stride, Given)     \
  X(int, causal_bytes, Given) /* element size of causal_per_seq: 1 (bool) or 4 (int32) */        \
  X(int, out_align, Derived)  /* bytes: largest power of two <= 16 dividing out and strides */   \
  X(int, num_tokens, Given) X(int, num_seqs, Given) X(int, num_q_heads, Given)                   \
  X(int, num_kv_heads, Given) X(int, group, Derived) X(int, head_dim, Given)                     \
  X(int, block_size, Given)                                                                      \
  X(int, block_shift, Derived) /* log2(block_size): validation admits powers of two only */      \
  X(int, max_seqlen_q, Given)                                                                    \
  X(int, num_splits, Given)    /* the plan's (the launch refuses another) */                    \
  X(int, causal, Given)        /* the launch-wide flag when causal_per_seq is null */            \
  /* Sliding window (SPEC section 3): row at position pos sees keys [pos - left, pos + right];   \
     -1 = unbounded on that side. */                                                             \
  X(int, window_left, Given) X(int, window_right, Given)                                         \
  X(float, softmax_scale, Given)

// --- per-token-head scales: the last block of FP8NCA_ATTN_FIELDS -------------------------------
// Read only by the per-token-head kernels, which take them as a second argument
// (TokenScaleParams), so that AttnParams, and with it every other kernel's code, is unchanged.
// With kScalePerTokenHead, k_scale / v_scale above point at float32 [num_blocks, block_size,
// num_kv_heads] tensors read through these strides (in elements; any values, vLLM's inline
// scales are a strided view of its page).
#define FP8NCA_TOKEN_SCALE_FIELDS(X)                                                             \
  X(int, scale_mode, Given) /* ScaleMode: which kernels the launch runs */                       \
  X(int64_t, ks_stride_b, Given) X(int64_t, ks_stride_s, Given) X(int64_t, ks_stride_h, Given)  \
  X(int64_t, vs_stride_b, Given) X(int64_t, vs_stride_s, Given) X(int64_t, vs_stride_h, Given)

#define FP8NCA_DECLARE_FIELD(type, name, source) type name;
struct AttnParams {
  FP8NCA_LAUNCH_FIELDS(FP8NCA_DECLARE_FIELD)
};

struct TokenScaleParams {
  FP8NCA_TOKEN_SCALE_FIELDS(FP8NCA_DECLARE_FIELD)
};
#undef FP8NCA_DECLARE_FIELD

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
