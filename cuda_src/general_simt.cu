// The general backend on CUDA cores: every T (float32 too), every head size (LATENT up to 1024
// channels), every cache type, with attention_bias, output_qk, lse, sinks, softcap and splits.
// One CTA owns (query token t, KV head g, a chunk of <= GT query heads of g's group, KV split s). It
// reads the token's sequence, position and admitted range (general.cuh) on the device, then streams
// the keys of split s through the block table as paged_decode does (decode.cu): lanes split the head
// dimension into 8-element chunks, LPK lanes cover one key (LPK = 32 and CPL chunks a lane when
// head_size > 256), each subgroup keeps its own online-softmax state, merged in a fixed order (xor tree
// in the warp, warps in order). A score is scale * q.k + bias[b|0, h|0, j, k] (read for admitted keys
// only), then softcap; it goes to output_qk when asked. In LATENT (value_cache null) V is the leading
// v_head_size channels of the K row, read once.
// The end: one split finalizes the heads into `out` and their lse (every token has CTAs, so every
// output row is written, zeros where no key is admitted); several write partial states (general.cuh)
// that general_finish.cu merges.
// Floors: CUDA-core FMAs, head_size (+ v_head_size) a key and head, K/V bytes read once per CTA (per
// GT heads). A fallback for what the tensor-core kernel (general_mma.cu) does not take.
// Launch: grid (token_count, Hk * ceil(G / GT), num_splits); host values that size it: token_count,
// head counts, num_splits (from the static capacity or the attention_metadata bound) and chunk
// (static); none enters a mask.
#include "common.cuh"
#include "epilogue.cuh"  // split_span
#include "general.cuh"
#include "paged.cuh"
#include "quant.cuh"
#include "softmax.cuh"

constexpr int GSIMT_WARPS = 4;

// The CTA's merged rows into the outputs. Row r (query head h0 + r) of warp w has its state at
// sm_m[w * GT + r], sm_l[...], sm_o[(w * GT + r) * slots + d]. One thread per row merges the warps'
// maxima and sums and turns each warp's m into its weight exp(m - M) in place (sm_l's first two warp
// rows then hold the row's L and M); then every thread sums its channels' weighted o and writes them
// finalized (direct) or as this split's partial state.
template <typename T, int GT>
CUPA_DEVICE void general_store_rows(float* sm_m, float* sm_l, const float* sm_o, int slots, int rows, int head_size,
                                    int v_head_size, int t, int h0, int num_heads, int g, int split, int num_splits,
                                    const T* head_sink, const float* v_scale, int v_quant, T* out, float* lse,
                                    float* part_o, float2* part_ml) {
  const bool direct = num_splits == 1;
  for (int r = threadIdx.x; r < rows; r += blockDim.x) {
    float M = CUPA_NEG_INF;
    for (int w = 0; w < GSIMT_WARPS; ++w) M = fmaxf(M, sm_m[w * GT + r]);
    float L = 0.0f;
    for (int w = 0; w < GSIMT_WARPS; ++w) {
      const float c = rescale(sm_m[w * GT + r], M);
      L += sm_l[w * GT + r] * c;
      sm_m[w * GT + r] = c;
    }
    sm_l[r] = L;
    sm_l[GT + r] = M;
    const long long row = (long long)t * num_heads + h0 + r;
    if (direct && lse) lse[row] = state_lse(M, L);
    if (!direct) part_ml[row * num_splits + split] = make_float2(M, L);
  }
  __syncthreads();
  const int Dv = v_head_size;
  for (int e = threadIdx.x; e < rows * Dv; e += blockDim.x) {
    const int r = e / Dv, d = e % Dv;
    float O = 0.0f;
    for (int w = 0; w < GSIMT_WARPS; ++w) O += sm_o[(w * GT + r) * slots + d] * sm_m[w * GT + r];
    const int h = h0 + r;
    const long long row = (long long)t * num_heads + h;
    if (direct) {
      const float sink = head_sink ? Act<T>::to_float(head_sink[h]) : 0.0f;
      const float vs = v_quant ? quant_scale(v_scale, v_quant, g, head_size, d) : 1.0f;
      out[row * Dv + d] = Act<T>::from_float(finalize(sm_l[GT + r], sm_l[r], O, head_sink != nullptr, sink, vs));
    } else {
      part_o[(row * num_splits + split) * Dv + d] = O;
    }
  }
}

template <typename T, typename Cache, int GT, int CPL>
__global__ void __launch_bounds__(GSIMT_WARPS * 32, 1) paged_general_simt(
    const T* __restrict__ q,  // (N, H, D): prologue output, or `query` itself
    const typename Cache::storage* __restrict__ key_cache,
    const typename Cache::storage* __restrict__ value_cache,  // null in LATENT
    const int* __restrict__ cum, const int* __restrict__ past, const int* __restrict__ block_table,
    const int* __restrict__ query_positions, const T* __restrict__ head_sink, const float* __restrict__ k_scale,
    const float* __restrict__ v_scale, const T* __restrict__ bias, T* __restrict__ out,
    float* __restrict__ output_qk, float* __restrict__ lse, float* __restrict__ part_o, float2* __restrict__ part_ml,
    int token_count, int num_heads, int kv_num_heads, int head_size, int v_head_size, int batch_size, int num_blocks,
    int block_size, int max_blocks, int chunk, int num_splits, int rotary_max_pos, float scale, float softcap,
    int window, int is_causal, int k_quant, int v_quant, int bias_batch, int bias_heads, int bias_q, int bias_k,
    int qk_mode, int kv_capacity) {
  using C = typename Cache::storage;
  constexpr int WARPS = GSIMT_WARPS;
  constexpr int SLOTS = 256 * CPL;                                     // channels of a head's accumulator row
  // Keys in flight per subgroup: 4, halved for 4-byte caches and again when a lane holds several chunks.
  constexpr int U = (sizeof(C) == 4 ? 1 : 2) * (CPL == 1 ? 2 : 1);
  constexpr bool ONLY_LATENT = CPL > 1;                               // head_size > 256: LATENT only
  __shared__ float sm_m[WARPS * GT], sm_l[WARPS * GT];
  __shared__ float sm_o[WARPS * GT * SLOTS];

  const int t = blockIdx.x, split = blockIdx.z;
  const int H = num_heads, Hk = kv_num_heads, D = head_size, Dv = v_head_size, G = H / Hk;
  const int chunks_per_kv = (G + GT - 1) / GT;
  const int g = blockIdx.y / chunks_per_kv;
  const int h0 = g * G + (blockIdx.y % chunks_per_kv) * GT;
  const int nh = min(GT, g * G + G - h0);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int nchunk = D / 8;
  int lpk = 32;
  if (CPL == 1) {
    lpk = 1;
    while (lpk < nchunk) lpk <<= 1;
  }
  const int kpi = 32 / lpk, ci = lane % lpk, sg = lane / lpk;
  const bool latent = ONLY_LATENT || value_cache == nullptr;

  const TokenInfo info = locate_token_warp(t, cum, past, batch_size, query_positions,
                                           (long long)max_blocks * block_size, rotary_max_pos, lane);
  const BiasView<T> bv{bias, bias_batch, bias_heads, bias_q, bias_k};
  int lo, hi;
  admitted_range(info, is_causal, window, bv, lo, hi);
  int s_first, s_last;
  split_span(lo, hi, chunk, num_splits, s_first, s_last);
  grid_dependency_wait();  // the prologue's Q and cache rows are visible from here
  if (split < s_first || split > s_last) return;  // no admitted key in this split: no state to write
  lo = (int)max((long long)lo, (long long)split * chunk);
  hi = (int)min((long long)hi, (long long)(split + 1) * chunk);

  // Q chunks of each head with the score scale and the K scale folded in (exact: the zero point is 0).
  float qr[GT][CPL][8];
  const float kscale_t = k_quant == QUANT_PER_TENSOR ? k_scale[0] : 1.0f;
#pragma unroll
  for (int gi = 0; gi < GT; ++gi) {
#pragma unroll
    for (int c = 0; c < CPL; ++c) {
      const int chunk_c = ci + lpk * c;
#pragma unroll
      for (int i = 0; i < 8; ++i) qr[gi][c][i] = 0.0f;
      if (gi < nh && chunk_c < nchunk && hi > lo) {
        load8(q + ((long long)t * H + h0 + gi) * D + chunk_c * 8, qr[gi][c]);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const float ks = k_quant == QUANT_PER_CHANNEL ? k_scale[g * D + chunk_c * 8 + i] : kscale_t;
          qr[gi][c][i] *= ks * scale;
        }
      }
    }
  }

  float m[GT], l[GT], acc[GT][CPL][8];
#pragma unroll
  for (int gi = 0; gi < GT; ++gi) {
    m[gi] = CUPA_NEG_INF;
    l[gi] = 0.0f;
#pragma unroll
    for (int c = 0; c < CPL; ++c)
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[gi][c][i] = 0.0f;
  }
  const float inv_softcap = softcap > 0.0f ? 1.0f / softcap : 0.0f;
  // Head h0's bias row and output_qk row; head h0 + gi's are gi strides further.
  const T* bias_h0 = bias && hi > lo ? bv.row(info.b, h0, info.j) : bias;
  const long long bias_stride = bias_heads > 1 ? (long long)bias_q * bias_k : 0;
  float* qk_h0 = output_qk + ((long long)h0 * token_count + t) * kv_capacity;
  const long long qk_stride = (long long)token_count * kv_capacity;

  const long long row_stride = (long long)Hk * D;
  const int step = WARPS * kpi;
  for (int base = lo + warp * kpi + sg; base - sg - warp * kpi < hi; base += U * step) {
    Vec8<C> kv[U][CPL], vv[U][ONLY_LATENT ? 1 : CPL];
    bool ok[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int k = base + u * step;
      ok[u] = false;
      if (k < hi) {
        const int blk = physical_block(block_table, max_blocks, num_blocks, info.b, k / block_size);
        if (blk >= 0) {
          ok[u] = true;
          const long long off = ((long long)blk * block_size + k % block_size) * row_stride + (long long)g * D;
#pragma unroll
          for (int c = 0; c < CPL; ++c) {
            const int chunk_c = ci + lpk * c;
            if (chunk_c < nchunk) {
              kv[u][c].load_nc(key_cache + off + chunk_c * 8);
              if constexpr (!ONLY_LATENT) {
                if (!latent) vv[u][c].load_nc(value_cache + off + chunk_c * 8);
              }
            }
          }
        }
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int k = base + u * step;
      float kf[CPL][8], vf[CPL][8];
#pragma unroll
      for (int c = 0; c < CPL; ++c) {
        const bool have = ok[u] && ci + lpk * c < nchunk;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          kf[c][i] = have ? Cache::decode(kv[u][c].elems()[i]) : 0.0f;
          if constexpr (ONLY_LATENT) {
            vf[c][i] = kf[c][i];
          } else {
            vf[c][i] = !have ? 0.0f : (latent ? kf[c][i] : Cache::decode(vv[u][c].elems()[i]));
          }
        }
      }
#pragma unroll
      for (int gi = 0; gi < GT; ++gi) {
        float s = 0.0f;
#pragma unroll
        for (int c = 0; c < CPL; ++c)
#pragma unroll
          for (int i = 0; i < 8; ++i) s = fmaf(qr[gi][c][i], kf[c][i], s);
#pragma unroll
        for (int off = 16; off > 0; off >>= 1)
          if (off < lpk) s += __shfl_xor_sync(0xffffffffu, s, off);
        if (k < hi && gi < nh) {  // a key of this split's admitted range: its output_qk entry is this CTA's
          if (ok[u]) {
            if (bias) s += Act<T>::to_float(__ldg(bias_h0 + gi * bias_stride + k));
            if (softcap > 0.0f) s = softcap * tanhf(s * inv_softcap);
          }
          if (qk_mode && ci == 0 && k < kv_capacity) qk_h0[gi * qk_stride + k] = qk_entry(ok[u], s, qk_mode);
        }
        if (ok[u]) {
          const float m_new = fmaxf(m[gi], s);
          const float c = rescale(m[gi], m_new);
          const float p = s == CUPA_NEG_INF ? 0.0f : __expf(s - m_new);  // a -inf bias entry adds nothing
          l[gi] = l[gi] * c + p;
#pragma unroll
          for (int cc = 0; cc < CPL; ++cc)
#pragma unroll
            for (int i = 0; i < 8; ++i) acc[gi][cc][i] = acc[gi][cc][i] * c + p * vf[cc][i];
          m[gi] = m_new;
        }
      }
    }
  }

  // Merge the subgroups of the warp (xor tree), then park each warp's state for the CTA merge.
#pragma unroll
  for (int gi = 0; gi < GT; ++gi) {
    for (int off = lpk; off < 32; off <<= 1) {
      const float m2 = __shfl_xor_sync(0xffffffffu, m[gi], off);
      const float l2 = __shfl_xor_sync(0xffffffffu, l[gi], off);
      const float M = fmaxf(m[gi], m2);
      const float c1 = rescale(m[gi], M), c2 = rescale(m2, M);
      l[gi] = l[gi] * c1 + l2 * c2;
#pragma unroll
      for (int c = 0; c < CPL; ++c)
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const float a2 = __shfl_xor_sync(0xffffffffu, acc[gi][c][i], off);
          acc[gi][c][i] = acc[gi][c][i] * c1 + a2 * c2;
        }
      m[gi] = M;
    }
    if (lane == 0) {
      sm_m[warp * GT + gi] = m[gi];
      sm_l[warp * GT + gi] = l[gi];
    }
    if (sg == 0) {
#pragma unroll
      for (int c = 0; c < CPL; ++c) {
        const int chunk_c = ci + lpk * c;
        if (chunk_c < nchunk)
#pragma unroll
          for (int i = 0; i < 8; ++i) sm_o[(warp * GT + gi) * SLOTS + chunk_c * 8 + i] = acc[gi][c][i];
      }
    }
  }
  __syncthreads();
  general_store_rows<T, GT>(sm_m, sm_l, sm_o, SLOTS, nh, D, Dv, t, h0, H, g, split, num_splits, head_sink, v_scale,
                            v_quant, out, lse, part_o, part_ml);
}
