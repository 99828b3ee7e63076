// The attention launches of the head dims a quick executor build leaves out
// (FP8NCA_SIMT_ABSENT_D<dim>, set by fp8_noncausal_attn/backends/cuda/simt.py): they refuse,
// as a dtype pair that is not compiled does. Lets a test that plants a change in a kernel
// rebuild one head dim's translation units instead of all of them.
#include "mma_sync/api.h"

#define FP8NCA_ABSENT_HEAD_DIM(D)                                                             \
  cudaError_t launch_d##D(const AttnParams&, dim3, int, int, int, cudaStream_t, int*) {      \
    return cudaErrorInvalidValue;                                                            \
  }                                                                                          \
  cudaError_t launch_d##D##_lse(const AttnParams&, dim3, int, int, int, cudaStream_t, int*) { \
    return cudaErrorInvalidValue;                                                            \
  }                                                                                          \
  cudaError_t launch_d##D##_pth(const AttnParams&, const TokenScaleParams&, dim3, int, int,  \
                                int, cudaStream_t, int*) {                                   \
    return cudaErrorInvalidValue;                                                            \
  }

namespace fp8nca::mma_sync {
#ifdef FP8NCA_SIMT_ABSENT_D64
FP8NCA_ABSENT_HEAD_DIM(64)
#endif
#ifdef FP8NCA_SIMT_ABSENT_D128
FP8NCA_ABSENT_HEAD_DIM(128)
#endif
#ifdef FP8NCA_SIMT_ABSENT_D256
FP8NCA_ABSENT_HEAD_DIM(256)
#endif
}  // namespace fp8nca::mma_sync
