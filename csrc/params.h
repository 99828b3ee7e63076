// Launch parameters shared by the kernels (csrc/*.cu) and the pybind11 binding (python/).
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace fp8nca {

// Element type codes, mirrored in fp8_noncausal_attn/cuda_backend.py.
enum DType : int { kBF16 = 0, kFP16 = 1, kE4M3 = 2, kE5M2 = 3 };

// One paged attention launch. Strides are in elements of the tensor they index.
struct AttnParams {
  const void* q;         // [num_tokens, num_q_heads, head_dim]
  const void* k;         // [num_blocks, block_size, num_kv_heads, head_dim]
  const void* v;         // same shape as k, own strides
  void* out;             // [num_tokens, num_q_heads, head_dim], query dtype
  const int32_t* block_table;   // [num_seqs, max_blocks_per_seq]
  const int32_t* cu_seqlens_q;  // [num_seqs + 1], contiguous
  const int32_t* seq_lens;      // [num_seqs], contiguous
  const float* k_scale;         // [num_kv_heads]
  const float* v_scale;         // [num_kv_heads]
  const uint8_t* causal_per_seq;  // [num_seqs] or nullptr (then `causal` holds for all)
  float* ws_o;    // [num_splits, num_tokens, num_q_heads, head_dim] fp32 when num_splits > 1
  float* ws_lse;  // [num_splits, num_tokens, num_q_heads] fp32 (log2 domain)
  int64_t q_stride_t, q_stride_h;
  int64_t o_stride_t, o_stride_h;
  int64_t k_stride_b, k_stride_s, k_stride_h;
  int64_t v_stride_b, v_stride_s, v_stride_h;
  int64_t bt_stride_s, bt_stride_b;
  int num_tokens, num_seqs, num_q_heads, num_kv_heads, group, head_dim, block_size;
  int max_seqlen_q, num_splits, causal;
  float softmax_scale;
};

// Rows of the M tile (query tokens x query heads of one KV head) handled by one CTA.
constexpr int kBlockM = 64;

// Keys per tile for a head dim; the host uses it to size split-KV.
constexpr int block_n_for(int head_dim) { return head_dim == 256 ? 32 : 64; }

// Launchers: return cudaSuccess or the launch error. No host synchronisation. With
// ctas_per_sm set they launch nothing and report the kernel's CTAs per SM instead.
cudaError_t launch_attention_d64(const AttnParams& p, int q_dtype, int kv_dtype, cudaStream_t s,
                                 int* ctas_per_sm = nullptr);
cudaError_t launch_attention_d128(const AttnParams& p, int q_dtype, int kv_dtype, cudaStream_t s,
                                  int* ctas_per_sm = nullptr);
cudaError_t launch_attention_d256(const AttnParams& p, int q_dtype, int kv_dtype, cudaStream_t s,
                                  int* ctas_per_sm = nullptr);
cudaError_t launch_merge(const AttnParams& p, int q_dtype, cudaStream_t s);

}  // namespace fp8nca
