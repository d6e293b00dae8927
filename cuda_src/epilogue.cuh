// The end of a decode CTA, shared by the CUDA-core and tensor-core kernels: merge the warps'
// partial states in warp order, then finalize the rows into the output (the token's only split
// with admitted keys) or write them as this split's partial state; the last split CTA of a
// (token, head chunk) to finish then merges every split's partial state in split order
// (merge_splits_if_last), so no separate merge launch is needed.
#pragma once
#include "common.cuh"
#include "quant.cuh"
#include "softmax.cuh"

// Row r of warp w: m at m_at[w * row_stride + r], l likewise, o at o_at[(w * row_stride + r) * o_stride + d].
// lse (null unless the call asks for it): (N, num_heads) float32, written where the output is finalized
// (the direct path here, the last split's merge below), from the state the output is made of.
// Rows are query heads h0 .. h0 + rows - 1 of token t (KV head g). Called by every thread of the CTA
// (num_warps >= 2). First one thread per row merges the row's max and sum and turns each warp's m
// into its weight exp(m - M) in place (l_at's first two warp rows then hold the row's L and M), then
// every thread sums its channels' weighted o: each weight computed once per row, not per channel.
template <typename T>
CUPA_DEVICE void store_rows(float* m_at, float* l_at, const float* o_at, int num_warps, int row_stride,
                            int o_stride, int rows, int head_size, int t, int h0, int num_heads, int g, int split,
                            int num_splits, bool direct, const T* head_sink, const float* v_scale, int v_quant, T* out,
                            float* part_o, float2* part_ml, float* lse) {
  const int D = head_size;
  for (int r = threadIdx.x; r < rows; r += blockDim.x) {
    float M = CUPA_NEG_INF;
    for (int w = 0; w < num_warps; ++w) M = fmaxf(M, m_at[w * row_stride + r]);
    float L = 0.0f;
    for (int w = 0; w < num_warps; ++w) {
      const float c = rescale(m_at[w * row_stride + r], M);
      L = L * 1.0f + l_at[w * row_stride + r] * c;
      m_at[w * row_stride + r] = c;
    }
    l_at[r] = L;
    l_at[row_stride + r] = M;
    if (direct && lse) lse[(long long)t * num_heads + h0 + r] = state_lse(M, L);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < rows * D; e += blockDim.x) {
    const int r = e / D, d = e % D;
    float O = 0.0f;
    for (int w = 0; w < num_warps; ++w) O = O + o_at[(w * row_stride + r) * o_stride + d] * m_at[w * row_stride + r];
    const float L = l_at[r], M = l_at[row_stride + r];
    const int h = h0 + r;
    if (direct) {
      const float sink = head_sink ? Act<T>::to_float(head_sink[h]) : 0.0f;
      const float vs = v_quant ? quant_scale(v_scale, v_quant, g, D, d) : 1.0f;
      out[((long long)t * num_heads + h) * D + d] = Act<T>::from_float(finalize(M, L, O, head_sink != nullptr, sink, vs));
    } else {
      const long long row = ((long long)t * num_heads + h) * num_splits + split;
      part_o[row * D + d] = O;
      if (d == 0) part_ml[row] = make_float2(M, L);
    }
  }
}

// Splits [s_first, s_last] of a token (the ones whose key range meets its admitted range) each
// wrote a partial state for rows h0 .. h0 + rows - 1; the CTA that finishes last merges them, with
// the same arithmetic whichever CTA that is, so the bits do not depend on the order CTAs finish
// in (nor on num_splits beyond s_last). `counter` (one per token and head chunk) is zeroed by the
// prologue of the same call. The standard last-block pattern: each CTA fences its partial stores
// before its arrival is counted, and the merging CTA reads the partials from L2 (__ldcg), never
// from a possibly stale L1 line. One warp per row: lanes take splits for the max and the sum (a
// fixed xor tree), then channels, summing the splits in index order with independent loads.
// Called by every thread of the CTA, after store_rows; `last` is one int of free shared memory.
// lse (optional, (N, H) float32): the merged rows' log-sum-exp (state_lse), written by lane 0 of each row.
// MAX_CH: channels per lane (head_size <= 32 * MAX_CH); PRE: splits whose o is loaded together with
// the weights (one round trip fewer for up to PRE splits; 0: none, for kernels short of registers).
template <typename T, int MAX_CH = 8, int PRE = 0>
CUPA_DEVICE void merge_splits_if_last(int* counter, int* last, int s_first, int s_last, int rows, int head_size, int t,
                                      int h0, int num_heads, int g, int num_splits, const T* head_sink,
                                      const float* v_scale, int v_quant, T* out, const float* part_o,
                                      const float2* part_ml, float* lse = nullptr) {
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) *last = atomicAdd(counter, 1) == s_last - s_first;
  __syncthreads();
  if (!*last) return;
  __threadfence();
  const int D = head_size, n = s_last - s_first + 1;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, num_warps = blockDim.x >> 5;
  for (int r = warp; r < rows; r += num_warps) {
    const int h = h0 + r;
    const long long row0 = ((long long)t * num_heads + h) * num_splits + s_first;
    float M = CUPA_NEG_INF;
    for (int i = lane; i < n; i += 32) {
      const float2 ml = __ldcg(part_ml + row0 + i);
      if (ml.y > 0.0f) M = fmaxf(M, ml.x);
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, off));
    float L = 0.0f, O[MAX_CH];
#pragma unroll
    for (int k = 0; k < MAX_CH; ++k) O[k] = 0.0f;
    // The first PRE splits' o, loaded before their weights are known (one round trip fewer).
    float pre[PRE > 0 ? PRE : 1][MAX_CH];
#pragma unroll
    for (int j = 0; j < PRE; ++j)
#pragma unroll
      for (int k = 0; k < MAX_CH; ++k)
        pre[j][k] = j < n && lane + 32 * k < D ? __ldcg(part_o + (row0 + j) * D + lane + 32 * k) : 0.0f;
    for (int base = 0; base < n; base += 32) {
      float c = 0.0f;
      if (base + lane < n) {
        const float2 ml = __ldcg(part_ml + row0 + base + lane);
        if (ml.y > 0.0f) {
          c = rescale(ml.x, M);
          L += ml.y * c;
        }
      }
      const int count = min(32, n - base);
      int j = 0;
      if (PRE > 0 && base == 0) {
#pragma unroll
        for (; j < PRE; ++j) {
          const float cj = __shfl_sync(0xffffffffu, c, j);
          if (j >= count || cj == 0.0f) continue;  // an empty split (or one far below the max) adds nothing
#pragma unroll
          for (int k = 0; k < MAX_CH; ++k)
            if (lane + 32 * k < D) O[k] += cj * pre[j][k];
        }
      }
#pragma unroll 4
      for (; j < count; ++j) {
        const float cj = __shfl_sync(0xffffffffu, c, j);
        if (cj == 0.0f) continue;  // an empty split (or one far below the max) adds nothing
        const float* po = part_o + (row0 + base + j) * D;
#pragma unroll
        for (int k = 0; k < MAX_CH; ++k)
          if (lane + 32 * k < D) O[k] += cj * __ldcg(po + lane + 32 * k);
      }
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) L += __shfl_xor_sync(0xffffffffu, L, off);
    const float sink = head_sink ? Act<T>::to_float(head_sink[h]) : 0.0f;
    if (lse != nullptr && lane == 0) lse[(long long)t * num_heads + h] = state_lse(M, L);
#pragma unroll
    for (int k = 0; k < MAX_CH; ++k) {
      const int d = lane + 32 * k;
      if (d < D) {
        const float vs = v_quant ? quant_scale(v_scale, v_quant, g, D, d) : 1.0f;
        out[((long long)t * num_heads + h) * D + d] = Act<T>::from_float(finalize(M, L, O[k], head_sink != nullptr, sink, vs));
      }
    }
  }
}

// Which splits of a token take part, from its admitted range [lo, hi): s_first .. s_last (both
// clamped to the launched splits; an empty range makes split 0 alone write the empty result).
CUPA_DEVICE void split_span(int lo, int hi, int chunk, int num_splits, int& s_first, int& s_last) {
  if (hi > lo) {
    s_first = min(lo / chunk, num_splits - 1);
    s_last = min((hi - 1) / chunk, num_splits - 1);
  } else {
    s_first = s_last = 0;
  }
}
