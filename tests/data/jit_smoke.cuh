// Test-only header for tests/test_jit_offline.py: inlined by cupa.jit.source_text.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

#define JIT_SMOKE_HEADER_MARK 1

template <typename T> __device__ __forceinline__ float smoke_to_float(T x) { return static_cast<float>(x); }
template <> __device__ __forceinline__ float smoke_to_float<__half>(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float smoke_to_float<__nv_bfloat16>(__nv_bfloat16 x) {
  return __bfloat162float(x);
}
