// FP8NCA_HD marks functions shared by kernels and host code (the plan function, the CPU
// emulation hooks in tests/ext/host_hooks.cpp): __host__ __device__ under nvcc, plain inline
// under a host C++ compiler, so a host test runs the very maps the kernels use.
#pragma once

#if defined(__CUDACC__)
#define FP8NCA_HD __host__ __device__ __forceinline__
#else
#define FP8NCA_HD inline
#endif
