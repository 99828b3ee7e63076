// The attention launches of the translation units a quick executor build leaves out
// (FP8NCA_SIMT_ABSENT_ATTENTION_D<dim>[_PTH], set by
// fp8_noncausal_attn/backends/cuda/simt.py): they refuse, as a dtype pair that is not compiled
// does. A test that plants a change in a kernel then rebuilds one unit instead of six.
#include "mma_sync/api.h"

namespace fp8nca::mma_sync {

#define FP8NCA_ABSENT_LAUNCH(name)                                                        \
  cudaError_t name(const AttnParams&, dim3, int, int, int, cudaStream_t, int*) {          \
    return cudaErrorInvalidValue;                                                         \
  }

#ifdef FP8NCA_SIMT_ABSENT_ATTENTION_D64
FP8NCA_ABSENT_LAUNCH(launch_d64)
#endif
#ifdef FP8NCA_SIMT_ABSENT_ATTENTION_D64_PTH
FP8NCA_ABSENT_LAUNCH(launch_d64_pth)
#endif
#ifdef FP8NCA_SIMT_ABSENT_ATTENTION_D128
FP8NCA_ABSENT_LAUNCH(launch_d128)
#endif
#ifdef FP8NCA_SIMT_ABSENT_ATTENTION_D128_PTH
FP8NCA_ABSENT_LAUNCH(launch_d128_pth)
#endif
#ifdef FP8NCA_SIMT_ABSENT_ATTENTION_D256
FP8NCA_ABSENT_LAUNCH(launch_d256)
#endif
#ifdef FP8NCA_SIMT_ABSENT_ATTENTION_D256_PTH
FP8NCA_ABSENT_LAUNCH(launch_d256_pth)
#endif

}  // namespace fp8nca::mma_sync
