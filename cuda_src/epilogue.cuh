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
// Rows are query heads h0 .. h0 + rows - 1 of token t (KV head g). Called by every thread of the CTA.
template <typename T>
CUPA_DEVICE void store_rows(const float* m_at, const float* l_at, const float* o_at, int num_warps, int row_stride,
                            int o_stride, int rows, int head_size, int t, int h0, int num_heads, int g, int split,
                            int num_splits, bool direct, const T* head_sink, const float* v_scale, int v_quant, T* out,
                            float* part_o, float2* part_ml) {
  const int D = head_size;
  for (int e = threadIdx.x; e < rows * D; e += blockDim.x) {
    const int r = e / D, d = e % D;
    float M = CUPA_NEG_INF;
    for (int w = 0; w < num_warps; ++w) M = fmaxf(M, m_at[w * row_stride + r]);
    float L = 0.0f, O = 0.0f;
    for (int w = 0; w < num_warps; ++w) {
      const float c = rescale(m_at[w * row_stride + r], M);
      L = L * 1.0f + l_at[w * row_stride + r] * c;
      O = O + o_at[(w * row_stride + r) * o_stride + d] * c;
    }
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
// wrote a partial state for rows h0 .. h0 + rows - 1; the CTA that finishes last merges them, in
// split order and with the same arithmetic whichever CTA that is, so the bits do not depend on
// the order CTAs finish in. `counter` (one per token and head chunk) is zeroed by the prologue of
// the same call. The standard last-block pattern: each CTA fences its partial stores before its
// arrival is counted, and the merging CTA reads the partials from L2 (__ldcg), never from a
// possibly stale L1 line. Called by every thread of the CTA, after store_rows.
// `last` is one int of shared memory, free for this use.
template <typename T>
CUPA_DEVICE void merge_splits_if_last(int* counter, int* last, int s_first, int s_last, int rows, int head_size, int t,
                                      int h0, int num_heads, int g, int num_splits, const T* head_sink,
                                      const float* v_scale, int v_quant, T* out, const float* part_o,
                                      const float2* part_ml) {
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) *last = atomicAdd(counter, 1) == s_last - s_first;
  __syncthreads();
  if (!*last) return;
  __threadfence();
  const int D = head_size;
  for (int e = threadIdx.x; e < rows * D; e += blockDim.x) {
    const int r = e / D, d = e % D, h = h0 + r;
    const long long row0 = ((long long)t * num_heads + h) * num_splits;
    float M = CUPA_NEG_INF;
    for (int s = s_first; s <= s_last; ++s) {
      const float2 ml = __ldcg(part_ml + row0 + s);
      if (ml.y > 0.0f) M = fmaxf(M, ml.x);
    }
    float L = 0.0f, O = 0.0f;
    for (int s = s_first; s <= s_last; ++s) {
      const float2 ml = __ldcg(part_ml + row0 + s);
      if (ml.y > 0.0f) {
        const float c = rescale(ml.x, M);
        L = L * 1.0f + ml.y * c;
        O = O + __ldcg(part_o + (row0 + s) * D + d) * c;
      }
    }
    const float sink = head_sink ? Act<T>::to_float(head_sink[h]) : 0.0f;
    const float vs = v_quant ? quant_scale(v_scale, v_quant, g, D, d) : 1.0f;
    out[((long long)t * num_heads + h) * D + d] = Act<T>::from_float(finalize(M, L, O, head_sink != nullptr, sink, vs));
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
