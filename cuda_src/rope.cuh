// QK-norm and RoPE on one head row staged in shared memory as floats, processed by one warp.
// Order (contract §4.1): RMSNorm (fp32 sums) then RoPE; the caller rounds to T afterwards.
#pragma once
#include "common.cuh"

template <typename T>
CUPA_DEVICE void rms_norm_row(float* x, const T* weight, int head_size, float eps, int lane) {
  float ss = 0.0f;
  for (int c = lane; c < head_size; c += 32) ss += x[c] * x[c];
  ss = warp_sum(ss);
  const float inv = 1.0f / sqrtf(ss / (float)head_size + eps);
  __syncwarp();
  for (int c = lane; c < head_size; c += 32) x[c] = x[c] * inv * Act<T>::to_float(weight[c]);
  __syncwarp();
}

// Rotate channels [offset, offset + rotary_dim) at position pos. Interleaved pairs are
// (2i, 2i+1); otherwise (i, i + rotary_dim/2). Each lane owns whole pairs, so in place is safe.
template <typename T>
CUPA_DEVICE void rope_row(float* x, const T* cos_cache, const T* sin_cache, int pos, int rotary_dim,
                          int offset, int interleaved, int lane) {
  const int half = rotary_dim / 2;
  const T* cr = cos_cache + (long long)pos * half;
  const T* sr = sin_cache + (long long)pos * half;
  for (int i = lane; i < half; i += 32) {
    const int i1 = offset + (interleaved ? 2 * i : i);
    const int i2 = offset + (interleaved ? 2 * i + 1 : i + half);
    const float c = Act<T>::to_float(cr[i]), s = Act<T>::to_float(sr[i]);
    const float x1 = x[i1], x2 = x[i2];
    x[i1] = x1 * c - x2 * s;
    x[i2] = x2 * c + x1 * s;
  }
  __syncwarp();
}
