// The end of a decode CTA, shared by the CUDA-core and tensor-core kernels: merge the warps'
// partial states in warp order, then finalize the rows into the output (one split) or write
// them as this split's partial state for paged_decode_merge.
#pragma once
#include "common.cuh"
#include "quant.cuh"
#include "softmax.cuh"

// Row r of warp w: m at m_at[w * row_stride + r], l likewise, o at o_at[(w * row_stride + r) * o_stride + d].
// Rows are query heads h0 .. h0 + rows - 1 of token t (KV head g). Called by every thread of the CTA.
template <typename T>
CUPA_DEVICE void store_rows(const float* m_at, const float* l_at, const float* o_at, int num_warps, int row_stride,
                            int o_stride, int rows, int head_size, int t, int h0, int num_heads, int g, int split,
                            int num_splits, const T* head_sink, const float* v_scale, int v_quant, T* out,
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
    if (num_splits == 1) {
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
