// The general backend on tensor cores (fp16/bf16 T; T, int8 or fp8 caches; head_size 64/128/256, SEPARATE
// layout): what the fused kernels leave out -- attention_bias, output_qk, lse -- with their masks, sinks,
// softcap and splits.
// One CTA owns a tile of 64 query rows of ONE sequence b and ONE KV head g -- the (new token, query
// head of g's group) pairs in token-major order, numbered on one axis over the batch as in the prefill
// kernels (prefill_tiles.cuh) -- and ONE KV split s (key positions [s*chunk, (s+1)*chunk)). Each of the
// 4 warps owns 16 rows (one mma.sync m16n8k16 tile) and keeps their online-softmax state in registers;
// keys stream through shared memory in tiles of KEYS (cp.async, STAGES stages, rows gathered through the
// block table, masked rows zero-filled) over the union of the rows' admitted ranges.
// Per element of a tile: score = scale * q.k (+ bias[b|0, h|0, j, k], read from global memory into registers
// a tile ahead, only for admitted keys), then softcap; the score goes to output_qk when asked (general.cuh),
// then into the exponent.
// The end: one split (num_splits == 1) finalizes the rows (sink, V scale) into `out` and their lse;
// several write partial states (general.cuh) that general_finish.cu merges. With one split the first
// zero_ctas CTAs zero the output rows (and lse) of tokens no sequence owns.
//
// Floors (H200, fp16 GQA 32/8 D=128): the tile's MMAs are 2*64*KEYS*D*2 FLOP for 2*KEYS*D*2 bytes of K/V
// in shared memory, read by ldmatrix once per warp: 36 KB of shared-memory reads per warp and tile, so the
// loop is bound by shared-memory bandwidth (128 B/clock/SM) at about 2 MFLOP per 1150 clocks per CTA, i.e.
// ~420 TFLOP/s over 132 SMs at 1.8 GHz; the bias adds 64*KEYS*2 bytes per tile from L2/HBM (0.54 GB for
// a causal B=4 x 2048 call with a full (B, H, 2048, 2048) bias, 0.13 ms at 4 TB/s). Decode (one token a
// sequence) puts the group's G query heads in warp 0's rows and is bound by the K/V bytes; splits give the
// grid its CTAs (cupa/kernels/general.py).
// Launch: grid (zero_ctas + num_tiles * Hk, num_splits); one CTA per (row tile, KV head, split), heaviest
// tiles first. Host values that size it: token_count, batch_size, head counts, num_splits (from the static
// capacity or the attention_metadata bound) and chunk (static); none enters a mask.
#include "common.cuh"
#include "general.cuh"
#include "mma.cuh"
#include "paged.cuh"
#include "quant.cuh"
#include "softmax.cuh"
#include "prefill_tiles.cuh"

constexpr int GMMA_WARPS = 4;
constexpr int GMMA_ROWS = 16 * GMMA_WARPS;

// Keys per shared-memory tile and cp.async stages per head size (mirrored in cupa/kernels/general.py):
// within the 99 KB an sm_86/89/120 CTA may use, 2 CTAs per SM on sm_80/90.
template <int D> struct GeneralMmaConfig;
template <> struct GeneralMmaConfig<64> { static constexpr int KEYS = 64, STAGES = 3; };
template <> struct GeneralMmaConfig<128> { static constexpr int KEYS = 64, STAGES = 2; };
template <> struct GeneralMmaConfig<256> { static constexpr int KEYS = 32, STAGES = 2; };

template <typename T, typename Cache, int D, bool QSPLIT = false>
struct GeneralMmaSmem {
  using C = typename Cache::storage;
  static constexpr int KEYS = GeneralMmaConfig<D>::KEYS;
  static constexpr int NST = GeneralMmaConfig<D>::STAGES;
  static constexpr int q_bytes = GMMA_ROWS * D * 2;                              // Q tile, then the output tile
  static constexpr int q_lo_bytes = QSPLIT ? q_bytes : 0;                         // (QSPLIT) the rest of Q x K scale
  static constexpr int stage_bytes = 2 * KEYS * D * (int)sizeof(C);               // K and V tiles as stored
  static constexpr int wide_bytes = Cache::quantized ? 2 * KEYS * D * 2 : 0;      // widened K and V
  static constexpr int rows_bytes = (NST + 1) * KEYS * 8;                         // row byte offsets, a tile ahead
  static constexpr int bytes_bytes = (NST + 1) * KEYS * 4;                        // copy sizes (16 or 0: masked)
  static constexpr int mapped_bytes = (NST + 1) * (KEYS / 32) * 4;                // mapped-key bit masks
  static constexpr int align_pad = 128;  // the dynamic region is rounded up to a 128-byte boundary
  static constexpr int total = q_bytes + q_lo_bytes + NST * stage_bytes + wide_bytes + rows_bytes + bytes_bytes + mapped_bytes +
                               align_pad;
};

// The zero pass of one split: the output rows and lse of the tokens no sequence owns (prefill_tiles.cuh).
template <typename T, int WARPS>
CUPA_DEVICE void general_zero_pass(T* out, float* lse, const int* cum, int batch_size, int token_count, int num_heads,
                                   int head_size) {
  if (lse) {
    const long long t = (long long)blockIdx.x * WARPS * 32 + threadIdx.x;
    if (t < token_count && !token_owned(cum, batch_size, (int)t))
      for (int h = 0; h < num_heads; ++h) lse[t * num_heads + h] = CUPA_NEG_INF;
  }
  prefill_zero_pass<T, WARPS>(out, cum, batch_size, token_count, num_heads, head_size);
}

// QSPLIT (quantized caches with per-channel K scales, where the shared memory allows its second Q tile):
// Q x scale as two T values (see the Q rows).
template <typename T, typename Cache, int D, bool QSPLIT = false>
__global__ void __launch_bounds__(GMMA_WARPS * 32, 2) paged_general_mma(
    const T* __restrict__ q,  // (N, H, D): prologue output, or `query` itself
    const typename Cache::storage* __restrict__ key_cache, const typename Cache::storage* __restrict__ value_cache,
    const int* __restrict__ cum, const int* __restrict__ past, const int* __restrict__ block_table,
    const int* __restrict__ query_positions, const T* __restrict__ head_sink, const float* __restrict__ k_scale,
    const float* __restrict__ v_scale, const T* __restrict__ bias, T* __restrict__ out,
    float* __restrict__ output_qk, float* __restrict__ lse, float* __restrict__ part_o, float2* __restrict__ part_ml,
    int token_count, int num_heads, int kv_num_heads, int batch_size, int num_blocks, int block_size, int max_blocks,
    int zero_ctas, int num_tiles, int chunk, int num_splits, int rotary_max_pos, float scale, float softcap,
    int window, int is_causal, int k_quant, int v_quant, int bias_batch, int bias_heads, int bias_q, int bias_k,
    int qk_mode, int kv_capacity) {
  static_assert(!QSPLIT || Cache::quantized, "QSPLIT: a quantized cache");
  using L = GeneralMmaSmem<T, Cache, D, QSPLIT>;
  using C = typename Cache::storage;
  constexpr int WARPS = GMMA_WARPS, THREADS = WARPS * 32, ROWS = GMMA_ROWS, KEYS = L::KEYS, NST = L::NST;
  constexpr int MASK_WORDS = KEYS / 32, NT = KEYS / 8;
  static_assert(D % 64 == 0 && D <= 256, "head_size 64, 128 or 256");
  static_assert(KEYS % 32 == 0 && KEYS <= THREADS && ROWS <= THREADS, "one thread per key row and per query row");

  const int split = blockIdx.y;
  const bool direct = num_splits == 1;
  if ((int)blockIdx.x < zero_ctas) {
    if (split == 0) general_zero_pass<T, WARPS>(out, lse, cum, batch_size, token_count, num_heads, D);
    return;
  }

  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((128u - (smem_addr(smem_raw) & 127u)) & 127u);
  __shared__ int sTok[ROWS];   // packed token of each row, -1: not this CTA's row
  __shared__ int sHead[ROWS];  // query head of each row (g*G + row % G)
  __shared__ int sLo[ROWS], sHi[ROWS];  // admitted key range of each row within this split (empty: 0, 0)
  constexpr int LOCATORS = ROWS / 32;   // the warps that locate the rows (thread r: row r)
  __shared__ int sRangeLo[LOCATORS], sRangeHi[LOCATORS];  // per locating warp: the union of its rows' ranges
  T* sQ = reinterpret_cast<T*>(smem);
  T* sQlo = reinterpret_cast<T*>(smem + L::q_bytes);  // (QSPLIT) see the Q rows below
  unsigned char* stages = smem + L::q_bytes + L::q_lo_bytes;
  T* sKw = reinterpret_cast<T*>(stages + NST * L::stage_bytes);  // widened tiles (quantized only)
  T* sVw = sKw + KEYS * D;
  long long* sRows = reinterpret_cast<long long*>(stages + NST * L::stage_bytes + L::wide_bytes);
  int* sBytes = reinterpret_cast<int*>(sRows + (NST + 1) * KEYS);
  unsigned* sMapped = reinterpret_cast<unsigned*>(sBytes + (NST + 1) * KEYS);
  const unsigned sQ_a = smem_addr(sQ), stages_a = smem_addr(stages), sKw_a = smem_addr(sKw);

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int H = num_heads, Hk = kv_num_heads, G = H / Hk, B = batch_size;
  const int cta = (int)blockIdx.x - zero_ctas;
  const int g = cta % Hk;
  const long long x = (long long)num_tiles - 1 - cta / Hk;  // heaviest tiles first

  RowTile rt;
  const bool has_rows = locate_row_tile<ROWS>(cum, B, token_count, x, G, lane, rt);
  grid_dependency_wait();  // the prologue's Q and cache rows are visible from here
  if (!has_rows) return;
  const int b = rt.b;

  // Each row's token, head and admitted range (thread r: row r), then the bias capacities and the split.
  const BiasView<T> bv{bias, bias_batch, bias_heads, bias_q, bias_k};
  const long long split_lo = (long long)split * chunk, split_hi = split_lo + chunk;
  if (tid < ROWS) {
    int lo, hi;
    locate_tile_row(rt, tid, g, G, cum, past, B, query_positions, (long long)max_blocks * block_size,
                    rotary_max_pos, is_causal, window, sTok, sHead, sLo, sHi, lo, hi);
    if (sTok[tid] >= 0) bv.clamp(sTok[tid] - rt.seq_cum, lo, hi);
    lo = (int)max((long long)lo, split_lo);
    hi = (int)min((long long)hi, split_hi);
    if (hi <= lo) lo = hi = 0;
    sLo[tid] = lo;
    sHi[tid] = hi;
    const bool live = hi > lo;
    const int rlo = __reduce_min_sync(0xffffffffu, live ? lo : RANGE_NONE_LO);
    const int rhi = __reduce_max_sync(0xffffffffu, live ? hi : RANGE_NONE_HI);
    if (lane == 0) {
      sRangeLo[warp] = rlo;
      sRangeHi[warp] = rhi;
    }
  }
  __syncthreads();
  int klo = RANGE_NONE_LO, khi = RANGE_NONE_HI;  // the union of the rows' ranges (the locating warps' entries)
#pragma unroll
  for (int w = 0; w < LOCATORS; ++w) {
    klo = min(klo, sRangeLo[w]);
    khi = max(khi, sRangeHi[w]);
  }
  // Tiles start at a multiple of 8 keys (aligned bias pairs and output_qk pairs); keys below klo are masked.
  const int kbase = khi > klo ? klo & ~7 : 0;
  const int ntiles = khi > klo ? (khi - kbase + KEYS - 1) / KEYS : 0;
  if (!direct && ntiles == 0) return;  // no row of this CTA has a key in this split: no partial state to write

  // Q rows; rows without admitted keys are zero (as in prefill.cu: cp.async with the first K/V tile, or
  // through registers with a per-channel K scale folded in). q x scale is not a T value: QSPLIT keeps it as
  // two, sQ (rounded to T) and sQlo (the rest, rounded to T), and the scores take both products, so they
  // carry 2^-16 (bf16) or 2^-22 (fp16) of relative rounding instead of T's own 2^-8 or 2^-11 per product.
  const bool q_split = QSPLIT && k_quant == QUANT_PER_CHANNEL;
  if (ntiles > 0) {
    if (k_quant == QUANT_PER_CHANNEL) {
      for (int c = tid; c < ROWS * (D / 8); c += THREADS) {
        const int r = c / (D / 8), col = (c % (D / 8)) * 8;
        float v[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = 0.0f;
        if (sHi[r] > sLo[r]) {
          load8(q + ((long long)sTok[r] * H + sHead[r]) * D + col, v);
#pragma unroll
          for (int i = 0; i < 8; ++i) v[i] *= k_scale[g * D + col + i];
        }
        if constexpr (QSPLIT) {
          float hi[8];
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            hi[i] = round_to<T>(v[i]);
            v[i] -= hi[i];  // exact in float32
          }
          store8(sQ + swz<D>(r, col), hi);
          store8(sQlo + swz<D>(r, col), v);
        } else {
          store8(sQ + swz<D>(r, col), v);
        }
      }
    } else {
      for (int c = tid; c < ROWS * (D / 8); c += THREADS) {
        const int r = c / (D / 8), col = (c % (D / 8)) * 8;
        const bool live = sHi[r] > sLo[r];
        const T* src = live ? q + ((long long)sTok[r] * H + sHead[r]) * D + col : q;
        cp_async_16_or_zero(sQ_a + 2u * (unsigned)swz<D>(r, col), src, live);
      }
    }
  }

  const long long row_stride_bytes = (long long)Hk * D * (long long)sizeof(C);
  const long long head_bytes = (long long)g * D * (long long)sizeof(C);
  const FastDiv block_div(block_size);
  // Byte offsets of the rows of key tile `kt` into rows slot `rs` (0 for masked keys, whose copies are
  // zero-filled: sBytes 0), and the tile's mapped-key bit mask.
  auto find_rows = [&](int kt, int rs) {
    if (tid < KEYS) {
      int blk = -1, in_block = 0;
      const int k = kbase + kt * KEYS + tid;
      if (kt < ntiles && k >= klo && k < khi) {
        const int index = block_div.div(k);
        in_block = k - index * block_size;
        blk = physical_block(block_table, max_blocks, num_blocks, b, index);
      }
      sRows[rs * KEYS + tid] = blk >= 0 ? ((long long)blk * block_size + in_block) * row_stride_bytes + head_bytes : 0;
      sBytes[rs * KEYS + tid] = blk >= 0 ? 16 : 0;
      const unsigned mapped = __ballot_sync(0xffffffffu, blk >= 0);
      if (lane == 0) sMapped[rs * MASK_WORDS + warp] = mapped;
    }
  };
  // cp.async of key tile into stage `st` from rows slot `rs`: a thread copies the same 16-byte column of
  // rows key0, key0 + KSTEP, ...; their swizzled destinations differ by row % 8 when KSTEP % 8 != 0 (D=256).
  constexpr int CHUNKS_PER_ROW = D * (int)sizeof(C) / 16, KSTEP = THREADS / CHUNKS_PER_ROW;
  static_assert(THREADS % CHUNKS_PER_ROW == 0 && KEYS % KSTEP == 0, "whole copy rounds");
  const int copy_key0 = tid / CHUNKS_PER_ROW, copy_col = (tid % CHUNKS_PER_ROW) * 16;  // bytes
  auto copy_dst = [&](int key) {
    return Cache::quantized ? (unsigned)(key * D + copy_col) : (unsigned)(2 * swz<D>(key, copy_col / 2));
  };
  const unsigned char* k_src = reinterpret_cast<const unsigned char*>(key_cache) + copy_col;
  const unsigned char* v_src = reinterpret_cast<const unsigned char*>(value_cache) + copy_col;
  auto load_tile = [&](int st, int rs) {
    const unsigned dK = stages_a + st * L::stage_bytes;
    const long long* rows = sRows + rs * KEYS + copy_key0;
    const int* bytes = sBytes + rs * KEYS + copy_key0;
#pragma unroll
    for (int i = 0; i < KEYS / KSTEP; ++i) {
      const long long off = rows[i * KSTEP];
      const int n = bytes[i * KSTEP];
      const unsigned dst = dK + copy_dst(copy_key0 + i * KSTEP);
      cp_async_16_or_zero(dst, k_src + off, n);
      cp_async_16_or_zero(dst + KEYS * D * (int)sizeof(C), v_src + off, n);
    }
  };

#pragma unroll
  for (int s = 0; s < NST; ++s) find_rows(s, s);
  __syncthreads();  // sQ, row offsets of the first NST tiles
#pragma unroll
  for (int s = 0; s < NST - 1; ++s) {
    if (s < ntiles) load_tile(s, s);
    cp_async_commit();
  }

  // This thread's rows r0 = lane / 4 and r0 + 8 of the warp's m16 tile (i = 0, 1): their ranges, tokens,
  // heads, bias rows and output_qk rows; the warp's union (tiles outside it are skipped) and intersection
  // (tiles inside it need no per-element mask).
  const int r0 = warp * 16 + (lane >> 2);
  int row_lo[2], row_hi[2];
  const T* bias_row[2];
  float* qk_row[2];
  int wlo_min = RANGE_NONE_LO, whi_max = RANGE_NONE_HI, wlo_max = RANGE_NONE_HI, whi_min = RANGE_NONE_LO;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = r0 + 8 * i, lo = sLo[r], hi = sHi[r], tok = sTok[r];
    row_lo[i] = lo;
    row_hi[i] = hi;
    bias_row[i] = bias && hi > lo ? bv.row(b, sHead[r], tok - rt.seq_cum) : bias;
    qk_row[i] = qk_mode && hi > lo ? output_qk + ((long long)sHead[r] * token_count + tok) * kv_capacity : output_qk;
    if (hi > lo) {
      wlo_min = min(wlo_min, lo);
      whi_max = max(whi_max, hi);
      wlo_max = max(wlo_max, lo);
      whi_min = min(whi_min, hi);
    }
  }
  wlo_min = __reduce_min_sync(0xffffffffu, wlo_min);
  whi_max = __reduce_max_sync(0xffffffffu, whi_max);
  wlo_max = __reduce_max_sync(0xffffffffu, wlo_max);
  whi_min = __reduce_min_sync(0xffffffffu, whi_min);
  const bool bias_pairs = (bias_k & 1) == 0 && (reinterpret_cast<unsigned long long>(bias) & 3u) == 0;
  const bool qk_pairs = (kv_capacity & 1) == 0;

  // ldmatrix addresses (as in prefill.cu): rows of a multiple of 128 bytes, chunks XOR-swizzled by row % 8.
  constexpr int ROW_BYTES = 2 * D;
  const int mi = lane >> 3, l7 = lane & 7;
  const unsigned q_lane = sQ_a + (warp * 16 + (lane & 15)) * ROW_BYTES + ((((lane >> 4) ^ l7)) << 4);
  const unsigned k_lane = ((mi >> 1) * 8 + l7) * ROW_BYTES + (((mi & 1) ^ l7) << 4);
  const unsigned v_lane = ((mi & 1) * 8 + l7) * ROW_BYTES + (((mi >> 1) ^ l7) << 4);
  auto step_addr = [](unsigned base, int kk) { return (base ^ (unsigned)((kk & 3) << 5)) + (unsigned)((kk >> 2) * 128); };

  const float score_scale = scale * (k_quant == QUANT_PER_TENSOR ? k_scale[0] : 1.0f);
  const float inv_softcap = softcap > 0.0f ? 1.0f / softcap : 0.0f;
  float o[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
  float row_max[2] = {CUPA_NEG_INF, CUPA_NEG_INF}, row_sum[2] = {0.0f, 0.0f};  // log2 domain; this lane's share

  // The bias entries of this thread's fragment of tile kt (admitted keys only), loaded a tile ahead: their
  // latency (HBM: the bias is read once) overlaps a whole tile's work.
  auto load_bias = [&](int kt, unsigned (&bits)[2][NT]) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        const int k = kbase + kt * KEYS + j * 8 + (lane & 3) * 2;
        bits[i][j] = load_bias_pair(bias_row[i], k, k >= row_lo[i] && k < row_hi[i],
                                    k + 1 >= row_lo[i] && k + 1 < row_hi[i], bias_pairs);
      }
    }
  };
  unsigned bias_next[2][NT];
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < NT; ++j) bias_next[i][j] = 0u;
  if (bias && ntiles > 0) load_bias(0, bias_next);

  int stage = 0, slot = 0;  // kt % NST, kt % (NST + 1)
  for (int kt = 0; kt < ntiles; ++kt, stage = stage + 1 == NST ? 0 : stage + 1, slot = slot == NST ? 0 : slot + 1) {
    const int kt0 = kbase + kt * KEYS;
    unsigned bias_bits[2][NT];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int j = 0; j < NT; ++j) bias_bits[i][j] = bias_next[i][j];
    if (bias && kt + 1 < ntiles) load_bias(kt + 1, bias_next);
    cp_async_wait<NST - 2>();
    __syncthreads();
    if (kt + NST - 1 < ntiles) load_tile(stage == 0 ? NST - 1 : stage - 1, slot <= 1 ? slot + NST - 1 : slot - 2);
    cp_async_commit();
    if (kt + NST < ntiles) find_rows(kt + NST, slot == 0 ? NST : slot - 1);  // read after the next barrier

    unsigned k_base, v_base;
    if constexpr (Cache::quantized) {
      const C* rK = reinterpret_cast<const C*>(stages + stage * L::stage_bytes);
      const C* rV = rK + KEYS * D;
      for (int c = tid; c < KEYS * D / 16; c += THREADS) {
        const int key = c / (D / 16), col = (c % (D / 16)) * 16;
        widen16<T, Cache>(rK + key * D + col, sKw + swz<D>(key, col), sKw + swz<D>(key, col + 8));
        widen16<T, Cache>(rV + key * D + col, sVw + swz<D>(key, col), sVw + swz<D>(key, col + 8));
      }
      __syncthreads();
      k_base = sKw_a + k_lane;
      v_base = sKw_a + KEYS * ROW_BYTES + v_lane;
    } else {
      k_base = stages_a + stage * L::stage_bytes + k_lane;
      v_base = stages_a + stage * L::stage_bytes + KEYS * ROW_BYTES + v_lane;
    }
    if (kt0 >= whi_max || kt0 + KEYS <= wlo_min) continue;  // no row of this warp admits these keys
    const unsigned* mapped = sMapped + slot * MASK_WORDS;
    unsigned mw[MASK_WORDS];
    bool all_mapped = true;
#pragma unroll
    for (int w = 0; w < MASK_WORDS; ++w) {
      mw[w] = mapped[w];
      all_mapped = all_mapped && mw[w] == 0xffffffffu;
    }
    const bool interior = all_mapped && kt0 >= wlo_max && kt0 + KEYS <= whi_min;

    // S = Q K^T for the warp's 16 rows and the tile's keys.
    float s[NT][4];
#pragma unroll
    for (int j = 0; j < NT; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      unsigned qa[4], qa_lo[4];
      ldsm_x4(qa, step_addr(q_lane, kk));
      if (q_split) ldsm_x4(qa_lo, step_addr(q_lane + L::q_bytes, kk));
      const unsigned ka = step_addr(k_base, kk);
#pragma unroll
      for (int j2 = 0; j2 < KEYS / 16; ++j2) {
        unsigned bk[4];
        ldsm_x4(bk, ka + j2 * 16 * ROW_BYTES);
        Mma<T>::run(s[2 * j2], qa, bk[0], bk[1]);
        Mma<T>::run(s[2 * j2 + 1], qa, bk[2], bk[3]);
        if (q_split) {
          Mma<T>::run(s[2 * j2], qa_lo, bk[0], bk[1]);
          Mma<T>::run(s[2 * j2 + 1], qa_lo, bk[2], bk[3]);
        }
      }
    }

    // Scores (scale, bias, softcap), output_qk, then the log2-domain exponent with masked keys at -inf.
#pragma unroll
    for (int i = 0; i < 2; ++i) {
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        const float2 bj = unpack2<T>(bias_bits[i][j]);
        const int col = j * 8 + (lane & 3) * 2, k = kt0 + col;
        float x[2];
        bool ok[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float v = fmaf(s[j][2 * i + e], score_scale, e ? bj.y : bj.x);
          if (softcap > 0.0f) v = softcap * tanhf(v * inv_softcap);
          x[e] = v;
          const bool in_range = k + e >= row_lo[i] && k + e < row_hi[i];
          ok[e] = interior || (in_range && ((mw[col >> 5] >> ((col + e) & 31)) & 1u));
          s[j][2 * i + e] = ok[e] ? v * CUPA_LOG2E : CUPA_NEG_INF;
        }
        if (qk_mode) {
          const bool w0 = k >= row_lo[i] && k < row_hi[i] && k < kv_capacity;
          const bool w1 = k + 1 >= row_lo[i] && k + 1 < row_hi[i] && k + 1 < kv_capacity;
          const float v0 = qk_entry(ok[0], x[0], qk_mode), v1 = qk_entry(ok[1], x[1], qk_mode);
          if (qk_pairs && w0 && w1) {
            *reinterpret_cast<float2*>(qk_row[i] + k) = make_float2(v0, v1);
          } else {
            if (w0) qk_row[i][k] = v0;
            if (w1) qk_row[i][k + 1] = v1;
          }
        }
      }
    }
    float c[2];
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      float mx = CUPA_NEG_INF;
#pragma unroll
      for (int j = 0; j < NT; ++j) mx = fmaxf(mx, fmaxf(s[j][2 * hf], s[j][2 * hf + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float n = fmaxf(row_max[hf], mx);
      // A row with no admitted key yet keeps o == 0 and sum == 0; its exponent base is 0 so that masked
      // scores (-inf) give exp2(-inf) = 0.
      c[hf] = row_max[hf] == n ? 1.0f : ex2_approx(row_max[hf] - n);
      row_max[hf] = n;
    }
    float base[2], sum[2] = {0.0f, 0.0f};
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) base[hf] = row_max[hf] == CUPA_NEG_INF ? 0.0f : row_max[hf];
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[j][e] = ex2_approx(s[j][e] - base[e >> 1]);
        sum[e >> 1] += s[j][e];
      }
    }
    row_sum[0] = row_sum[0] * c[0] + sum[0];
    row_sum[1] = row_sum[1] * c[1] + sum[1];
    if (__any_sync(0xffffffffu, c[0] != 1.0f || c[1] != 1.0f)) {
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        o[n][0] *= c[0];
        o[n][1] *= c[0];
        o[n][2] *= c[1];
        o[n][3] *= c[1];
      }
    }

    // O += P V. A key some live row of the warp does not admit (outside the intersection of their ranges)
    // has P = 0 for that row, and 0 times an Inf or NaN V element is NaN: the 16-key steps holding such keys
    // read V with non-finite values replaced by 0 (contract §4.4; for a row that admits the key the result
    // is unspecified anyway). Unmapped rows were zero-filled.
#pragma unroll
    for (int j2 = 0; j2 < KEYS / 16; ++j2) {
      const bool clean_v = !(kt0 + 16 * j2 >= wlo_max && kt0 + 16 * j2 + 16 <= whi_min);  // (uniform in the warp)
      unsigned a[4];
      a[0] = Mma<T>::pack(s[2 * j2][0], s[2 * j2][1]);
      a[1] = Mma<T>::pack(s[2 * j2][2], s[2 * j2][3]);
      a[2] = Mma<T>::pack(s[2 * j2 + 1][0], s[2 * j2 + 1][1]);
      a[3] = Mma<T>::pack(s[2 * j2 + 1][2], s[2 * j2 + 1][3]);
#pragma unroll
      for (int nn = 0; nn < D / 16; ++nn) {
        unsigned bv4[4];
        ldsm_x4_trans(bv4, step_addr(v_base, nn) + j2 * 16 * ROW_BYTES);
        if (clean_v) {
#pragma unroll
          for (int e = 0; e < 4; ++e) bv4[e] = finite_or_zero2<T>(bv4[e]);
        }
        Mma<T>::run(o[2 * nn], a, bv4[0], bv4[1]);
        Mma<T>::run(o[2 * nn + 1], a, bv4[2], bv4[3]);
      }
    }
  }
  cp_async_wait<0>();

#pragma unroll
  for (int i = 0; i < 2; ++i) {
    row_sum[i] += __shfl_xor_sync(0xffffffffu, row_sum[i], 1);
    row_sum[i] += __shfl_xor_sync(0xffffffffu, row_sum[i], 2);
  }
  if (!direct) {
    // This split's partial states of the CTA's rows (general.cuh), the V scale left to the merge.
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int r = r0 + 8 * i, tok = sTok[r];
      if (tok < 0) continue;
      const long long state = ((long long)tok * H + sHead[r]) * num_splits + split;
      if ((lane & 3) == 0) part_ml[state] = make_float2(row_max[i] * CUPA_LN2, row_sum[i]);
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        const int d = n * 8 + (lane & 3) * 2;
        *reinterpret_cast<float2*>(part_o + state * D + d) = make_float2(o[n][2 * i], o[n][2 * i + 1]);
      }
    }
    return;
  }

  // One split: finalize this warp's rows into its own rows of sQ (as T), then store whole rows; the lse. Each
  // element is finalize() of its (m, l, o), the arithmetic general_finish.cu applies to a row whose keys lie in
  // one split of several, so a bound that changes the number of launched splits never changes a bit (contract §4.5).
  const bool has_sink = head_sink != nullptr;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = r0 + 8 * i;
    const bool live = sHi[r] > sLo[r];
    const float sink = has_sink ? Act<T>::to_float(head_sink[sHead[r]]) : 0.0f;
    const float m = row_max[i] * CUPA_LN2;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      const int d = n * 8 + (lane & 3) * 2;
      const float vs0 = v_quant ? quant_scale(v_scale, v_quant, g, D, d) : 1.0f;
      const float vs1 = v_quant ? quant_scale(v_scale, v_quant, g, D, d + 1) : 1.0f;
      const float x0 = live ? finalize(m, row_sum[i], o[n][2 * i], has_sink, sink, vs0) : 0.0f;
      const float x1 = live ? finalize(m, row_sum[i], o[n][2 * i + 1], has_sink, sink, vs1) : 0.0f;
      *reinterpret_cast<unsigned*>(sQ + swz<D>(r, d)) = Mma<T>::pack(x0, x1);
    }
    if (lse && (lane & 3) == 0 && sTok[r] >= 0)
      lse[(long long)sTok[r] * H + sHead[r]] = live ? state_lse(m, row_sum[i]) : CUPA_NEG_INF;
  }
  __syncwarp();
  for (int c = lane; c < 16 * (D / 8); c += 32) {
    const int r = warp * 16 + c / (D / 8), col = (c % (D / 8)) * 8;
    const int tok = sTok[r];
    if (tok < 0) continue;
    *reinterpret_cast<uint4*>(out + ((long long)tok * H + sHead[r]) * D + col) =
        *reinterpret_cast<const uint4*>(sQ + swz<D>(r, col));
  }
}
