// Paged prefill on tensor cores (fp16/bf16 T; T, int8, fp8 or packed 4-bit caches; head_size 64/128/256).
// One CTA owns a tile of ROWS query rows of ONE sequence b and ONE KV head g. A sequence's rows
// are its (new token, query head of g's group) pairs in token-major order, row = j*G + gi, so the
// G heads of a token sit in one tile and each K/V byte is read once per KV head and tile. Each of
// the WARPS warps owns 16*M_TILES rows (M_TILES mma.sync m16n8k16 tiles that share every K and V
// fragment read from shared memory) and keeps their online-softmax state in registers; every warp
// sees every key, so no merge across warps is needed.
// Keys stream through shared memory in tiles of KEYS (cp.async, STAGES stages, rows gathered through
// the block table one by one, row offsets computed one tile ahead, masked rows zero-filled), over
// the union of the rows' admitted ranges; per-row ranges (key_range of each row's own position:
// causal, window, kv_len) and block validity are applied per element only on tiles that are not
// wholly inside every row's range, and a warp skips tiles outside all of its rows' ranges. A key a
// row does not admit never reaches its output (contract §4.4, non-finite values): masked scores are
// selected to -inf; V values that meet P = 0 have Inf / NaN replaced by 0 (the V rows of keys outside
// the CTA's intersection of ranges, in shared memory before the products; fp8 codes as they are
// widened), and rows without admitted keys write zeros.
// Quantized tiles land as codes (packed 4-bit codes: rows of D/2 bytes; VCache, V's trait, may be the
// other 4-bit kind) and are widened to T in shared memory; the K scale is folded into Q (PER_CHANNEL)
// or the score scale (PER_TENSOR), the V scale into the epilogue.
//
// Launch (one dimension, no host value read from the device): zero_ctas zero-pass CTAs, then
// num_tiles * Hk attention CTAs. The row tiles of all sequences are numbered on one axis: sequence
// b's tiles start at floor(origin(b)*G / ROWS) + b, where origin(b) is the first packed token
// find_owner gives to b or a later sequence (cum[b] for a well-formed cum). The sequences' token
// intervals never overlap, for any cum, so neither do their tile ranges, and num_tiles =
// floor(N*G/ROWS) + B covers them all; a CTA finds its sequence with a warp-wide search and exits
// at once when its index is a gap. Tiles run heaviest-first (the last rows of a causal sequence
// see the most keys). The zero-pass CTAs zero the rows of tokens no sequence owns.
// With BIAS, attention_bias (batch 1 or B, heads 1 or H, q_capacity, kv_capacity) is added to the scores
// after the scale and before softcap: each row's range ends at the capacities (general.cuh), tiles start at
// a multiple of 8 keys, and each stage holds the tile's bias entries beside its K/V rows (load_bias).
// Reads: Q (the prologue's workspace or `query`), the caches through the block table (or new K/V
// from key / value: NewKeys), cum / past_seqlens / query_positions, head_sink, the scales, the bias
// entries of admitted keys' chunks. Writes:
// `out`, and `lse` when asked for (non-null: each row's log-sum-exp, from the epilogue's row max and
// sum; -inf for the zero pass's tokens). Host values that size the launch: token_count, batch_size,
// head counts and the tile (TILE_ROWS x TILE_KEYS); none enters a mask.
#include "common.cuh"
#include "general.cuh"  // BiasView
#include "mma.cuh"
#include "paged.cuh"
#include "quant.cuh"
#include "softmax.cuh"
#include "prefill_tiles.cuh"  // tile numbering, zero pass, FastDiv, cp.async / ldmatrix wrappers

// Tile shapes (a CTA's ROWS query rows x KEYS keys per shared-memory tile; template parameters,
// mirrored in cupa/kernels/prefill.py): WARPS warps of M_TILES x 16 query rows, STAGES cp.async
// stages, MIN_CTAS CTAs per SM (registers sized for it). Q_IN_REGS: Q fragments stay in registers
// for the whole key loop; otherwise they are reloaded from shared memory at each step, leaving the
// registers to the fp32 accumulators (PrefillShape<WARPS, M_TILES, STAGES, MIN_CTAS, Q_IN_REGS>).
// Dynamic shared memory (PrefillSmem; static arrays add 1.6-3.3 KB) and the GPUs each shape serves:
//   D=64   128 x 64, 3 stages:  68,768 B (every GPU)
//   D=128  128 x 64, 2 stages: 100,760 B (sm_90/100 at 2 CTAs per SM). Per-tile costs (barrier, copy
//          issue, row lookups, mask test) amortize over twice the MMAs of a 32-key tile.
//   D=128  128 x 32, 2 stages:  66,828 B (a CTA of sm_86/89/120 may use 101,376 B; 2 CTAs per sm_80 SM)
//   D=256  128 x 32, 2 stages: 132,364 B (sm_80/90/100)
//   D=256   64 x 32, 2 stages:  99,596 B (sm_86/89/120: within 101,376 B with the static arrays)
template <int WARPS_, int M_TILES_, int STAGES_, int MIN_CTAS_, bool Q_IN_REGS_> struct PrefillShape {
  static constexpr int WARPS = WARPS_, M_TILES = M_TILES_, STAGES = STAGES_, MIN_CTAS = MIN_CTAS_;
  static constexpr bool Q_IN_REGS = Q_IN_REGS_;
};
template <int D, int ROWS, int KEYS> struct PrefillConfig;
template <> struct PrefillConfig<64, 128, 64> : PrefillShape<4, 2, 3, 2, true> {};
template <> struct PrefillConfig<128, 128, 64> : PrefillShape<4, 2, 2, 2, false> {};
template <> struct PrefillConfig<128, 128, 32> : PrefillShape<4, 2, 2, 2, false> {};
template <> struct PrefillConfig<256, 128, 32> : PrefillShape<8, 1, 2, 1, false> {};
template <> struct PrefillConfig<256, 64, 32> : PrefillShape<4, 1, 2, 1, false> {};

template <typename T, typename Cache, int D, int ROWS_, int KEYS_, bool BIAS = false>
struct PrefillSmem {
  using Cfg = PrefillConfig<D, ROWS_, KEYS_>;
  using C = typename Cache::storage;
  static constexpr int code_row_bytes = D * (int)sizeof(C) / Cache::PACK;  // a cache row as stored
  static constexpr int ROWS = ROWS_;
  static constexpr int KEYS = KEYS_;
  static_assert(ROWS == 16 * Cfg::M_TILES * Cfg::WARPS, "the warps' m16 tiles cover the CTA's rows");
  static constexpr int NST = Cfg::STAGES;
  static constexpr int q_bytes = ROWS * D * 2;                                   // Q tile, then the output tile
  static constexpr int stage_bytes = 2 * KEYS * code_row_bytes;                   // K and V tiles as stored
  static constexpr int wide_bytes = Cache::quantized ? 2 * KEYS * D * 2 : 0;      // widened K and V
  static constexpr int bias_stage_bytes = BIAS ? ROWS * KEYS * 2 : 0;            // (BIAS) a tile's bias entries
  static constexpr int bias_bytes = NST * bias_stage_bytes + (BIAS ? ROWS * 8 : 0);  // and each row's bias offset
  static constexpr int rows_bytes = (NST + 1) * KEYS * 8;                         // row byte offsets, one tile ahead
  static constexpr int bytes_bytes = (NST + 1) * KEYS * 4;                        // copy sizes (16 or 0: masked)
  static constexpr int mapped_bytes = (NST + 1) * (KEYS / 32) * 4;                // mapped-key bit masks
  static constexpr int align_pad = 128;  // the dynamic region is rounded up to a 128-byte boundary
  static constexpr int total = q_bytes + NST * stage_bytes + wide_bytes + bias_bytes + rows_bytes + bytes_bytes +
                               mapped_bytes + align_pad;
  static_assert(total <= 163 * 1024, "an sm_80 CTA's dynamic shared memory");
};

template <typename T, typename Cache, int D, int TILE_ROWS, int TILE_KEYS, typename VCache = Cache, bool BIAS = false>
__global__ void __launch_bounds__(PrefillConfig<D, TILE_ROWS, TILE_KEYS>::WARPS * 32,
                                  PrefillConfig<D, TILE_ROWS, TILE_KEYS>::MIN_CTAS) paged_prefill(
    const T* __restrict__ q,  // (N, H, D): prologue output, or `query` itself
    const T* __restrict__ key, const T* __restrict__ value,  // new K/V rows to read (NewKeys), or null
    const typename Cache::storage* __restrict__ key_cache, const typename VCache::storage* __restrict__ value_cache,
    const int* __restrict__ cum, const int* __restrict__ past, const int* __restrict__ block_table,
    const int* __restrict__ query_positions, const T* __restrict__ head_sink,
    const float* __restrict__ k_scale, const float* __restrict__ v_scale, T* __restrict__ out,
    float* __restrict__ lse, int token_count, int num_heads, int kv_num_heads, int batch_size, int num_blocks,
    int block_size, int max_blocks, int zero_ctas, int num_tiles, int rotary_max_pos, float scale,
    float softcap, int window, int is_causal, int k_quant, int v_quant, const T* __restrict__ bias, int bias_batch,
    int bias_heads, int bias_q, int bias_k) {
  using Cfg = PrefillConfig<D, TILE_ROWS, TILE_KEYS>;
  using L = PrefillSmem<T, Cache, D, TILE_ROWS, TILE_KEYS, BIAS>;
  using C = typename Cache::storage;
  constexpr int WARPS = Cfg::WARPS, THREADS = WARPS * 32, ROWS = L::ROWS, KEYS = L::KEYS, NST = L::NST;
  constexpr int MASK_WORDS = KEYS / 32;
  constexpr bool CLEAN_CODES = Cache::quantized && !Cache::always_finite;  // fp8: NaN codes
  constexpr bool CTA_INTER = CLEAN_CODES || !Cache::quantized;  // tiles outside sCtaInter are cleaned
  constexpr int CODE_ROW = L::code_row_bytes;  // bytes of a K or V row in a stage
  static_assert(Cache::quantized == VCache::quantized && Cache::PACK == VCache::PACK && VCache::always_finite ==
                Cache::always_finite, "K and V caches of one storage layout");
  static_assert(D % 64 == 0 && D <= 256, "head_size 64, 128 or 256");
  static_assert(KEYS % 32 == 0 && KEYS <= THREADS, "one thread per key row when finding rows");
  static_assert(ROWS <= THREADS && ROWS % 32 == 0, "one thread per query row when locating rows");

  // The prologue's writes (cache rows, Q workspace) are visible after grid_dependency_wait. Without
  // new-key inputs every CTA waits here; with them (NewKeys, prefill_tiles.cuh) CTA 0 does (so the
  // grid never completes ahead of the prologue: see common.cuh) and so does, further down, every
  // CTA that reads a cache row.
  const bool kv_new = !Cache::quantized && key != nullptr;  // (a quantized cache never gets them)
  if (!kv_new || blockIdx.x == 0) grid_dependency_wait();
  if ((int)blockIdx.x < zero_ctas) {
    prefill_zero_pass<T, WARPS>(out, cum, batch_size, token_count, num_heads, D, lse);
    return;
  }

  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((128u - (smem_addr(smem_raw) & 127u)) & 127u);
  __shared__ int sTok[ROWS];  // packed token of each row, -1: not this CTA's row
  __shared__ int sHead[ROWS];  // query head of each row (g*G + row % G)
  __shared__ int sLo[ROWS], sHi[ROWS];  // admitted key range of each row (empty: zero output)
  __shared__ int sRangeLo[WARPS], sRangeHi[WARPS];
  __shared__ int sInterLo[WARPS], sInterHi[WARPS];  // per locating warp: the intersection of its live rows' ranges
  __shared__ int2 sCtaInter;  // the intersection over the CTA's live rows (caches that may hold non-finite V)
  __shared__ int4 sWarpRange[WARPS];  // per warp: union lo, union hi, intersection lo, intersection hi
  T* sQ = reinterpret_cast<T*>(smem);
  unsigned char* stages = smem + L::q_bytes;
  T* sKw = reinterpret_cast<T*>(stages + NST * L::stage_bytes);  // widened tiles (quantized only)
  T* sVw = sKw + KEYS * D;
  unsigned char* sBias = stages + NST * L::stage_bytes + L::wide_bytes;  // (BIAS) NST tiles of ROWS x KEYS entries
  long long* sBiasRow = reinterpret_cast<long long*>(sBias + NST * L::bias_stage_bytes);  // (BIAS) row r's entries
  long long* sRows = reinterpret_cast<long long*>(sBias + L::bias_bytes);
  int* sBytes = reinterpret_cast<int*>(sRows + (NST + 1) * KEYS);
  unsigned* sMapped = reinterpret_cast<unsigned*>(sBytes + (NST + 1) * KEYS);
  const unsigned sQ_a = smem_addr(sQ), stages_a = smem_addr(stages), sKw_a = smem_addr(sKw);

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int H = num_heads, Hk = kv_num_heads, G = H / Hk;
  const int cta = (int)blockIdx.x - zero_ctas;
  const int g = cta % Hk;
  const long long x = (long long)num_tiles - 1 - cta / Hk;  // heaviest tiles first

  // Which sequence and which of its row tiles (every warp computes the same, so exits are uniform).
  const int B = batch_size;
  RowTile rt;
  if (!locate_row_tile<ROWS>(cum, B, token_count, x, G, lane, rt)) return;
  const int b = rt.b;

  // Each row's token, ownership and admitted range (thread i: row i; prefill_tiles.cuh).
  __shared__ NewKeys sNew;
  if (tid == 0) sNew = new_keys(kv_new, rt, __ldg(past + b), G);
  if (tid < ROWS) {
    int lo, hi;
    locate_tile_row(rt, tid, g, G, cum, past, B, query_positions, (long long)max_blocks * block_size,
                    rotary_max_pos, is_causal, window, sTok, sHead, sLo, sHi, lo, hi);
    if constexpr (BIAS) {  // contract §4.3: the bias capacities end the row's range (general.cuh)
      const BiasView<T> bv{bias, bias_batch, bias_heads, bias_q, bias_k};
      if (sTok[tid] >= 0) bv.clamp(sTok[tid] - rt.seq_cum, lo, hi);
      if (hi <= lo) lo = hi = 0;
      sLo[tid] = lo;
      sHi[tid] = hi;
      sBiasRow[tid] = hi > lo ? bv.row(b, sHead[tid], sTok[tid] - rt.seq_cum) - bias : 0;
    }
    const bool live = hi > lo;
    const int rlo = __reduce_min_sync(0xffffffffu, live ? lo : RANGE_NONE_LO);
    const int rhi = __reduce_max_sync(0xffffffffu, live ? hi : RANGE_NONE_HI);
    if (lane == 0) {
      sRangeLo[warp] = rlo;
      sRangeHi[warp] = rhi;
    }
    if constexpr (CTA_INTER) {
      const int ilo = __reduce_max_sync(0xffffffffu, live ? lo : RANGE_NONE_HI);
      const int ihi = __reduce_min_sync(0xffffffffu, live ? hi : RANGE_NONE_LO);
      if (lane == 0) {
        sInterLo[warp] = ilo;
        sInterHi[warp] = ihi;
      }
    }
  }
  __syncthreads();
  int klo = RANGE_NONE_LO, khi = RANGE_NONE_HI;  // the union of the rows' ranges
#pragma unroll
  for (int w = 0; w < ROWS / 32; ++w) {
    klo = min(klo, sRangeLo[w]);
    khi = max(khi, sRangeHi[w]);
  }
  if (CTA_INTER && tid == 0) {  // (read in the key loop: the barrier before it orders the write)
    int2 inter = make_int2(RANGE_NONE_HI, RANGE_NONE_LO);
    for (int w = 0; w < ROWS / 32; ++w) inter = make_int2(max(inter.x, sInterLo[w]), min(inter.y, sInterHi[w]));
    sCtaInter = inter;
  }
  // (BIAS) Tiles start at a multiple of 8 keys, so that a tile's bias entries are whole 16-byte chunks: the
  // union starts at klo rounded down (the keys added are admitted by no row: masked, their V rows cleaned).
  if constexpr (BIAS) klo = khi > klo ? klo & ~7 : klo;
  const int ntiles = khi > klo ? (khi - klo + KEYS - 1) / KEYS : 0;
  // Every admitted key is one of the sequence's new tokens: K/V tiles come from key / value (NewKeys).
  const bool from_inputs = kv_new && ntiles > 0 && klo >= sNew.lo && khi <= sNew.hi;
  const int tok_shift = sNew.tok_shift;  // (a register: find_rows runs on the loop's critical path)

  // Q rows; rows without admitted keys are zero. Without a per-channel K scale the rows are copied
  // as they are with cp.async (in the first copy group, with the first K/V tile, so their latency
  // overlaps the block lookups); with one, the scale is folded in through registers. When no tile
  // is loaded the epilogue writes zeros without reading sQ, and no copy may still be landing in it
  // then (the loop's first barrier is what orders the copies before any warp reads or rewrites sQ).
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
        store8(sQ + swz<D>(r, col), v);
      }
    } else {
#pragma unroll
      for (int c = tid; c < ROWS * (D / 8); c += THREADS) {
        const int r = c / (D / 8), col = (c % (D / 8)) * 8;
        const bool live = sHi[r] > sLo[r];
        const T* src = live ? q + ((long long)sTok[r] * H + sHead[r]) * D + col : q;
        cp_async_16_or_zero(sQ_a + 2u * (unsigned)swz<D>(r, col), src, live);
      }
    }
  }

  const long long row_stride_bytes = (long long)Hk * CODE_ROW;
  const long long head_bytes = (long long)g * CODE_ROW;
  const FastDiv block_div(block_size);
  // Byte offsets of the rows of key tile `kt` into rows slot `rs` (0 for masked keys, whose copies
  // are zero-filled: sBytes 0), and the tile's mapped-key bit mask.
  auto find_rows = [&](int kt, int rs) {
    if (tid < KEYS) {
      int blk = -1, k = 0, in_block = 0;
      if (kt < ntiles) {
        k = klo + kt * KEYS + tid;
        if (k < khi) {
          const int index = block_div.div(k);
          in_block = k - index * block_size;
          blk = physical_block(block_table, max_blocks, num_blocks, b, index);
        }
      }
      // the row: new token k + tok_shift of key / value, or the cache slot
      const long long row = from_inputs ? new_token_row(k, tok_shift) : (long long)blk * block_size + in_block;
      sRows[rs * KEYS + tid] = blk >= 0 ? row * row_stride_bytes + head_bytes : 0;
      sBytes[rs * KEYS + tid] = blk >= 0 ? 16 : 0;
      const unsigned mapped = __ballot_sync(0xffffffffu, blk >= 0);
      if (lane == 0) sMapped[rs * MASK_WORDS + warp] = mapped;
    }
  };
  // cp.async of key tile into stage `st` from rows slot `rs`: a thread always copies the same
  // 16-byte column of rows key0, key0 + KSTEP, ..., so its swizzled destination is one offset.
  constexpr int CHUNKS_PER_ROW = CODE_ROW / 16, KSTEP = THREADS / CHUNKS_PER_ROW;
  static_assert(THREADS % CHUNKS_PER_ROW == 0 && KEYS % KSTEP == 0, "whole copy rounds");
  // The swizzle repeats every 8 rows: with KSTEP % 8 == 4 (D=256 on 4 warps) it alternates between
  // two offsets, rows key0 + 8j (even rounds) and key0 + 4 + 8j (odd rounds).
  constexpr bool TWO_PHASES = !Cache::quantized && KSTEP % 8 != 0;
  static_assert(Cache::quantized || KSTEP % 4 == 0, "at most two swizzle phases per thread");
  const int copy_key0 = tid / CHUNKS_PER_ROW, copy_col = (tid % CHUNKS_PER_ROW) * 16;  // bytes
  const unsigned copy_dst = Cache::quantized ? (unsigned)(copy_key0 * CODE_ROW + copy_col)
                                             : (unsigned)(2 * swz<D>(copy_key0, copy_col / 2));
  const unsigned copy_dst_odd =
      TWO_PHASES ? (unsigned)(2 * swz<D>(copy_key0 + KSTEP, copy_col / 2) - KSTEP * CODE_ROW) : copy_dst;
  const unsigned char* k_src =
      reinterpret_cast<const unsigned char*>(from_inputs ? (const void*)key : (const void*)key_cache) + copy_col;
  const unsigned char* v_src =
      reinterpret_cast<const unsigned char*>(from_inputs ? (const void*)value : (const void*)value_cache) + copy_col;
  auto load_tile = [&](int st, int rs) {
    const unsigned dK = stages_a + st * L::stage_bytes + copy_dst;
    const unsigned dK_odd = stages_a + st * L::stage_bytes + copy_dst_odd;
    const long long* rows = sRows + rs * KEYS + copy_key0;
    const int* bytes = sBytes + rs * KEYS + copy_key0;
    long long off[KEYS / KSTEP];
    int n[KEYS / KSTEP];
#pragma unroll
    for (int i = 0; i < KEYS / KSTEP; ++i) {
      off[i] = rows[i * KSTEP];
      n[i] = bytes[i * KSTEP];
    }
#pragma unroll
    for (int i = 0; i < KEYS / KSTEP; ++i) {
      const unsigned d = (TWO_PHASES && (i & 1)) ? dK_odd : dK;
      cp_async_16_or_zero(d + i * KSTEP * CODE_ROW, k_src + off[i], n[i]);
      cp_async_16_or_zero(d + KEYS * CODE_ROW + i * KSTEP * CODE_ROW, v_src + off[i], n[i]);
    }
  };

  // (BIAS) The bias entries of key tile kt into bias stage st, as ROWS rows of KEYS entries: chunk c (keys
  // kt0 + 8c .. kt0 + 8c + 7) of row r at 16-byte column c ^ bias_swz(r), so that the 8 rows an ldmatrix
  // reads sit in 8 distinct bank groups. A chunk with no key of the row's admitted range is zero; the
  // others are read whole when the rows are 16-byte aligned (bias_vec: they lie inside the bias capacity,
  // where the range ends, as the tile start and the capacity are multiples of 8), and entry by entry
  // otherwise, where only admitted entries are read. A read entry the row does not admit is masked later.
  constexpr int BCH = KEYS / 8, BROW = KEYS * 2;  // 16-byte chunks and bytes of a bias tile row
  static_assert(!BIAS || BCH == 4 || BCH == 8, "bias tiles of 32 or 64 keys");
  auto bias_swz = [](int r) { return BCH == 8 ? (r & 7) : ((r >> 1) & 3); };
  const unsigned sBias_a = smem_addr(sBias);
  const bool bias_vec = (bias_k & 7) == 0 && (reinterpret_cast<unsigned long long>(bias) & 15u) == 0;
  auto load_bias = [&](int st, int kt) {
    if constexpr (BIAS) {
      const int c = tid % BCH, k0 = klo + kt * KEYS + 8 * c;
#pragma unroll 1  // (unrolled, ptxas keeps every row's operands live and spills on sm_100/120)
      for (int i = 0; i < ROWS * BCH / THREADS; ++i) {
        const int r = tid / BCH + i * (THREADS / BCH);
        const int lo = sLo[r], hi = sHi[r];
        const bool any = k0 < hi && k0 + 8 > lo;
        const int at = st * L::bias_stage_bytes + r * BROW + ((c ^ bias_swz(r)) << 4);
        const T* src = bias + sBiasRow[r] + k0;
        if (bias_vec) {
          cp_async_16_or_zero(sBias_a + at, any ? src : bias, any);
        } else {
          unsigned w[4];
#pragma unroll
          for (int e = 0; e < 4; ++e)
            w[e] = load_bias_pair(src, 2 * e, any && k0 + 2 * e >= lo && k0 + 2 * e < hi,
                                  any && k0 + 2 * e + 1 >= lo && k0 + 2 * e + 1 < hi, false);
          *reinterpret_cast<uint4*>(sBias + at) = make_uint4(w[0], w[1], w[2], w[3]);
        }
      }
    }
  };

#pragma unroll
  for (int s = 0; s < NST; ++s) find_rows(s, s);
  __syncthreads();  // sQ, row offsets of the first NST tiles
  if (kv_new && ntiles > 0 && !from_inputs) grid_dependency_wait();  // reads cache rows
#pragma unroll
  for (int s = 0; s < NST - 1; ++s) {
    if (s < ntiles) {
      load_tile(s, s);
      load_bias(s, s);
    }
    cp_async_commit();
  }

  // This thread's rows: r0 = lane / 4 and r0 + 8 of each of the warp's MT m16 tiles (index
  // i = 2*m + half). Their ranges, and the warp's union (tiles outside it are skipped) and
  // intersection (tiles inside it need no per-element mask).
  constexpr int MT = Cfg::M_TILES, WARP_ROWS = 16 * MT, R = 2 * MT;
  const int warp_row0 = warp * WARP_ROWS, r0 = lane >> 2;
  auto my_row = [&](int i) { return warp_row0 + (i >> 1) * 16 + r0 + (i & 1) * 8; };
  int wlo_min = RANGE_NONE_LO, whi_max = RANGE_NONE_HI, wlo_max = RANGE_NONE_HI, whi_min = RANGE_NONE_LO;
#pragma unroll
  for (int i = 0; i < R; ++i) {
    const int lo = sLo[my_row(i)], hi = sHi[my_row(i)];
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
  // 16-bit caches keep these in shared memory and read them at each tile (ordered by the loop's
  // barrier): four registers fewer across the key loop, where the fp32 accumulators leave none to
  // spare. (Chosen by ptxas's results at 255 registers: 8-bit caches, whose loop also widens the
  // tile, allocate without spills with the registers and spill row_sum without them.)
  if (lane == 0) sWarpRange[warp] = make_int4(wlo_min, whi_max, wlo_max, whi_min);

  // ldmatrix addresses. Every tile starts on a 128-byte boundary and a row is a multiple of 128
  // bytes, so a row's swizzled chunk (c ^ row%8) sits in address bits 4..6: a lane's address for
  // 16-column step kk is (lane base ^ ((kk & 3) << 5)) + (kk >> 2) * 128, with the lane's row, its
  // chunk parity and row%8 in the base (c = 2*kk + parity, so c ^ r == 2*kk ^ (parity ^ r)).
  constexpr int ROW_BYTES = 2 * D;
  const int mi = lane >> 3, l7 = lane & 7;
  // Q (A operand): rows warp_row0 + m*16 + (lane & 15), chunk 2*kk + lane / 16.
  const unsigned q_lane = sQ_a + (warp_row0 + (lane & 15)) * ROW_BYTES + ((((lane >> 4) ^ l7)) << 4);
  // K (B operand of S): rows j2*16 + (mi / 2)*8 + lane % 8, chunk 2*kk + mi % 2.
  const unsigned k_lane = ((mi >> 1) * 8 + l7) * ROW_BYTES + (((mi & 1) ^ l7) << 4);
  // V (B operand of O, transposed): rows j2*16 + (mi % 2)*8 + lane % 8, chunk 2*nn + mi / 2.
  const unsigned v_lane = ((mi & 1) * 8 + l7) * ROW_BYTES + (((mi >> 1) ^ l7) << 4);
  auto step_addr = [](unsigned base, int kk) { return (base ^ (unsigned)((kk & 3) << 5)) + (unsigned)((kk >> 2) * 128); };
  auto load_q = [&](unsigned (&frag)[4], int m, int kk) { ldsm_x4(frag, step_addr(q_lane, kk) + m * 16 * ROW_BYTES); };
  // (BIAS) bias tile: matrix mi of an ldmatrix.x4 is rows (mi % 2)*8 + lane % 8 of an m16 tile, chunk
  // 2*j2 + mi / 2, so that its four registers are the score fragments of keys 16*j2 .. 16*j2 + 15 (as bk
  // for K); the swizzle repeats every 8 rows and chunk 2*j2 ^ t sits at (t << 4) ^ (j2 << 5).
  const int bias_row0 = warp_row0 + (mi & 1) * 8 + l7;
  const unsigned bias_lane = bias_row0 * BROW + (((mi >> 1) ^ bias_swz(bias_row0)) << 4);
  unsigned qf[Cfg::Q_IN_REGS ? MT : 1][Cfg::Q_IN_REGS ? D / 16 : 1][4];
  if constexpr (Cfg::Q_IN_REGS) {
    cp_async_wait<NST - 2>();  // Q landed with the first tile (what the loop's first wait waits for)
    __syncthreads();
#pragma unroll
    for (int m = 0; m < MT; ++m) {
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) load_q(qf[m][kk], m, kk);
    }
  }

  // Scores go to the log2 domain for ex2. The common case (no softcap, positive scale) folds
  // scale*log2(e) into the exponent's FFMA and takes the row max over raw scores; otherwise the
  // scores are transformed first (mul = 1).
  const float score_scale = scale * (k_quant == QUANT_PER_TENSOR ? k_scale[0] : 1.0f);
  const float scale_log2 = score_scale * CUPA_LOG2E;
  const bool fold = !BIAS && !(softcap > 0.0f) && scale_log2 > 0.0f;
  const float mul = fold ? scale_log2 : 1.0f;
  const float inv_softcap = softcap > 0.0f ? 1.0f / softcap : 0.0f;
  float o[MT][D / 8][4];
#pragma unroll
  for (int m = 0; m < MT; ++m) {
#pragma unroll
    for (int n = 0; n < D / 8; ++n) o[m][n][0] = o[m][n][1] = o[m][n][2] = o[m][n][3] = 0.0f;
  }
  float row_max[R], row_sum[R];  // online-softmax state (log2 domain); row_sum is this lane's share
#pragma unroll
  for (int i = 0; i < R; ++i) {
    row_max[i] = CUPA_NEG_INF;
    row_sum[i] = 0.0f;
  }

  int stage = 0, slot = 0;  // kt % NST, kt % (NST + 1)
  for (int kt = 0; kt < ntiles; ++kt, stage = stage + 1 == NST ? 0 : stage + 1, slot = slot == NST ? 0 : slot + 1) {
    int2 inter;
    if constexpr (!Cache::quantized) inter = sCtaInter;  // (read first: its latency passes in the wait)
    cp_async_wait<NST - 2>();  // this thread's copies of tile kt have landed
    if constexpr (!Cache::quantized) {
      // A tile with keys some live row of the CTA does not admit (outside sCtaInter): each thread
      // replaces the Inf / NaN values of the V chunks it copied for those keys by 0 in shared memory,
      // before the barrier that publishes the tile (where such a key meets P = 0, 0 times Inf or NaN
      // would be NaN; for a row that admits the key the result is unspecified anyway). A thread's own
      // cp.async writes are visible to it after the wait, and nothing reads the stage before the
      // barrier. Tiles inside the intersection -- all but the few on a causal diagonal or a window's
      // edge -- cost a compare; masked keys (from khi on) were zero-filled.
      const int kt0 = klo + kt * KEYS;
      if (kt0 < inter.x || kt0 + KEYS > inter.y) {
        unsigned char* v_own = stages + stage * L::stage_bytes + KEYS * ROW_BYTES + copy_dst;
#pragma unroll 2
        for (int i = 0; i < KEYS / KSTEP; ++i) {
          const int k = kt0 + copy_key0 + i * KSTEP;
          if ((k >= inter.x && k < inter.y) || k >= khi) continue;
          uint4* w = reinterpret_cast<uint4*>(v_own + i * KSTEP * ROW_BYTES +
                                              ((TWO_PHASES && (i & 1)) ? (int)copy_dst_odd - (int)copy_dst : 0));
          const uint4 x = *w;
          const uint4 f = make_uint4(finite_or_zero2<T>(x.x), finite_or_zero2<T>(x.y), finite_or_zero2<T>(x.z),
                                     finite_or_zero2<T>(x.w));
          if (f.x != x.x || f.y != x.y || f.z != x.z || f.w != x.w) *w = f;
        }
      }
    }
    __syncthreads();
    if (kt + NST - 1 < ntiles) {
      load_tile(stage == 0 ? NST - 1 : stage - 1, slot <= 1 ? slot + NST - 1 : slot - 2);
      load_bias(stage == 0 ? NST - 1 : stage - 1, kt + NST - 1);
    }
    cp_async_commit();
    if (kt + NST < ntiles) find_rows(kt + NST, slot == 0 ? NST : slot - 1);  // read after the next barrier

    unsigned k_base, v_base;
    if constexpr (Cache::quantized) {
      // Every warp reads every key, so the whole CTA widens the tile, then waits for it.
      const C* rK = reinterpret_cast<const C*>(stages + stage * L::stage_bytes);
      const C* rV = rK + KEYS * (D / Cache::PACK);
      // Codes that decode to NaN (fp8) in a tile with keys some live row does not admit are widened
      // as 0, as 16-bit V fragments are cleaned below (the whole tile: every warp reads it).
      const int kt0 = klo + kt * KEYS;
      if constexpr (Cache::PACK == 2) {  // 16 codes of 8 bytes per step (every 4-bit code is finite)
        for (int c = tid; c < KEYS * D / 16; c += THREADS) {
          const int key = c / (D / 16), col = (c % (D / 16)) * 16;
          widen16_packed<T, Cache>(rK + key * (D / 2) + col / 2, sKw + swz<D>(key, col), sKw + swz<D>(key, col + 8));
          widen16_packed<T, VCache>(rV + key * (D / 2) + col / 2, sVw + swz<D>(key, col), sVw + swz<D>(key, col + 8));
        }
      } else if (CLEAN_CODES && (kt0 < sCtaInter.x || kt0 + KEYS > sCtaInter.y)) {
        for (int c = tid; c < KEYS * D / 16; c += THREADS) {
          const int key = c / (D / 16), col = (c % (D / 16)) * 16;
          widen16<T, Cache>(rK + key * D + col, sKw + swz<D>(key, col), sKw + swz<D>(key, col + 8));
          widen16<T, Cache, CLEAN_CODES>(rV + key * D + col, sVw + swz<D>(key, col), sVw + swz<D>(key, col + 8));
        }
      } else {
        for (int c = tid; c < KEYS * D / 16; c += THREADS) {
          const int key = c / (D / 16), col = (c % (D / 16)) * 16;
          widen16<T, Cache>(rK + key * D + col, sKw + swz<D>(key, col), sKw + swz<D>(key, col + 8));
          widen16<T, Cache>(rV + key * D + col, sVw + swz<D>(key, col), sVw + swz<D>(key, col + 8));
        }
      }
      __syncthreads();
      k_base = sKw_a + k_lane;
      v_base = sKw_a + KEYS * ROW_BYTES + v_lane;
    } else {
      k_base = stages_a + stage * L::stage_bytes + k_lane;
      v_base = stages_a + stage * L::stage_bytes + KEYS * ROW_BYTES + v_lane;
    }

    const int kt0 = klo + kt * KEYS;
    int4 wr;
    if constexpr (Cache::quantized) {
      wr = make_int4(wlo_min, whi_max, wlo_max, whi_min);
    } else {
      wr = sWarpRange[warp];
    }
    if (kt0 >= wr.y || kt0 + KEYS <= wr.x) continue;  // no row of this warp admits these keys
    const unsigned* mapped = sMapped + slot * MASK_WORDS;
    unsigned mw[MASK_WORDS];
    bool all_mapped = true;
#pragma unroll
    for (int w = 0; w < MASK_WORDS; ++w) {
      mw[w] = mapped[w];
      all_mapped = all_mapped && mw[w] == 0xffffffffu;
    }
    const bool interior = all_mapped && kt0 >= wr.z && kt0 + KEYS <= wr.w;

    // S = Q K^T for this warp's rows and the tile's KEYS keys; each K fragment serves all MT tiles.
    float s[MT][KEYS / 8][4];
#pragma unroll
    for (int m = 0; m < MT; ++m) {
#pragma unroll
      for (int j = 0; j < KEYS / 8; ++j) s[m][j][0] = s[m][j][1] = s[m][j][2] = s[m][j][3] = 0.0f;
    }
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      unsigned qa[MT][4];
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        if constexpr (Cfg::Q_IN_REGS) {
#pragma unroll
          for (int e = 0; e < 4; ++e) qa[m][e] = qf[m][kk][e];
        } else {
          load_q(qa[m], m, kk);
        }
      }
      const unsigned ka = step_addr(k_base, kk);
#pragma unroll
      for (int j2 = 0; j2 < KEYS / 16; ++j2) {
        unsigned bk[4];
        ldsm_x4(bk, ka + j2 * 16 * ROW_BYTES);
#pragma unroll
        for (int m = 0; m < MT; ++m) {
          Mma<T>::run(s[m][2 * j2], qa[m], bk[0], bk[1]);
          Mma<T>::run(s[m][2 * j2 + 1], qa[m], bk[2], bk[3]);
        }
      }
    }

    if constexpr (BIAS) {
      // Scores: scale * q.k + bias, then softcap, to the log2 domain (mul = 1).
      const unsigned bias_t = sBias_a + stage * L::bias_stage_bytes + bias_lane;
#pragma unroll
      for (int m = 0; m < MT; ++m) {
#pragma unroll
        for (int j2 = 0; j2 < KEYS / 16; ++j2) {
          unsigned bb[4];
          ldsm_x4(bb, (bias_t + m * 16 * BROW) ^ (unsigned)(j2 << 5));
#pragma unroll
          for (int q4 = 0; q4 < 4; ++q4) {
            const float2 bj = unpack2<T>(bb[q4]);
            float* sv = &s[m][2 * j2 + (q4 >> 1)][(q4 & 1) * 2];
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              float x = fmaf(sv[e], score_scale, e ? bj.y : bj.x);
              if (softcap > 0.0f) x = softcap * tanhf(x * inv_softcap);
              sv[e] = x * CUPA_LOG2E;
            }
          }
        }
      }
    } else if (!fold) {
      // Rare transforms under one uniform branch: softcap, or a scale that cannot be folded.
#pragma unroll
      for (int m = 0; m < MT; ++m) {
#pragma unroll
        for (int j = 0; j < KEYS / 8; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            float x = s[m][j][e] * score_scale;
            if (softcap > 0.0f) x = softcap * tanhf(x * inv_softcap);
            s[m][j][e] = x * CUPA_LOG2E;
          }
        }
      }
    }
    if (!interior) {  // row ranges come from shared memory: registers are scarce here
#pragma unroll
      for (int i = 0; i < R; ++i) {
        const int lo = sLo[my_row(i)], hi = sHi[my_row(i)], m = i >> 1, e0 = (i & 1) * 2;
#pragma unroll
        for (int j = 0; j < KEYS / 8; ++j) {
#pragma unroll
          for (int e = e0; e < e0 + 2; ++e) {
            const int col = j * 8 + (lane & 3) * 2 + (e & 1);
            const int k = kt0 + col;
            const bool admitted = k >= lo && k < hi && ((mw[j >> 2] >> (col & 31)) & 1u);
            s[m][j][e] = admitted ? s[m][j][e] : CUPA_NEG_INF;
          }
        }
      }
    }
    // Both m tiles' maxima first (their shuffle chains interleave), then one vote for the rescale.
    float c[MT][2];
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      float mx[2] = {CUPA_NEG_INF, CUPA_NEG_INF};
#pragma unroll
      for (int j = 0; j < KEYS / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) mx[e >> 1] = fmaxf(mx[e >> 1], s[m][j][e]);
      }
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        mx[hf] = fmaxf(mx[hf], __shfl_xor_sync(0xffffffffu, mx[hf], 1));
        mx[hf] = fmaxf(mx[hf], __shfl_xor_sync(0xffffffffu, mx[hf], 2));
        const int i = 2 * m + hf;
        const float n = fmaxf(row_max[i], mx[hf] * mul);
        // A row with no admitted key yet (max -inf before and after) has o == 0, sum == 0; its
        // exponent base is 0 so that masked scores (-inf) give exp2(-inf) = 0.
        c[m][hf] = row_max[i] == n ? 1.0f : ex2_approx(row_max[i] - n);
        row_max[i] = n;
      }
    }
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      float base[2], sum[2] = {0.0f, 0.0f};
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) base[hf] = row_max[2 * m + hf] == CUPA_NEG_INF ? 0.0f : row_max[2 * m + hf];
#pragma unroll
      for (int j = 0; j < KEYS / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          s[m][j][e] = ex2_approx(fmaf(s[m][j][e], mul, -base[e >> 1]));
          sum[e >> 1] += s[m][j][e];
        }
      }
      row_sum[2 * m] = row_sum[2 * m] * c[m][0] + sum[0];
      row_sum[2 * m + 1] = row_sum[2 * m + 1] * c[m][1] + sum[1];
    }
    bool rescale = false;
#pragma unroll
    for (int m = 0; m < MT; ++m) rescale = rescale || c[m][0] != 1.0f || c[m][1] != 1.0f;
    if (__any_sync(0xffffffffu, rescale)) {
#pragma unroll
      for (int m = 0; m < MT; ++m) {
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
          o[m][n][0] *= c[m][0];
          o[m][n][1] *= c[m][0];
          o[m][n][2] *= c[m][1];
          o[m][n][3] *= c[m][1];
        }
      }
    }

    // O += P V; each V fragment serves all MT tiles. (Masked keys were zero-filled and the V rows of
    // keys outside the CTA's intersection of ranges cleaned, above: P = 0 never meets Inf or NaN.)
#pragma unroll
    for (int j2 = 0; j2 < KEYS / 16; ++j2) {
      unsigned a[MT][4];
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        a[m][0] = Mma<T>::pack(s[m][2 * j2][0], s[m][2 * j2][1]);
        a[m][1] = Mma<T>::pack(s[m][2 * j2][2], s[m][2 * j2][3]);
        a[m][2] = Mma<T>::pack(s[m][2 * j2 + 1][0], s[m][2 * j2 + 1][1]);
        a[m][3] = Mma<T>::pack(s[m][2 * j2 + 1][2], s[m][2 * j2 + 1][3]);
      }
#pragma unroll
      for (int nn = 0; nn < D / 16; ++nn) {
        unsigned bv[4];
        ldsm_x4_trans(bv, step_addr(v_base, nn) + j2 * 16 * ROW_BYTES);
#pragma unroll
        for (int m = 0; m < MT; ++m) {
          Mma<T>::run(o[m][2 * nn], a[m], bv[0], bv[1]);
          Mma<T>::run(o[m][2 * nn + 1], a[m], bv[2], bv[3]);
        }
      }
    }
  }
  cp_async_wait<0>();

  // Epilogue: finalize this warp's rows into its own rows of sQ (as T), then store whole rows.
  // (Only this warp ever read those rows of sQ, so no CTA barrier is needed.)
  const bool has_sink = head_sink != nullptr;
#pragma unroll
  for (int i = 0; i < R; ++i) {
    row_sum[i] += __shfl_xor_sync(0xffffffffu, row_sum[i], 1);
    row_sum[i] += __shfl_xor_sync(0xffffffffu, row_sum[i], 2);
  }
#pragma unroll
  for (int m = 0; m < MT; ++m) {
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int i = 2 * m + hf;
      const int row = my_row(i);
      const bool live = sHi[row] > sLo[row];
      const float sink = has_sink ? Act<T>::to_float(head_sink[sHead[row]]) : 0.0f;
      // finalize() of a unit O is the row's factor (sink and 1/L; 0 without admitted keys), so
      // each channel costs one multiply instead of a division.
      // A row without admitted keys writes zeros, selected (its o may hold anything: interior tiles
      // are not masked for it).
      const float factor = live ? finalize(row_max[i] * CUPA_LN2, row_sum[i], 1.0f, has_sink, sink, 1.0f) : 0.0f;
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        const int d = n * 8 + (lane & 3) * 2;
        const float vs0 = v_quant ? quant_scale(v_scale, v_quant, g, D, d) : 1.0f;
        const float vs1 = v_quant ? quant_scale(v_scale, v_quant, g, D, d + 1) : 1.0f;
        const float x0 = live ? o[m][n][2 * hf] * factor * vs0 : 0.0f;
        const float x1 = live ? o[m][n][2 * hf + 1] * factor * vs1 : 0.0f;
        *reinterpret_cast<unsigned*>(sQ + swz<D>(row, d)) = Mma<T>::pack(x0, x1);
      }
    }
  }
  // The rows' log-sum-exp (when asked for), once the accumulators are in sQ: one lane of each quad.
  if (lse && (lane & 3) == 0) {
#pragma unroll
    for (int i = 0; i < R; ++i) {
      const int row = my_row(i);
      if (sTok[row] >= 0)
        lse[(long long)sTok[row] * H + sHead[row]] =
            sHi[row] > sLo[row] ? state_lse(row_max[i] * CUPA_LN2, row_sum[i]) : CUPA_NEG_INF;
    }
  }
  __syncwarp();
  for (int c = lane; c < WARP_ROWS * (D / 8); c += 32) {
    const int r = warp_row0 + c / (D / 8), col = (c % (D / 8)) * 8;
    const int tok = sTok[r];
    if (tok < 0) continue;
    *reinterpret_cast<uint4*>(out + ((long long)tok * H + sHead[r]) * D + col) =
        *reinterpret_cast<const uint4*>(sQ + swz<D>(r, col));
  }
}
