// Reading the per-sequence index tensors where they lie, through their strides (vLLM passes
// slices of persistent buffers and rewrites them in place between CUDA-graph replays, so no
// backend may convert or copy them). FP8NCA_HD: the mma.sync kernels use these, and the CPU
// emulation test runs them on host tensors through tests/ext/host_hooks.cpp.
#pragma once

#include <cstdint>

#include "host_device.h"
#include "params.h"

namespace fp8nca {

FP8NCA_HD int cu_seqlens_at(const AttnParams& p, int i) { return p.cu_seqlens_q[i * p.cu_stride]; }

FP8NCA_HD int seq_len_at(const AttnParams& p, int seq) { return p.seq_lens[seq * p.sl_stride]; }

// The per-sequence mask flag: bool (1 byte) or int32 (nonzero = causal), or the launch's one flag.
FP8NCA_HD bool seq_is_causal(const AttnParams& p, int seq) {
  if (p.causal_per_seq == nullptr) return p.causal != 0;
  const char* at = static_cast<const char*>(p.causal_per_seq) +
                   static_cast<int64_t>(seq) * p.causal_stride * p.causal_bytes;
  return p.causal_bytes == 4 ? *reinterpret_cast<const int32_t*>(at) != 0
                             : *reinterpret_cast<const uint8_t*>(at) != 0;
}

}  // namespace fp8nca
