// Generated from fp8_noncausal_attn/launch_record.py by `python -m tools.launch_record`:
// edit the record, never this file (tests/test_launch_record.py checks the two agree).
#pragma once

// The record's hash for mma.sync, exported as _C.LAUNCH_RECORD_HASH: the package
// refuses a _C built from another record when it loads it.
#define FP8NCA_LAUNCH_RECORD_HASH "0f4373741411"

// X(type, name, source) for each field of AttnParams, in order (csrc/common/params.h);
// source: Given (the caller passes it by name, _C.ATTN_FIELDS) or Derived
// (python/bindings.cpp computes it).
#define FP8NCA_ATTN_FIELDS(X) \
  X(const void*, q, Given) /* [num_tokens, num_q_heads, head_dim] 16-bit */ \
  X(const void*, k, Given) /* [num_blocks, block_size, num_kv_heads, head_dim] FP8 */ \
  X(const void*, v, Given) /* the shape of k, own strides */ \
  X(void*, out, Given) /* [num_tokens, num_q_heads, head_dim], the query dtype */ \
  X(const int32_t*, block_table, Given) /* int32 [num_seqs, max_blocks] */ \
  X(const int32_t*, cu_seqlens_q, Given) /* int32 [num_seqs + 1]; rows from [num_seqs] on: padding */ \
  X(const int32_t*, seq_lens, Given) /* int32 [num_seqs] */ \
  X(const float*, k_scale, Given) /* fp32 [num_kv_heads], or per token and head (scale_mode) */ \
  X(const float*, v_scale, Given) /* likewise */ \
  X(const void*, causal_per_seq, Given) /* [num_seqs] bool or int32 (nonzero: causal), or null */ \
  X(const float*, sinks, Given) /* fp32 [num_q_heads] natural-log sink logits, or null */ \
  X(float*, ws_o, Given) /* fp32 [num_splits, num_tokens, num_q_heads, head_dim] when split */ \
  X(float*, ws_lse, Given) /* fp32 [num_splits, num_tokens, num_q_heads] (log2) when split; mma.sync unsplit with the LSE asked for: [num_tokens, num_q_heads] (natural log) */ \
  X(int64_t, q_stride_t, Given) /* query strides (elements): token, head */ \
  X(int64_t, q_stride_h, Given) /* query strides (elements): token, head */ \
  X(int64_t, o_stride_t, Given) /* output strides: token, head */ \
  X(int64_t, o_stride_h, Given) /* output strides: token, head */ \
  X(int64_t, k_stride_b, Given) /* key cache strides: block, slot, head */ \
  X(int64_t, k_stride_s, Given) /* key cache strides: block, slot, head */ \
  X(int64_t, k_stride_h, Given) /* key cache strides: block, slot, head */ \
  X(int64_t, v_stride_b, Given) /* value cache strides: block, slot, head */ \
  X(int64_t, v_stride_s, Given) /* value cache strides: block, slot, head */ \
  X(int64_t, v_stride_h, Given) /* value cache strides: block, slot, head */ \
  X(int64_t, bt_stride_s, Given) /* block table strides: sequence, block */ \
  X(int64_t, bt_stride_b, Given) /* block table strides: sequence, block */ \
  X(int64_t, cu_stride, Given) /* stride of cu_seqlens_q */ \
  X(int64_t, sl_stride, Given) /* stride of seq_lens */ \
  X(int64_t, causal_stride, Given) /* stride of causal_per_seq, in flags (0 when null) */ \
  X(int, causal_bytes, Given) /* bytes per causal_per_seq flag: 1 (bool), 4 (int32); 0 when null */ \
  X(int, out_align, Derived) /* bytes: largest power of two <= 16 dividing out and its strides */ \
  X(int, num_tokens, Given) /* query rows, padding included */ \
  X(int, num_seqs, Given) /* sequences */ \
  X(int, num_q_heads, Given) /* query heads */ \
  X(int, num_kv_heads, Given) /* KV heads */ \
  X(int, group, Derived) /* num_q_heads / num_kv_heads */ \
  X(int, head_dim, Given) /* 64, 128 or 256 */ \
  X(int, block_size, Given) /* keys per cache page */ \
  X(int, block_shift, Given) /* log2(block_size): validation admits powers of two only */ \
  X(int, max_seqlen_q, Given) /* the longest sequence's query tokens */ \
  X(int, num_splits, Given) /* split-KV partials per sequence: the plan's */ \
  X(int, causal, Given) /* the launch-wide causal flag when causal_per_seq is null */ \
  X(int, window_left, Given) /* -1: unbounded */ \
  X(int, window_right, Given) /* -1: unbounded; causal caps it at 0 */ \
  X(float, softmax_scale, Given) /* the scale of q . k */ \
  X(int, scale_mode, Given) /* ScaleMode: which kernels the launch runs */ \
  X(int64_t, ks_stride_b, Given) /* per-token-head k_scale stride: b */ \
  X(int64_t, ks_stride_s, Given) /* per-token-head k_scale stride: s */ \
  X(int64_t, ks_stride_h, Given) /* per-token-head k_scale stride: h */ \
  X(int64_t, vs_stride_b, Given) /* per-token-head v_scale stride: b */ \
  X(int64_t, vs_stride_s, Given) /* per-token-head v_scale stride: s */ \
  X(int64_t, vs_stride_h, Given) /* per-token-head v_scale stride: h */
