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

// One case of a cache dispatch: `body` with the constant KV = `code` in scope.
#define FP8NCA_CACHE_CASE(code, KV, ...) \
  case code: {                           \
    constexpr int KV = code;             \
    __VA_ARGS__                          \
  }

// Cache dtype under query type QT -> constant KV: FP8 (e4m3, e5m2), or the query's own 16-bit
// dtype. Converting bf16 keys to fp16 could overflow, so a 16-bit cache of the other dtype is
// not compiled (the CUDA backend refuses it; Triton runs it with fp32 dots).
#define FP8NCA_DISPATCH_CACHE(cache_dtype, QT, KV, ...)                                        \
  {                                                                                        \
    constexpr int kOwn16 = std::is_same_v<QT, __half> ? ::fp8nca::kFP16 : ::fp8nca::kBF16; \
    switch (cache_dtype) {                                                                    \
      FP8NCA_CACHE_CASE(::fp8nca::kE4M3, KV, __VA_ARGS__)                                  \
      FP8NCA_CACHE_CASE(::fp8nca::kE5M2, KV, __VA_ARGS__)                                  \
      FP8NCA_CACHE_CASE(kOwn16, KV, __VA_ARGS__)                                           \
      default: return cudaErrorInvalidValue;                                               \
    }                                                                                      \
  }

// Cache dtype of a per-token-head cache -> constant KV: the 1-byte formats vLLM's
// fp8_per_token_head (e4m3, e5m2) and int8_per_token_head caches hold.
#define FP8NCA_DISPATCH_TOKEN_SCALED_CACHE(cache_dtype, KV, ...) \
  switch (cache_dtype) {                                         \
    FP8NCA_CACHE_CASE(::fp8nca::kE4M3, KV, __VA_ARGS__)       \
    FP8NCA_CACHE_CASE(::fp8nca::kE5M2, KV, __VA_ARGS__)       \
    FP8NCA_CACHE_CASE(::fp8nca::kI8, KV, __VA_ARGS__)         \
    default: return cudaErrorInvalidValue;                    \
  }
