// Paged flash-decoding on tensor cores (fp16/bf16 T; T, int8 or fp8 caches; head_size 64/128).
// One CTA owns (query token t, KV head g, a chunk of up to 16 query heads of g's group, split s):
// the chunk's heads are the 16 rows of an mma.sync m16n8k16 tile, so each KV byte is read once
// per KV head. Keys of the split's admitted range stream through shared memory in tiles of 64
// (cp.async, NST stages, rows gathered through the block table one by one, so any block_size
// works; masked rows are zero-filled). Quantized tiles land as codes and are widened to T in
// shared memory (exact: int8 and e4m3 values are representable in fp16/bf16); the K scale is
// folded into Q (PER_CHANNEL) or the score scale (PER_TENSOR), the V scale into the epilogue.
// Each of the 4 warps takes 16 keys of a tile and keeps its own online-softmax state; the warps
// are merged in a fixed order, then finalized (one split) or written as a partial for
// paged_decode_merge (decode.cu). Host values that size the launch: token_count, head counts,
// num_splits and chunk (see decode.cu); none enters a mask.
#include "common.cuh"
#include "epilogue.cuh"
#include "mma.cuh"
#include "paged.cuh"
#include "quant.cuh"
#include "softmax.cuh"

constexpr int MMA_WARPS = 4;
constexpr int MMA_ROWS = 16;
constexpr int KEY_TILE = 64;

template <typename Cache> struct MmaStages { static constexpr int value = Cache::quantized ? 4 : 3; };

template <typename T, typename Cache, int D>
struct MmaDecodeSmem {
  using C = typename Cache::storage;
  static constexpr int NST = MmaStages<Cache>::value;
  static constexpr int q_bytes = MMA_ROWS * D * 2;
  static constexpr int stage_bytes = 2 * KEY_TILE * D * (int)sizeof(C);        // K and V tiles as stored
  static constexpr int wide_bytes = Cache::quantized ? 2 * KEY_TILE * D * 2 : 0; // widened K and V
  static constexpr int rows_bytes = (NST + 1) * KEY_TILE * 8;  // row offsets, one tile ahead
  static constexpr int combine_bytes = MMA_WARPS * MMA_ROWS * (D + 2) * 4;
  static constexpr int loop_bytes = q_bytes + NST * stage_bytes + wide_bytes + rows_bytes;
  static constexpr int total = loop_bytes > combine_bytes + q_bytes ? loop_bytes : combine_bytes + q_bytes;
};

template <typename T, typename Cache, int D>
__global__ void __launch_bounds__(MMA_WARPS * 32) paged_decode_mma(
    const T* __restrict__ q,  // (N, H, D): prologue output
    const typename Cache::storage* __restrict__ key_cache, const typename Cache::storage* __restrict__ value_cache,
    const int* __restrict__ cum, const int* __restrict__ past, const int* __restrict__ block_table,
    const int* __restrict__ query_positions, const T* __restrict__ head_sink,
    const float* __restrict__ k_scale, const float* __restrict__ v_scale,
    T* __restrict__ out, float* __restrict__ part_o, float2* __restrict__ part_ml,
    int num_heads, int kv_num_heads, int batch_size, int num_blocks, int block_size,
    int max_blocks, int chunk, int num_splits, int rotary_max_pos, float scale, float softcap,
    int window, int is_causal, int k_quant, int v_quant) {
  using C = typename Cache::storage;
  using L = MmaDecodeSmem<T, Cache, D>;
  constexpr int NST = L::NST;
  static_assert(D % 64 == 0 && D <= 128, "head_size 64 or 128");

  extern __shared__ __align__(16) unsigned char smem[];
  T* sQ = reinterpret_cast<T*>(smem);
  unsigned char* stages = smem + L::q_bytes;
  T* sKw = reinterpret_cast<T*>(stages + NST * L::stage_bytes);  // widened tiles (quantized only)
  T* sVw = sKw + KEY_TILE * D;
  // Element offset of each key row of a tile in the caches (-1: masked), computed one pipeline
  // step before its copies are issued, so the block-table reads never stall the copy issue.
  long long* sRows = reinterpret_cast<long long*>(stages + NST * L::stage_bytes + L::wide_bytes);

  const int t = blockIdx.x, split = blockIdx.z;
  const int H = num_heads, Hk = kv_num_heads, G = H / Hk;
  const int row_chunks = (G + MMA_ROWS - 1) / MMA_ROWS;
  const int g = blockIdx.y / row_chunks;
  const int h0 = g * G + (blockIdx.y % row_chunks) * MMA_ROWS;
  const int nh = min(MMA_ROWS, g * G + G - h0);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;

  const TokenInfo info = locate_token(t, cum, past, batch_size, query_positions,
                                      (long long)max_blocks * block_size, rotary_max_pos);
  int lo = 0, hi = 0;
  if (info.valid) key_range(info, is_causal, window, lo, hi);
  lo = max(lo, split * chunk);
  hi = (int)min((long long)hi, (long long)(split + 1) * chunk);
  const int ntiles = hi > lo ? (hi - lo + KEY_TILE - 1) / KEY_TILE : 0;
  if (num_splits > 1 && ntiles == 0) return;  // the merge skips splits outside the admitted range

  // Q rows (K scale folded in per channel), zero rows past the chunk's heads.
  for (int c = tid; c < MMA_ROWS * (D / 8); c += blockDim.x) {
    const int r = c / (D / 8), col = (c % (D / 8)) * 8;
    float v[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = 0.0f;
    if (r < nh && ntiles > 0) {
      load8(q + ((long long)t * H + h0 + r) * D + col, v);
      if (k_quant == QUANT_PER_CHANNEL) {
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] *= k_scale[g * D + col + i];
      }
    }
    store8(sQ + swz<D>(r, col), v);
  }

  const long long row_stride = (long long)Hk * D;
  // Row offsets of tile `tile` into slot tile % (NST + 1); threads 0..63 take one key each.
  auto find_rows = [&](int tile) {
    if (tid < KEY_TILE) {
      const int k = lo + tile * KEY_TILE + tid;
      int blk = -1;
      if (tile < ntiles && k < hi) blk = physical_block(block_table, max_blocks, num_blocks, info.b, k / block_size);
      sRows[(tile % (NST + 1)) * KEY_TILE + tid] =
          blk >= 0 ? ((long long)blk * block_size + k % block_size) * row_stride + (long long)g * D : -1;
    }
  };
  auto load_tile = [&](int tile) {
    C* sK = reinterpret_cast<C*>(stages + (tile % NST) * L::stage_bytes);
    gather_kv_tile<C, Cache::quantized, D, KEY_TILE, MMA_WARPS * 32>(
        sK, sK + KEY_TILE * D, sRows + (tile % (NST + 1)) * KEY_TILE, key_cache, value_cache, tid);
  };

#pragma unroll
  for (int s = 0; s < NST; ++s) find_rows(s);
  __syncthreads();  // sQ, row offsets of the first NST tiles
#pragma unroll
  for (int s = 0; s < NST - 1; ++s) {
    if (s < ntiles) load_tile(s);
    cp_async_commit();
  }

  unsigned qf[D / 16][4];
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) ldmatrix_x4(qf[kk], sQ + swz<D>(lane & 15, kk * 16 + (lane >> 4) * 8));

  const float score_scale = scale * (k_quant == QUANT_PER_TENSOR ? k_scale[0] : 1.0f);
  float o[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
  float m0 = CUPA_NEG_INF, m1 = CUPA_NEG_INF, l0 = 0.0f, l1 = 0.0f;

  for (int tile = 0; tile < ntiles; ++tile) {
    cp_async_wait<NST - 2>();
    __syncthreads();
    const int stage = tile % NST;
    if (tile + NST - 1 < ntiles) load_tile(tile + NST - 1);
    cp_async_commit();
    if (tile + NST < ntiles) find_rows(tile + NST);  // read after the next barrier

    const T* sK;
    const T* sV;
    if constexpr (Cache::quantized) {
      // Each warp widens only its own 16 key rows, so no CTA-wide barrier is needed here.
      const C* rK = reinterpret_cast<const C*>(stages + stage * L::stage_bytes);
      const C* rV = rK + KEY_TILE * D;
      for (int c = lane; c < 16 * D / 16; c += 32) {
        const int key = warp * 16 + c / (D / 16), col = (c % (D / 16)) * 16;
        widen16<T, Cache>(rK + key * D + col, sKw + swz<D>(key, col), sKw + swz<D>(key, col + 8));
        widen16<T, Cache>(rV + key * D + col, sVw + swz<D>(key, col), sVw + swz<D>(key, col + 8));
      }
      __syncwarp();
      sK = sKw;
      sV = sVw;
    } else {
      sK = reinterpret_cast<const T*>(stages + stage * L::stage_bytes);
      sV = sK + KEY_TILE * D;
    }

    // S = Q K^T for this warp's 16 keys.
    float s[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      unsigned b[4];
      const int mi = lane >> 3;
      ldmatrix_x4(b, sK + swz<D>(warp * 16 + (mi >> 1) * 8 + (lane & 7), kk * 16 + (mi & 1) * 8));
      Mma<T>::run(s[0], qf[kk], b[0], b[1]);
      Mma<T>::run(s[1], qf[kk], b[2], b[3]);
    }
    const long long* valid = sRows + (tile % (NST + 1)) * KEY_TILE + warp * 16;
    float mx0 = CUPA_NEG_INF, mx1 = CUPA_NEG_INF;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = j * 8 + (lane & 3) * 2 + (e & 1);
        float v = softcap_score(s[j][e] * score_scale, softcap);
        s[j][e] = valid[key] >= 0 ? v : CUPA_NEG_INF;
      }
      mx0 = fmaxf(mx0, fmaxf(s[j][0], s[j][1]));
      mx1 = fmaxf(mx1, fmaxf(s[j][2], s[j][3]));
    }
#pragma unroll
    for (int off = 1; off < 4; off <<= 1) {
      mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, off));
      mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, off));
    }
    const float n0 = fmaxf(m0, mx0), n1 = fmaxf(m1, mx1);
    const float c0 = rescale(m0, n0), c1 = rescale(m1, n1);
    m0 = n0;
    m1 = n1;
    float p[2][4];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float mm = e < 2 ? n0 : n1;
        p[j][e] = s[j][e] == CUPA_NEG_INF ? 0.0f : __expf(s[j][e] - mm);
      }
    }
    l0 = l0 * c0 + (p[0][0] + p[0][1] + p[1][0] + p[1][1]);
    l1 = l1 * c1 + (p[0][2] + p[0][3] + p[1][2] + p[1][3]);
    if (__any_sync(0xffffffffu, c0 != 1.0f || c1 != 1.0f)) {  // the running max rarely moves in decode
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        o[n][0] *= c0;
        o[n][1] *= c0;
        o[n][2] *= c1;
        o[n][3] *= c1;
      }
    }
    unsigned a[4] = {Mma<T>::pack(p[0][0], p[0][1]), Mma<T>::pack(p[0][2], p[0][3]),
                     Mma<T>::pack(p[1][0], p[1][1]), Mma<T>::pack(p[1][2], p[1][3])};
#pragma unroll
    for (int nn = 0; nn < D / 16; ++nn) {
      unsigned b[4];
      const int mi = lane >> 3;
      ldmatrix_x4_trans(b, sV + swz<D>(warp * 16 + (mi & 1) * 8 + (lane & 7), nn * 16 + (mi >> 1) * 8));
      Mma<T>::run(o[2 * nn], a, b[0], b[1]);
      Mma<T>::run(o[2 * nn + 1], a, b[2], b[3]);
    }
  }
  cp_async_wait<0>();
  __syncthreads();

  // Merge the warps in order through shared memory (the stage buffers are free now).
  l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
  l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
  float* cm = reinterpret_cast<float*>(stages);                 // [warp][row]
  float* cl = cm + MMA_WARPS * MMA_ROWS;                         // [warp][row]
  float* co = cl + MMA_WARPS * MMA_ROWS;                         // [warp][row][D]
  const int r0 = lane >> 2;
  if ((lane & 3) == 0) {
    cm[warp * MMA_ROWS + r0] = m0;
    cm[warp * MMA_ROWS + r0 + 8] = m1;
    cl[warp * MMA_ROWS + r0] = l0;
    cl[warp * MMA_ROWS + r0 + 8] = l1;
  }
#pragma unroll
  for (int n = 0; n < D / 8; ++n) {
    const int d = n * 8 + (lane & 3) * 2;
    float* row0 = co + (warp * MMA_ROWS + r0) * D;
    float* row1 = co + (warp * MMA_ROWS + r0 + 8) * D;
    row0[d] = o[n][0];
    row0[d + 1] = o[n][1];
    row1[d] = o[n][2];
    row1[d + 1] = o[n][3];
  }
  __syncthreads();

  store_rows<T>(cm, cl, co, MMA_WARPS, MMA_ROWS, D, nh, D, t, h0, H, g, split, num_splits, head_sink, v_scale,
                v_quant, out, part_o, part_ml);
}
