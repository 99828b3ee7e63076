// Runtime dtype codes -> template parameters, in one place (FlashInfer's DISPATCH_* macros). Used
// by the .cu files of each family; `body` is instantiated once per case, with the type alias
// (or constant) it names in scope, and must return a cudaError_t.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include "params.h"

// Query dtype -> QT (__nv_bfloat16 / __half).
#define FP8NCA_DISPATCH_QUERY(q_dtype, QT, ...)   \
  switch (q_dtype) {                              \
    case ::fp8nca::kBF16: {                       \
      using QT = __nv_bfloat16;                   \
      __VA_ARGS__                                 \
    }                                             \
    case ::fp8nca::kFP16: {                       \
      using QT = __half;                          \
      __VA_ARGS__                                 \
    }                                             \
    default: return cudaErrorInvalidValue;        \
  }

// Cache dtype under query type QT -> constant KV: FP8 (e4m3, e5m2), or the query's own 16-bit
// dtype. Converting bf16 keys to fp16 could overflow, so a 16-bit cache of the other dtype is
// not compiled (the CUDA backend refuses it; Triton runs it with fp32 dots).
#define FP8NCA_DISPATCH_CACHE(kv_dtype, QT, KV, ...)                                        \
  {                                                                                        \
    constexpr int kOwn16 = std::is_same_v<QT, __half> ? ::fp8nca::kFP16 : ::fp8nca::kBF16; \
    switch (kv_dtype) {                                                                    \
      case ::fp8nca::kE4M3: {                                                              \
        constexpr int KV = ::fp8nca::kE4M3;                                                \
        __VA_ARGS__                                                                        \
      }                                                                                    \
      case ::fp8nca::kE5M2: {                                                              \
        constexpr int KV = ::fp8nca::kE5M2;                                                \
        __VA_ARGS__                                                                        \
      }                                                                                    \
      case kOwn16: {                                                                       \
        constexpr int KV = kOwn16;                                                         \
        __VA_ARGS__                                                                        \
      }                                                                                    \
      default: return cudaErrorInvalidValue;                                               \
    }                                                                                      \
  }
