// Paged flash-decoding (CUDA cores; every T and cache type; K and V of two packed 4-bit kinds).
// One CTA owns (query token t, KV head g, a chunk of <= GT query heads of g's group, KV split s).
// It reads the token's sequence, position and admitted key range from cum / past_seqlens /
// query_positions on the device, then streams the keys of split s (absolute positions
// [s*chunk, (s+1)*chunk) intersected with the admitted range) through the block table.
// Lanes split the head dimension into 8-element chunks (16-byte loads for 16-bit caches, 4 bytes
// for packed 4-bit codes: Codes8); LPK lanes cover one key, so a warp covers 32/LPK keys per step,
// several steps in flight.
// Each subgroup keeps its own online-softmax state; states are merged in a fixed order
// (xor tree within the warp, warps 0..3 in the CTA), then either finalized into `out` (the
// token's only split with admitted keys) or written as a partial (m, l, o) that the last split
// CTA to finish merges (epilogue.cuh); `lse`, when asked for, is written where the output is.
// Host values that size the launch: token_count, head counts, num_splits (from the static
// capacity or the attention_metadata bound) and chunk (static); none enters a mask.
#include "common.cuh"
#include "epilogue.cuh"
#include "paged.cuh"
#include "quant.cuh"
#include "softmax.cuh"

constexpr int DECODE_WARPS = 4;
constexpr int MAX_HEAD_SIZE = 256;

// 8 consecutive codes of a cache row as they are loaded (Cache::PACK codes per storage element) and
// decoded to floats.
template <typename Cache, int PACK = Cache::PACK> struct Codes8 {
  Vec8<typename Cache::storage> v;
  CUPA_DEVICE void load_nc(const typename Cache::storage* p) { v.load_nc(p); }
  CUPA_DEVICE float value(int i) const { return Cache::decode(v.elems()[i]); }
};
template <typename Cache> struct Codes8<Cache, 2> {
  unsigned w;  // code i in bits 4i..4i+3
  CUPA_DEVICE void load_nc(const typename Cache::storage* p) { w = __ldg(reinterpret_cast<const unsigned*>(p)); }
  CUPA_DEVICE float value(int i) const { return Cache::decode_nibble(w >> (4 * i)); }
};

template <typename T, typename Cache, int GT, typename VCache = Cache>
__global__ void __launch_bounds__(DECODE_WARPS * 32) paged_decode(
    const T* __restrict__ q,  // (N, H, D): prologue output
    const typename Cache::storage* __restrict__ key_cache, const typename VCache::storage* __restrict__ value_cache,
    const int* __restrict__ cum, const int* __restrict__ past, const int* __restrict__ block_table,
    const int* __restrict__ query_positions, const T* __restrict__ head_sink,
    const float* __restrict__ k_scale, const float* __restrict__ v_scale,
    T* __restrict__ out, float* __restrict__ part_o, float2* __restrict__ part_ml, int* __restrict__ counters,
    float* __restrict__ lse,
    int num_heads, int kv_num_heads, int head_size, int batch_size, int num_blocks, int block_size,
    int max_blocks, int chunk, int num_splits, int rotary_max_pos, float scale, float softcap,
    int window, int is_causal, int k_quant, int v_quant, int q_is_input) {
  static_assert(Cache::PACK == VCache::PACK, "K and V rows of one width");
  constexpr int PACK = Cache::PACK;
  // keys in flight per subgroup: two for 32-bit values and for packed codes (whose unpacking takes the
  // registers: with four, ptxas spills at 2 and 4 heads a CTA)
  constexpr int U = (sizeof(typename Cache::storage) == 4 || PACK == 2) ? 2 : 4;
  __shared__ float sm_m[DECODE_WARPS][GT], sm_l[DECODE_WARPS][GT];
  __shared__ float sm_o[DECODE_WARPS][GT][MAX_HEAD_SIZE];
  __shared__ int last_flag;

  const int t = blockIdx.x, split = blockIdx.z;
  const int H = num_heads, Hk = kv_num_heads, D = head_size, G = H / Hk;
  const int chunks_per_kv = (G + GT - 1) / GT;
  const int g = blockIdx.y / chunks_per_kv;
  const int h0 = g * G + (blockIdx.y % chunks_per_kv) * GT;
  const int nh = min(GT, g * G + G - h0);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int nchunk = D / 8;
  int lpk = 1;
  while (lpk < nchunk) lpk <<= 1;
  const int kpi = 32 / lpk, ci = lane % lpk, sg = lane / lpk;
  const bool lane_active = ci < nchunk;

  const TokenInfo info = locate_token_warp(t, cum, past, batch_size, query_positions,
                                           (long long)max_blocks * block_size, rotary_max_pos, lane);
  int lo = 0, hi = 0;
  if (info.valid) key_range(info, is_causal, window, lo, hi);
  int s_first, s_last;
  split_span(lo, hi, chunk, num_splits, s_first, s_last);
  grid_dependency_wait();  // the prologue's Q, cache rows and counters are visible from here
  if (split < s_first || split > s_last) return;  // no admitted key in this split: nothing to merge
  const bool direct = s_first == s_last;
  lo = max(lo, split * chunk);
  hi = min(hi, (int)min((long long)(split + 1) * chunk, (long long)hi));

  // q chunk for each head, with the K scale folded in (exact: the zero point is 0).
  float qr[GT][8];
  float kscale_t = (k_quant == QUANT_PER_TENSOR) ? k_scale[0] : 1.0f;
#pragma unroll
  for (int gi = 0; gi < GT; ++gi) {
#pragma unroll
    for (int i = 0; i < 8; ++i) qr[gi][i] = 0.0f;
    if (gi < nh && lane_active && hi > lo) {
      load8(q + ((long long)t * H + h0 + gi) * D + ci * 8, qr[gi]);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const float ks = k_quant == QUANT_PER_CHANNEL ? k_scale[g * D + ci * 8 + i] : kscale_t;
        qr[gi][i] *= ks * scale;
      }
    }
  }

  float m[GT], l[GT], acc[GT][8];
#pragma unroll
  for (int gi = 0; gi < GT; ++gi) {
    m[gi] = CUPA_NEG_INF;
    l[gi] = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[gi][i] = 0.0f;
  }

  const long long row_stride = (long long)Hk * (D / PACK);  // storage elements per slot
  const int step = DECODE_WARPS * kpi;
  for (int base = lo + warp * kpi + sg; base - sg - warp * kpi < hi; base += U * step) {
    Codes8<Cache> kv[U];
    Codes8<VCache> vv[U];
    bool ok[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int k = base + u * step;
      ok[u] = false;
      if (k < hi) {
        const int blk = physical_block(block_table, max_blocks, num_blocks, info.b, k / block_size);
        if (blk >= 0) {
          ok[u] = true;
          if (lane_active) {
            const long long off =
                ((long long)blk * block_size + k % block_size) * row_stride + (long long)g * (D / PACK) + ci * (8 / PACK);
            kv[u].load_nc(key_cache + off);
            vv[u].load_nc(value_cache + off);
          }
        }
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float kf[8], vf[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        kf[i] = (ok[u] && lane_active) ? kv[u].value(i) : 0.0f;
        vf[i] = (ok[u] && lane_active) ? vv[u].value(i) : 0.0f;
      }
#pragma unroll
      for (int gi = 0; gi < GT; ++gi) {
        float s = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; ++i) s = fmaf(qr[gi][i], kf[i], s);
        for (int off = lpk / 2; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
        if (ok[u]) {
          s = softcap_score(s, softcap);
          const float m_new = fmaxf(m[gi], s);
          const float c = rescale(m[gi], m_new);
          const float p = __expf(s - m_new);
          l[gi] = l[gi] * c + p;
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[gi][i] = acc[gi][i] * c + p * vf[i];
          m[gi] = m_new;
        }
      }
    }
  }

  // Merge subgroups of the warp (xor tree), then warps in order.
#pragma unroll
  for (int gi = 0; gi < GT; ++gi) {
    for (int off = lpk; off < 32; off <<= 1) {
      const float m2 = __shfl_xor_sync(0xffffffffu, m[gi], off);
      const float l2 = __shfl_xor_sync(0xffffffffu, l[gi], off);
      const float M = fmaxf(m[gi], m2);
      const float c1 = rescale(m[gi], M), c2 = rescale(m2, M);
      l[gi] = l[gi] * c1 + l2 * c2;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const float a2 = __shfl_xor_sync(0xffffffffu, acc[gi][i], off);
        acc[gi][i] = acc[gi][i] * c1 + a2 * c2;
      }
      m[gi] = M;
    }
    if (lane == 0) {
      sm_m[warp][gi] = m[gi];
      sm_l[warp][gi] = l[gi];
    }
    if (sg == 0 && lane_active) {
#pragma unroll
      for (int i = 0; i < 8; ++i) sm_o[warp][gi][ci * 8 + i] = acc[gi][i];
    }
  }
  __syncthreads();

  store_rows<T>(&sm_m[0][0], &sm_l[0][0], &sm_o[0][0][0], DECODE_WARPS, GT, MAX_HEAD_SIZE, nh, D, t, h0, H, g, split,
                num_splits, direct, head_sink, v_scale, v_quant, out, part_o, part_ml, lse);
  if (!direct)
    merge_splits_if_last<T>(counters + (long long)t * gridDim.y + blockIdx.y, &last_flag, s_first, s_last, nh, D, t,
                            h0, H, g, num_splits, head_sink, v_scale, v_quant, out, part_o, part_ml, lse);
}
