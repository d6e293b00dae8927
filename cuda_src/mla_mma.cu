// Absorbed MLA (kv_cache_layout LATENT, head_size 576, v_head_size 512, one latent head) on tensor cores
// with mma.sync m16n8k16: the portable path, compute capability 8.0+ (fp16/bf16 T; T or fp8 caches).
// On compute capability 9.0 the 16-bit caches take mla_wgmma.cu wherever a tile has 64 rows.
//
// One CTA owns (row tile x, split s): ROWS consecutive (token, head) rows of one sequence (mla.cuh), and
// the keys of s that any of its rows admits. All ROWS rows share every latent tile, so a token's heads
// read each latent row from memory once per ceil(H / ROWS) tiles. Keys stream through shared memory in
// tiles of KEYS (cp.async, 2 stages, rows gathered through the block table one by one, so any
// block_size works; masked keys are zero-filled, never read; fp8 codes are widened to T in shared
// memory; the next tile's copies are issued by the warps S leaves free, during S). Per key tile:
//   S = Q K^T   warps split the ROWS x KEYS tile (16 keys x S_MT*16 rows each; Q and K from shared
//               memory by ldmatrix, 36 k-steps over the 576 channels), mask per row (causal, window,
//               kv_len, mapped blocks), and publish per-row partial maxima;
//   softmax     every warp takes the new row maxima (the same arithmetic in every warp) and rescales
//               its accumulators; the S warps write P (T) to shared memory;
//   O += P V    warp w owns output channels [w*CH, (w+1)*CH) of every row (V = the tile's first 512
//               channels, by ldmatrix.trans), so the ROWS x 512 fp32 accumulator is spread over the CTA.
// The K scale is folded into Q (PER_CHANNEL) or the score scale (PER_TENSOR), the V scale (the same
// k_scale) into the epilogue. Reads: Q (N, H, 576) of T, the latent cache, cum, past_seqlens, block_table,
// query_positions, k_scale. Writes: the tile's output rows (N, H*512), lse (N, H) when asked, or fp32
// partial states and the tile's record that paged_mla_merge (mla_merge.cu) merges; the first zero_ctas
// CTAs zero the rows of tokens no sequence owns.
//
// Configurations (ROWS, KEYS; mirrored in cupa/kernels/mla.py, sized so each fits the devices that run
// it): (64, 64) 232 KB, sm_90; (64, 32) 158 KB, sm_80+ with 163 KB; (16, 64) 169 KB, sm_90 (decode
// steps of at most 16 heads); (16, 32) 95 KB, every device (sm_86/89/120: 99 KB). 8 warps (ROWS*512/256
// <= 128 fp32 accumulators a thread; with 16 rows, half the warps make S while the others issue the
// next tile's copies, and all of them the P V and the rescale: two warps a scheduler).
// Floors (per key and row: 2*(576+512) FLOPs; per key: 1152 bytes of T, 576 of fp8): a decode step is
// memory-bound below ~128 heads on an H200 (4.8 TB/s, ~990 TFLOP/s dense). With 16 rows a 64-key tile is
// 2.2 MFLOP against 72 KB (fp16; an SM's share of the bandwidth brings it in ~2 us, its tensor cores need
// well under 1 us); shared-memory traffic (~220 KB a tile: K by every row group, Q by every key group,
// V once) is the next limit, for fp8 tiles (widening adds 108 KB) about at the bandwidth floor.
// Host values that size the launch: token_count, batch_size, num_heads (tiles), tile_splits and num_splits
// (static sizes, SM count); attention_metadata only drops trailing splits; none enters a mask.
#include "common.cuh"
#include "mla.cuh"
#include "mma.cuh"
#include "paged.cuh"
#include "prefill_tiles.cuh"
#include "quant.cuh"
#include "softmax.cuh"

constexpr int MLA_MMA_STAGES = 2;

template <int ROWS, int KEYS> struct MlaMmaConfig {
  static constexpr int WARPS = 8;
  static constexpr int THREADS = WARPS * 32;
  static constexpr int MT = ROWS / 16;                // m16 tiles of rows
  static constexpr int S_KEY_WARPS = KEYS / 16;       // S: 16 keys per warp ...
  static constexpr int S_ROW_WARPS = WARPS / S_KEY_WARPS < MT ? WARPS / S_KEY_WARPS : MT;
  static constexpr int S_WARPS = S_KEY_WARPS * S_ROW_WARPS;
  static constexpr int S_MT = MT / S_ROW_WARPS;       // ... and S_MT m16 tiles of rows
  static constexpr int CH = MLA_DV / WARPS;           // O += P V: output channels per warp
  static constexpr int NT = CH / 8;                   // their n8 tiles
  static_assert(ROWS == 16 || ROWS == 64, "16 or 64 rows");
  static_assert(KEYS == 32 || KEYS == 64, "32 or 64 keys");
  static_assert(S_WARPS <= WARPS && S_MT * S_ROW_WARPS == MT, "S tile cover");
};

// Shared memory (dynamic; byte offsets, mirrored by mma_shared_bytes in cupa/kernels/mla.py).
template <typename Cache, int ROWS, int KEYS> struct MlaMmaSmem {
  using C = typename Cache::storage;
  static constexpr int q_at = 0;                                             // Q tile [ROWS][576] T, swizzled
  static constexpr int stage_bytes = KEYS * MLA_D * (int)sizeof(C);          // a key tile as stored
  static constexpr int stage_at = q_at + ROWS * MLA_D * 2;
  static constexpr int wide_at = stage_at + MLA_MMA_STAGES * stage_bytes;     // fp8 tile widened to T
  static constexpr int p_at = wide_at + (Cache::quantized ? KEYS * MLA_D * 2 : 0);  // P [ROWS][64] T
  static constexpr int rows_at = p_at + ROWS * 64 * 2;                       // key rows, one tile ahead
  static constexpr int max_at = rows_at + (MLA_MMA_STAGES + 1) * KEYS * 4;   // [S_KEY_WARPS][ROWS] partial max
  static constexpr int lo_at = max_at + (KEYS / 16) * ROWS * 4;              // sLo, sHi, sTok, sHead [ROWS]
  static constexpr int tile_at = lo_at + 4 * ROWS * 4;
  static constexpr int total = tile_at + 64;
  static_assert(sizeof(MlaTile) <= 64, "tile record");
};

template <typename T, typename Cache, int ROWS, int KEYS>
__global__ void __launch_bounds__(MlaMmaConfig<ROWS, KEYS>::THREADS, 1) paged_mla_mma(
    const T* __restrict__ q,  // (N, H, 576): prologue output, or `query` itself
    const typename Cache::storage* __restrict__ key_cache, const int* __restrict__ cum, const int* __restrict__ past,
    const int* __restrict__ block_table, const int* __restrict__ query_positions, const float* __restrict__ k_scale,
    T* __restrict__ out, float* __restrict__ lse, float* __restrict__ part_o, float2* __restrict__ part_ml,
    MlaTileRecord* __restrict__ records, int token_count, int num_heads, int batch_size, int num_blocks,
    int block_size, int max_blocks, int zero_ctas, int num_tiles, int tile_splits, int num_splits,
    int rotary_max_pos, float scale, float softcap, int window, int is_causal, int k_quant) {
  using Cfg = MlaMmaConfig<ROWS, KEYS>;
  using L = MlaMmaSmem<Cache, ROWS, KEYS>;
  using C = typename Cache::storage;
  constexpr int D = MLA_D, NST = MLA_MMA_STAGES, THREADS = Cfg::THREADS;
  constexpr int MT = Cfg::MT, NT = Cfg::NT, CH = Cfg::CH, SKW = Cfg::S_KEY_WARPS, SMT = Cfg::S_MT;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;

  if (mla_zero_ctas<T>(zero_ctas, out, lse, cum, batch_size, token_count, num_heads)) return;
  extern __shared__ __align__(16) unsigned char smem[];
  T* sQ = reinterpret_cast<T*>(smem + L::q_at);
  unsigned char* stages = smem + L::stage_at;
  T* sP = reinterpret_cast<T*>(smem + L::p_at);
  unsigned* sRows = reinterpret_cast<unsigned*>(smem + L::rows_at);
  float* sMax = reinterpret_cast<float*>(smem + L::max_at);
  int* sLo = reinterpret_cast<int*>(smem + L::lo_at);
  int* sHi = sLo + ROWS;
  MlaTile* tile = reinterpret_cast<MlaTile*>(smem + L::tile_at);

  const long long x = (long long)num_tiles - 1 - ((int)blockIdx.x - zero_ctas);  // heaviest tiles first
  const int split = blockIdx.y;
  const long long kv_capacity = (long long)max_blocks * block_size;
  MlaTile tl;
  MlaSplits sp;
  if (!mla_begin_tile<ROWS>(x, split, tile_splits, num_splits, cum, past, batch_size, token_count, num_heads,
                            query_positions, kv_capacity, rotary_max_pos, is_causal, window, sHi + ROWS,
                            sHi + 2 * ROWS, sLo, sHi, tile, tl, sp))
    return;
  const bool direct = sp.count == 1;
  const MlaKeys keys = mla_keys(tl, sp, split, KEYS, 1);
  const int ntiles = keys.ntiles;
  const FastDiv block_div(block_size);

  // Row of each key of tile `kt` (threads 0..KEYS-1), into slot kt % (NST + 1).
  auto find_rows = [&](int kt) {
    if (tid < KEYS)
      sRows[(kt % (NST + 1)) * KEYS + tid] = mla_key_row(keys.korg + kt * KEYS + tid, keys, block_table, max_blocks,
                                                         num_blocks, block_size, block_div, tl.b);
  };
  // cp.async copies of tile kt into stage kt % NST: T rows swizzled for ldmatrix, fp8 codes as they are.
  // A warp copies KPW consecutive whole rows (their slots read at once, then every copy issued), lane l
  // their 16-byte chunks l, l + 32, ... Where S leaves warps free (16-row tiles), only those copy: the
  // copies of the next tile then run beside this tile's S instead of before it.
  auto issue = [&](int kt) {
    constexpr int CPR = D * (int)sizeof(C) / 16;  // 16-byte chunks per row
    constexpr int FREE = Cfg::WARPS - Cfg::S_WARPS;
    constexpr int COPY_WARPS = FREE >= 4 ? 4 : Cfg::WARPS;
    constexpr int KPW = KEYS / COPY_WARPS;
    static_assert(KEYS % COPY_WARPS == 0, "whole rows per copy warp");
    const int cw = warp - (Cfg::WARPS - COPY_WARPS);
    if (cw < 0) return;
    const unsigned* rows = sRows + (kt % (NST + 1)) * KEYS + cw * KPW;
    const unsigned dst = smem_addr(stages + (kt % NST) * L::stage_bytes);
    unsigned row[KPW];
#pragma unroll
    for (int i = 0; i < KPW; ++i) row[i] = rows[i];
#pragma unroll
    for (int i = 0; i < KPW; ++i) {
      const int key = cw * KPW + i;
      const unsigned char* src = reinterpret_cast<const unsigned char*>(key_cache) +
                                 (unsigned long long)(row[i] == MLA_NO_ROW ? 0u : row[i]) * (D * sizeof(C)) + lane * 16;
#pragma unroll
      for (int j = 0; j < (CPR + 31) / 32; ++j) {
        const int c = lane + 32 * j;
        if (c < CPR) {
          const unsigned off = Cache::quantized ? (unsigned)(key * D + c * 16) : (unsigned)(swz<D>(key, c * 8) * 2);
          cp_async_16_or_zero(dst + off, src + 512 * j, row[i] != MLA_NO_ROW);
        }
      }
    }
  };
  find_rows(0);
  grid_dependency_wait();  // Q, cache rows and the zeroed tile records come from the prologue
  mla_record_tile(records, x, tl, sp, split);
  __syncthreads();
  if (ntiles > 0) issue(0);
  cp_async_commit();
  if (ntiles > 1) find_rows(1);

  // Q rows of owned tokens (the K scale folded in per channel), zeros elsewhere.
  for (int c = tid; c < ROWS * (D / 8); c += THREADS) {
    const int r = c / (D / 8), col = (c % (D / 8)) * 8;
    float v[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = 0.0f;
    if (r >= tl.owned_lo && r < tl.owned_hi && ntiles > 0) {
      load8(q + (tl.r0 + r) * D + col, v);
      if (k_quant == QUANT_PER_CHANNEL) {
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] *= k_scale[col + i];
      }
    }
    store8(sQ + swz<D>(r, col), v);
  }

  const float score_scale = scale * (k_quant == QUANT_PER_TENSOR ? k_scale[0] : 1.0f);
  const float score_scale2 = score_scale * CUPA_LOG2E;
  const bool s_warp = warp < Cfg::S_WARPS;
  const int kw = warp % SKW, rw = warp / SKW;  // S: keys 16 kw.., row tiles rw * S_MT..
  // This lane's rows: PV layout, m-tile mt: mt * 16 + lane / 4 (+ 8); the S rows are a subset (mt = rw * S_MT + smt).
  int slo[SMT][2], shi[SMT][2];
#pragma unroll
  for (int smt = 0; smt < SMT; ++smt)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int row = (rw * SMT + smt) * 16 + (lane >> 2) + 8 * i;
      slo[smt][i] = s_warp ? sLo[row] : 0;
      shi[smt][i] = s_warp ? sHi[row] : 0;
    }
  float o[MT][NT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int n = 0; n < NT; ++n) o[mt][n][0] = o[mt][n][1] = o[mt][n][2] = o[mt][n][3] = 0.0f;
  float m_run[MT][2];  // running row maxima (log2 units), the same in every warp
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) m_run[mt][0] = m_run[mt][1] = CUPA_NEG_INF;
  float l_s[SMT][2] = {};  // S warps: this lane's share of the row sums over its key group

  for (int kt = 0; kt < ntiles; ++kt) {
    cp_async_wait<0>();
    __syncthreads();  // tile kt landed; every warp is done with tile kt - 1 (stage, wide tile, P)
    if (kt + 1 < ntiles) issue(kt + 1);
    cp_async_commit();
    if (kt + 2 < ntiles) find_rows(kt + 2);  // read after the next barrier
    const T* sK;
    if constexpr (Cache::quantized) {
      T* wide = reinterpret_cast<T*>(smem + L::wide_at);
      const unsigned char* codes = stages + (kt % NST) * L::stage_bytes;
      for (int e = tid; e < KEYS * (D / 16); e += THREADS) {
        const int key = e / (D / 16), c = (e % (D / 16)) * 16;
        widen16<T, Cache>(reinterpret_cast<const C*>(codes) + key * D + c, wide + swz<D>(key, c),
                          wide + swz<D>(key, c + 8));
      }
      __syncthreads();
      sK = wide;
    } else {
      sK = reinterpret_cast<const T*>(stages + (kt % NST) * L::stage_bytes);
    }
    const unsigned* rows = sRows + (kt % (NST + 1)) * KEYS;
    const int k0 = keys.korg + kt * KEYS;

    // S = Q K^T on this warp's block, masked; per-row partial maxima to shared memory.
    float s[SMT][2][4];
    if (s_warp) {
      // With one m16 tile a warp (16 rows) the 36 k-steps feed NACC independent accumulator chains (summed
      // after the loop), so the MMAs' latency is not paid 36 times in a row.
      constexpr int NACC = SMT == 1 ? 4 : 1;
      float sa[SMT][NACC][2][4];
#pragma unroll
      for (int smt = 0; smt < SMT; ++smt)
#pragma unroll
        for (int c = 0; c < NACC; ++c)
#pragma unroll
          for (int j = 0; j < 2; ++j) sa[smt][c][j][0] = sa[smt][c][j][1] = sa[smt][c][j][2] = sa[smt][c][j][3] = 0.0f;
      // The ldmatrix addresses of swz<D>: chunk c (16 bytes) of row r at r * 2D + ((c ^ (r % 8)) * 16) bytes.
      // Four k-steps span 8 chunks, inside which the XOR stays, so each lane's 4 offsets within such a
      // group are computed once and group g adds 128 g bytes. Every row this lane addresses is lane % 8
      // modulo 8; its K rows take chunks 2 kk + (lane / 8) % 2, its Q rows 2 kk + lane / 16.
      const int mi = lane >> 3, x = lane & 7;
      const unsigned k_at = smem_addr(sK + (kw * 16 + (mi >> 1) * 8 + x) * D);
      unsigned q_at[SMT];
#pragma unroll
      for (int smt = 0; smt < SMT; ++smt) q_at[smt] = smem_addr(sQ + ((rw * SMT + smt) * 16 + (lane & 15)) * D);
#pragma unroll 3
      for (int g = 0; g < D / 64; ++g) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          unsigned b[4];
          ldmatrix_x4_at(b, k_at + g * 128 + ((2 * i + (mi & 1)) ^ x) * 16);
#pragma unroll
          for (int smt = 0; smt < SMT; ++smt) {
            unsigned a[4];
            ldmatrix_x4_at(a, q_at[smt] + g * 128 + ((2 * i + (lane >> 4)) ^ x) * 16);
            Mma<T>::run(sa[smt][i % NACC][0], a, b[0], b[1]);
            Mma<T>::run(sa[smt][i % NACC][1], a, b[2], b[3]);
          }
        }
      }
#pragma unroll
      for (int smt = 0; smt < SMT; ++smt)
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            s[smt][j][e] = NACC == 1 ? sa[smt][0][j][e]
                                     : (sa[smt][0][j][e] + sa[smt][1 % NACC][j][e]) +
                                           (sa[smt][2 % NACC][j][e] + sa[smt][3 % NACC][j][e]);
#pragma unroll
      for (int smt = 0; smt < SMT; ++smt) {
        float mx[2] = {CUPA_NEG_INF, CUPA_NEG_INF};
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int i = e >> 1, key = kw * 16 + j * 8 + 2 * (lane & 3) + (e & 1), k = k0 + key;
            float v = softcap > 0.0f ? softcap_score(s[smt][j][e] * score_scale, softcap) * CUPA_LOG2E
                                     : s[smt][j][e] * score_scale2;
            if (rows[key] == MLA_NO_ROW || k < slo[smt][i] || k >= shi[smt][i]) v = CUPA_NEG_INF;
            s[smt][j][e] = v;
            mx[i] = fmaxf(mx[i], v);
          }
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
          mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
          if ((lane & 3) == 0) sMax[kw * ROWS + (rw * SMT + smt) * 16 + (lane >> 2) + 8 * i] = mx[i];
        }
      }
    }
    __syncthreads();  // partial maxima published

    // New row maxima (every warp, the same arithmetic), accumulators rescaled where a maximum moved.
    float cf[MT][2];
    bool moved = false;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int row = mt * 16 + (lane >> 2) + 8 * i;
        float tmax = CUPA_NEG_INF;
#pragma unroll
        for (int w = 0; w < SKW; ++w) tmax = fmaxf(tmax, sMax[w * ROWS + row]);
        const float nm = fmaxf(m_run[mt][i], tmax);
        cf[mt][i] = m_run[mt][i] == nm ? 1.0f : ex2_approx(m_run[mt][i] - nm);
        m_run[mt][i] = nm;
        moved |= cf[mt][i] != 1.0f;
      }
    if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int n = 0; n < NT; ++n) {
          o[mt][n][0] *= cf[mt][0];
          o[mt][n][1] *= cf[mt][0];
          o[mt][n][2] *= cf[mt][1];
          o[mt][n][3] *= cf[mt][1];
        }
    }
    // P = exp2(S - max) (T) to shared memory; row sums of this warp's keys.
    if (s_warp) {
#pragma unroll
      for (int smt = 0; smt < SMT; ++smt) {
        const int mt = rw * SMT + smt;
        // m_run / cf of m-tile mt (a run-time index: selected, so they stay in registers)
        float mr[2] = {CUPA_NEG_INF, CUPA_NEG_INF}, cr[2] = {1.0f, 1.0f};
#pragma unroll
        for (int m = 0; m < MT; ++m)
          if (m == mt) {
            mr[0] = m_run[m][0];
            mr[1] = m_run[m][1];
            cr[0] = cf[m][0];
            cr[1] = cf[m][1];
          }
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const float base = mr[i] == CUPA_NEG_INF ? 0.0f : mr[i];
          const int row = mt * 16 + (lane >> 2) + 8 * i;
          float sum = 0.0f;
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            const float p0 = ex2_approx(s[smt][j][2 * i] - base), p1 = ex2_approx(s[smt][j][2 * i + 1] - base);
            sum += p0 + p1;
            *reinterpret_cast<unsigned*>(sP + swz<64>(row, kw * 16 + j * 8 + 2 * (lane & 3))) = Mma<T>::pack(p0, p1);
          }
          l_s[smt][i] = l_s[smt][i] * cr[i] + sum;
        }
      }
    }
    __syncthreads();  // P complete

    // O += P V: this warp's CH channels of every row.
#pragma unroll
    for (int kk = 0; kk < KEYS / 16; ++kk) {
      unsigned a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
        ldmatrix_x4(a[mt], sP + swz<64>(mt * 16 + (lane & 15), kk * 16 + (lane >> 4) * 8));
      const int mi = lane >> 3;
#pragma unroll
      for (int nn = 0; nn < CH / 16; ++nn) {
        unsigned b[4];
        ldmatrix_x4_trans(b, sK + swz<D>(kk * 16 + (mi & 1) * 8 + (lane & 7), warp * CH + nn * 16 + (mi >> 1) * 8));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          Mma<T>::run(o[mt][2 * nn], a[mt], b[0], b[1]);
          Mma<T>::run(o[mt][2 * nn + 1], a[mt], b[2], b[3]);
        }
      }
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // every warp is past its last read of sMax

  // Row sums: the S warps' shares, over the quad, then over the key groups in order.
  if (s_warp) {
#pragma unroll
    for (int smt = 0; smt < SMT; ++smt)
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        float l = l_s[smt][i];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        if ((lane & 3) == 0) sMax[kw * ROWS + (rw * SMT + smt) * 16 + (lane >> 2) + 8 * i] = l;
      }
  }
  __syncthreads();
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    float M[2], Lsum[2];
    bool write[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int row = mt * 16 + (lane >> 2) + 8 * i;
      float l = 0.0f;
#pragma unroll
      for (int w = 0; w < SKW; ++w) l += sMax[w * ROWS + row];
      const bool live = sHi[row] > sLo[row];
      Lsum[i] = live ? l : 0.0f;
      M[i] = live && m_run[mt][i] != CUPA_NEG_INF ? m_run[mt][i] * CUPA_LN2 : CUPA_NEG_INF;
      write[i] = row >= tl.owned_lo && row < tl.owned_hi;
      if (warp == 0 && (lane & 3) == 0 && write[i])
        mla_store_state(M[i], Lsum[i], tl.r0 + row, split, num_splits, direct, lse, part_ml);
    }
    mla_store_o<T, NT, Cache::quantized>([&](int j, int e) { return o[mt][j][e]; }, lane, mt * 16 + (lane >> 2),
                                         warp * CH, M, Lsum, write, tl.r0, split, num_splits, direct, k_scale, k_quant,
                                         out, part_o);
  }
}
