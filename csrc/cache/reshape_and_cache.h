// Cache write kernel (vLLM's reshape_and_cache with per-head scales).
#pragma once

#include <cuda_runtime_api.h>

#include "../common/params.h"

namespace fp8nca {

// Quantises p.key / p.value rows into the paged caches at p.slot_mapping (negative: skipped),
// bit-identical to fp8_noncausal_attn/scales.quantize (quantize.h). Asynchronous on `stream`.
cudaError_t launch_reshape_and_cache(const CacheWriteParams& p, cudaStream_t stream);

}  // namespace fp8nca
