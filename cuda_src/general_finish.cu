// The end of a general-backend call (after general_mma.cu or general_simt.cu), launched when the call has
// several KV splits or asks for output_qk. One warp owns (token t, query head h) and, of h's output_qk
// row, the keys [z * FINISH_KEYS, (z + 1) * FINISH_KEYS) of CTA z = blockIdx.z:
// - several splits: it merges the partial states of the splits that meet the row's admitted range
//   (general.cuh), in split order (the same bits whatever order the attention CTAs ran in), into the
//   row's lse and, in CTA z = 0, its output row (sink, V scale) and lse output; a row without admitted
//   keys outputs zeros and lse -inf;
// - output_qk: the row's entries outside its admitted range [lo, hi) are zeros; under qk_output=2 the
//   scores the attention kernel wrote inside it become probabilities exp(s - lse) / (1 + exp(sink - lse))
//   (masked entries hold -inf: 0); under qk_output=1 they stay as written.
// With one split, the attention kernel wrote the output rows and the lse this reads (qk_output=2).
// Reads: cum, past_seqlens, query_positions (the row's range), the partial states, output_qk's written
// entries, lse (one split). Writes: out and lse (several splits), output_qk.
// Floors: output_qk is read (qk_output=2) and written once, 16-byte accesses, 4 in flight per lane; the
// partial states are N * H * splits * (v_head_size + 2) floats.
// Launch: grid (token_count, ceil(H / FINISH_WARPS), ceil(kv_capacity / FINISH_KEYS) under output_qk,
// else 1); host values that size it: token_count, num_heads, kv_capacity (output_qk's width).
#include "common.cuh"
#include "epilogue.cuh"  // split_span
#include "general.cuh"
#include "paged.cuh"
#include "quant.cuh"
#include "softmax.cuh"

constexpr int FINISH_WARPS = 4;     // (token, head) rows per CTA
constexpr int FINISH_KEYS = 2048;   // output_qk keys of a row per CTA
constexpr int FINISH_MAX_CH = 32;   // output channels per lane: v_head_size <= 32 * FINISH_MAX_CH
constexpr int FINISH_UNROLL = 4;    // 16-byte output_qk loads in flight per lane

template <typename T>
__global__ void __launch_bounds__(FINISH_WARPS * 32) paged_general_finish(
    const int* __restrict__ cum, const int* __restrict__ past, const int* __restrict__ query_positions,
    const T* __restrict__ head_sink, const float* __restrict__ v_scale, const T* __restrict__ bias,
    const float* __restrict__ part_o, const float2* __restrict__ part_ml, T* __restrict__ out,
    float* __restrict__ output_qk, float* __restrict__ lse, int token_count, int num_heads, int kv_num_heads,
    int head_size, int v_head_size, int batch_size, long long static_kv_capacity, int chunk, int num_splits,
    int rotary_max_pos, int window, int is_causal, int v_quant, int bias_q, int bias_k, int qk_mode,
    int kv_capacity) {
  const int t = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int h = blockIdx.y * FINISH_WARPS + warp;
  if (h >= num_heads) return;  // the whole warp
  const TokenInfo info =
      locate_token_warp(t, cum, past, batch_size, query_positions, static_kv_capacity, rotary_max_pos, lane);
  const BiasView<T> capacities{bias, 1, 1, bias_q, bias_k};  // only bias_q, bias_k and whether there is one
  int lo, hi;
  admitted_range(info, is_causal, window, capacities, lo, hi);
  const long long row = (long long)t * num_heads + h;
  const bool has_sink = head_sink != nullptr;
  const float sink = has_sink ? Act<T>::to_float(head_sink[h]) : 0.0f;

  float row_lse = CUPA_NEG_INF;
  if (num_splits > 1) {
    int s_first = 0, s_last = -1;  // no split for a row without admitted keys (none wrote a state for it)
    if (hi > lo) split_span(lo, hi, chunk, num_splits, s_first, s_last);
    const int n = s_last - s_first + 1;
    const float2* ml = part_ml + row * num_splits + s_first;
    float M = CUPA_NEG_INF, L = 0.0f;
    for (int i = lane; i < n; i += 32) {
      const float2 v = ml[i];
      if (v.y > 0.0f) M = fmaxf(M, v.x);
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, off));
    for (int i = lane; i < n; i += 32) {
      const float2 v = ml[i];
      if (v.y > 0.0f) L += v.y * rescale(v.x, M);
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) L += __shfl_xor_sync(0xffffffffu, L, off);
    row_lse = state_lse(M, L);
    if (blockIdx.z == 0) {
      const int Dv = v_head_size, g = h / (num_heads / kv_num_heads);
      if (lse && lane == 0) lse[row] = row_lse;
      float O[FINISH_MAX_CH];
#pragma unroll
      for (int k = 0; k < FINISH_MAX_CH; ++k) O[k] = 0.0f;
      for (int i = 0; i < n; ++i) {
        const float2 v = ml[i];
        if (!(v.y > 0.0f)) continue;  // a split whose keys were all masked adds nothing
        const float c = rescale(v.x, M);
        const float* po = part_o + (row * num_splits + s_first + i) * Dv;
#pragma unroll
        for (int k = 0; k < FINISH_MAX_CH; ++k)
          if (lane + 32 * k < Dv) O[k] += c * po[lane + 32 * k];
      }
#pragma unroll
      for (int k = 0; k < FINISH_MAX_CH; ++k) {
        const int d = lane + 32 * k;
        if (d < Dv) {
          const float vs = v_quant ? quant_scale(v_scale, v_quant, g, head_size, d) : 1.0f;
          out[row * Dv + d] = Act<T>::from_float(finalize(M, L, O[k], has_sink, sink, vs));
        }
      }
    }
  } else if (qk_mode == 2 && hi > lo) {
    row_lse = lse[row];  // written by the attention kernel
  }
  if (!qk_mode) return;

  // output_qk keys [k0, k1) of the row: zeros outside [qlo, qhi), probabilities (qk_output=2) inside.
  float* qk_row = output_qk + ((long long)h * token_count + t) * kv_capacity;
  const int qhi = min(hi, kv_capacity), qlo = min(lo, qhi);
  const bool probabilities = qk_mode == 2 && row_lse != CUPA_NEG_INF;
  const float share = probabilities ? keys_share(row_lse, has_sink, sink) : 0.0f;
  auto value = [&](int k, float s) {
    if (k < qlo || k >= qhi) return 0.0f;
    if (qk_mode == 1) return s;
    return probabilities ? __expf(s - row_lse) * share : 0.0f;  // a masked entry (-inf) gives 0
  };
  const int k0 = blockIdx.z * FINISH_KEYS, k1 = min(k0 + FINISH_KEYS, kv_capacity);
  if ((kv_capacity & 3) == 0) {  // rows start on 16-byte boundaries
    for (int kb = k0 + 4 * lane; kb < k1; kb += 128 * FINISH_UNROLL) {
      float4 v[FINISH_UNROLL];
#pragma unroll
      for (int u = 0; u < FINISH_UNROLL; ++u) {
        const int k = kb + 128 * u;
        const bool written = k < k1 && k + 4 > qlo && k < qhi;  // some entry inside the admitted range
        v[u] = written ? *reinterpret_cast<const float4*>(qk_row + k) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      }
#pragma unroll
      for (int u = 0; u < FINISH_UNROLL; ++u) {
        const int k = kb + 128 * u;
        if (k >= k1 || (qk_mode == 1 && k >= qlo && k + 4 <= qhi)) continue;  // none, or final scores
        const float4 w = make_float4(value(k, v[u].x), value(k + 1, v[u].y), value(k + 2, v[u].z),
                                     value(k + 3, v[u].w));
        *reinterpret_cast<float4*>(qk_row + k) = w;
      }
    }
  } else {
    for (int k = k0 + lane; k < k1; k += 32) {
      const bool inside = k >= qlo && k < qhi;
      if (qk_mode == 1 && inside) continue;  // a final score
      qk_row[k] = value(k, inside ? qk_row[k] : 0.0f);
    }
  }
}
