// Launch parameters of the mma.sync kernels, the split-KV merge and the cache write, filled by the
// pybind11 binding (python/bindings.cpp). Host-only C++ may include this header.
#pragma once

#include <cstdint>

#include "launch_record.h"

namespace fp8nca {

// Element type codes (_C.DTYPE_CODES; fp8_noncausal_attn/backends/cuda/extension.py maps torch
// dtypes to them, and a test ties the two). int8 caches hold per-token-head scales only (vLLM's
// int8_per_token_head); 4 is the merge's float32 output code (cascade/merge.h kMergeFP32).
enum DType : int { kBF16 = 0, kFP16 = 1, kE4M3 = 2, kE5M2 = 3, kI8 = 5 };

// Bytes per element of the formats the cache write takes (it writes no int8 cache).
constexpr int dtype_bytes(int dtype) { return dtype == kE4M3 || dtype == kE5M2 ? 1 : 2; }
// Bytes per element of a cache the attention kernels read.
constexpr int cache_bytes(int dtype) { return dtype == kI8 ? 1 : dtype_bytes(dtype); }

// How k_scale / v_scale index the cache (AttnParams::scale_mode): one scale per KV head,
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
// Its fields are the launch record's (fp8_noncausal_attn/launch_record.py, the one definition of
// the launch arguments): FP8NCA_ATTN_FIELDS(X) of the generated launch_record.h lists them as
// X(type, name, source), in the order of AttnParams. Every attention kernel takes this one
// struct; with kScalePerTokenHead (the per-token-head kernels, which read scales differently),
// k_scale / v_scale point at float32 [num_blocks, block_size, num_kv_heads] tensors read through
// the ks_stride_* / vs_stride_* fields, which the other kernels never read. python/bindings.cpp
// takes each Given field by name from the dict the package passes and computes the Derived ones.
#define FP8NCA_DECLARE_FIELD(type, name, source) type name;
struct AttnParams {
  FP8NCA_ATTN_FIELDS(FP8NCA_DECLARE_FIELD)
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
