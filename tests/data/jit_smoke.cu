// Test-only kernel family for tests/test_jit_offline.py and tests/gpu/test_interop.py.
// One CTA of BLOCK threads scales a strided run of n elements of T into float output.
#include "jit_smoke.cuh"
#include "jit_smoke.cuh"

// Tests pass -DJIT_SMOKE_NONCE=<random>: the value lands in the PTX, so a compile is never answered
// by the CUDA compute cache (which would leave the ptxas statistics out of the log).
#ifndef JIT_SMOKE_NONCE
#define JIT_SMOKE_NONCE 0
#endif
__device__ int jit_smoke_nonce = JIT_SMOKE_NONCE;

template <typename T, int BLOCK>
__global__ void __launch_bounds__(BLOCK) smoke_scale(const T* __restrict__ x, float* __restrict__ y, int n, float a) {
  __shared__ float tile[BLOCK];
  int i = blockIdx.x * BLOCK + threadIdx.x;
  tile[threadIdx.x] = i < n ? a * smoke_to_float<T>(x[i]) : 0.0f;
  __syncthreads();
  if (i < n) y[i] = tile[threadIdx.x] + tile[(threadIdx.x + 1) % BLOCK] * 0.0f;
}

// Register pressure on purpose: N live accumulators. With -maxrregcount=16 ptxas must spill,
// which tests/test_jit_offline.py uses to check the spill report.
template <int N>
__global__ void smoke_pressure(const float* __restrict__ x, float* __restrict__ y) {
  float acc[N];
#pragma unroll
  for (int i = 0; i < N; ++i) acc[i] = x[threadIdx.x * N + i];
#pragma unroll
  for (int r = 0; r < 4; ++r) {
#pragma unroll
    for (int i = 0; i < N; ++i) acc[i] = fmaf(acc[i], acc[(i + r + 1) % N], acc[(i + 7) % N]);
  }
#pragma unroll
  for (int i = 0; i < N; ++i) y[threadIdx.x * N + i] = acc[i];
}
