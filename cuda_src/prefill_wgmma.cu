// Paged prefill on Hopper warpgroup MMA (wgmma; sm_90a only): fp16/bf16 T, T caches, head_size 128.
// The same contract, launch and masking as paged_prefill (prefill.cu), with the two products on
// wgmma instead of mma.sync:
//   S = Q K^T   wgmma.m64n64k16, Q and K both from shared memory (K-major, 128B swizzle);
//   O += P V    wgmma.m64n128k16, P from registers (the S accumulator rounded to T: for 16-bit
//               types the f32 accumulator layout IS the A-fragment layout, no shuffles), V from
//               shared memory MN-major (imm-trans-b), so V needs no transpose anywhere.
// One CTA = 2 warpgroups (8 warps, 256 threads) owning ROWS = 128 query rows of ONE sequence b and
// ONE KV head g (row = j*G + gi, token-major, as prefill.cu); warpgroup u owns rows 64u..64u+63,
// warp w of it rows 16w..16w+15 of those, lane l rows l/4 and l/4 + 8 of the warp's 16. Both
// warpgroups see every key tile; no merge across warps is needed.
// Copies: every thread of the CTA (no producer warp, no TMA: a block size down to 1 means rows are
// gathered one by one through the block table) issues cp.async 16-byte copies of the K and V rows
// of the next tile straight into the swizzled layout wgmma reads (NST stages; masked rows zero-
// filled); row offsets are computed one tile ahead exactly as prefill.cu does. Before a barrier
// publishes a landed tile, each thread runs fence.proxy.async so that its generic-proxy writes are
// visible to wgmma's async-proxy reads.
// Masking, online softmax (log2 domain, ex2), softcap, sink, window, query_positions, contract §4.4
// rules, the tile numbering over a ragged batch, heaviest-first order and the zero pass are
// prefill.cu's, line for line; only the skip test is per warpgroup (wgmma is warpgroup-collective,
// so a skipped tile must be skipped by all four warps of a warpgroup) instead of per warp.
//
// Shared-memory layouts (all 16-bit, 128B swizzle, see wgmma.cuh for the descriptor fields):
// a [rows][128] tile (Q: rows = ROWS; K, V: rows = KEYS) is stored as two slabs [rows][64], slab h
// holding columns 64h..64h+63 at byte offset h*rows*128; inside a slab, element (r, c) sits at
// r*128 + ((c/8 ^ r%8) * 16) + (c%8)*2 (wg_off in wgmma.cuh). Every slab starts 1024-aligned.
//   Q (A of S, K-major): warpgroup u, k16 step kk: start = sQ + (kk/4)*ROWS*128 + u*64*128 +
//     (kk%4)*32, SBO = 1024 (next 8 rows), LBO unused.
//   K (B of S, K-major, N = 64 keys = 8 groups of 8 rows): start = sK + (kk/4)*KEYS*128 +
//     (kk%4)*32, SBO = 1024.
//   V (B of O, MN-major, N = 128 head channels = two 64-wide slabs, K = 16 keys per step j2):
//     start = sV + j2*16*128 (1024-aligned), LBO = KEYS*128 (slab 0 -> slab 1 along N),
//     SBO = 1024 (keys 0..7 -> keys 8..15 along K).
// (CUPA_WGMMA_PV_SPLIT_N=1 issues O += P V as two m64n64k16 per step, one per slab, so that LBO is
// never used: a switch to tell a wrong LBO from other faults on the device.)
#include "common.cuh"
#include "mma.cuh"
#include "paged.cuh"
#include "quant.cuh"  // CacheSame<T>
#include "softmax.cuh"
#include "prefill_tiles.cuh"
#include "wgmma.cuh"
#include "prefill_wgmma_tile.cuh"

#ifndef CUPA_WGMMA_PV_SPLIT_N
#define CUPA_WGMMA_PV_SPLIT_N 0
#endif

// Tile shape (mirrored in cupa/kernels/prefill_wgmma.py).
struct WgmmaPrefillConfig {
  static constexpr int D = 128;
  static constexpr int WGS = 2;               // consumer warpgroups per CTA
  static constexpr int ROWS = 64 * WGS;       // query rows per CTA
  static constexpr int THREADS = 128 * WGS;
  static constexpr int KEYS = 64;             // keys per shared-memory tile (the N of S)
  static constexpr int STAGES = 2;            // cp.async stages
  static constexpr int MIN_CTAS = 2;          // CTAs per SM (registers capped at 128 per thread)
};

struct WgmmaPrefillSmem {
  using Cfg = WgmmaPrefillConfig;
  static constexpr int D = Cfg::D, ROWS = Cfg::ROWS, KEYS = Cfg::KEYS, NST = Cfg::STAGES;
  static constexpr int q_bytes = ROWS * D * 2;                      // Q tile, then the output tile
  static constexpr int tile_bytes = KEYS * D * 2;                   // one K or V tile
  static constexpr int stage_bytes = 2 * tile_bytes;                // K then V
  static constexpr int rows_bytes = (NST + 1) * KEYS * 8;           // row byte offsets, one tile ahead
  static constexpr int bytes_bytes = (NST + 1) * KEYS * 4;          // copy sizes (16 or 0: masked)
  static constexpr int mapped_bytes = (NST + 1) * (KEYS / 32) * 4;  // mapped-key bit masks
  static constexpr int align_pad = 1024;  // the dynamic region is rounded up to a 1024-byte boundary
  static constexpr int total = q_bytes + NST * stage_bytes + rows_bytes + bytes_bytes + mapped_bytes + align_pad;
  static_assert(q_bytes % 1024 == 0 && tile_bytes % 1024 == 0, "swizzle atoms stay 1024-aligned");
  static_assert(total <= 227 * 1024, "an sm_90 CTA's dynamic shared memory");
};

template <typename T, typename Cache, int D>
__global__ void __launch_bounds__(WgmmaPrefillConfig::THREADS, WgmmaPrefillConfig::MIN_CTAS) paged_prefill_wgmma(
    const T* __restrict__ q,  // (N, H, D): prologue output, or `query` itself
    const T* __restrict__ key, const T* __restrict__ value,  // new K/V rows to read (NewKeys), or null
    const typename Cache::storage* __restrict__ key_cache, const typename Cache::storage* __restrict__ value_cache,
    const int* __restrict__ cum, const int* __restrict__ past, const int* __restrict__ block_table,
    const int* __restrict__ query_positions, const T* __restrict__ head_sink,
    const float* __restrict__ k_scale, const float* __restrict__ v_scale, T* __restrict__ out,
    int token_count, int num_heads, int kv_num_heads, int batch_size, int num_blocks, int block_size,
    int max_blocks, int zero_ctas, int num_tiles, int rotary_max_pos, float scale,
    float softcap, int window, int is_causal, int k_quant, int v_quant) {
  // (k_scale, v_scale, k_quant, v_quant: the argument list of paged_prefill; unused, T caches only.)
  using Cfg = WgmmaPrefillConfig;
  using L = WgmmaPrefillSmem;
  static_assert(D == Cfg::D, "head_size 128 only");
  static_assert(!Cache::quantized && sizeof(typename Cache::storage) == 2, "T caches only (16-bit)");
  constexpr int THREADS = Cfg::THREADS, WARPS = THREADS / 32, ROWS = Cfg::ROWS, KEYS = Cfg::KEYS, NST = Cfg::STAGES;
  constexpr int MASK_WORDS = KEYS / 32, LOC_WARPS = ROWS / 32;
  static_assert(KEYS % 32 == 0 && KEYS <= THREADS, "one thread per key row when finding rows");
  static_assert(ROWS <= THREADS && ROWS % 64 == 0, "one thread per query row when locating rows");
  static_assert(NST >= 2, "the loop waits for all but NST - 2 copy groups");

  // The prologue's writes (cache rows, Q workspace) are visible after grid_dependency_wait. Without
  // new-key inputs every CTA waits here; with them (NewKeys, prefill_tiles.cuh) CTA 0 does (so the
  // grid never completes ahead of the prologue: see common.cuh) and so does, further down, every
  // CTA that reads a cache row.
  const bool kv_new = key != nullptr;
  if (!kv_new || blockIdx.x == 0) grid_dependency_wait();
  if ((int)blockIdx.x < zero_ctas) {
    prefill_zero_pass<T, WARPS>(out, cum, batch_size, token_count, num_heads, D);
    return;
  }

  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024u - (smem_addr(smem_raw) & 1023u)) & 1023u);
  __shared__ int sTok[ROWS];  // packed token of each row, -1: not this CTA's row
  __shared__ int sHead[ROWS];  // query head of each row (g*G + row % G)
  __shared__ int sLo[ROWS], sHi[ROWS];  // admitted key range of each row (empty: zero output)
  __shared__ int4 sLocRange[LOC_WARPS];  // per locating warp (32 rows): union lo, hi, intersection lo, hi
  T* sQ = reinterpret_cast<T*>(smem);
  unsigned char* stages = smem + L::q_bytes;
  long long* sRows = reinterpret_cast<long long*>(stages + NST * L::stage_bytes);
  int* sBytes = reinterpret_cast<int*>(sRows + (NST + 1) * KEYS);
  unsigned* sMapped = reinterpret_cast<unsigned*>(sBytes + (NST + 1) * KEYS);
  const unsigned sQ_a = smem_addr(sQ), stages_a = smem_addr(stages);

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int wg = warp >> 2;  // this thread's warpgroup
  const int H = num_heads, Hk = kv_num_heads, G = H / Hk;
  const int cta = (int)blockIdx.x - zero_ctas;
  const int g = cta % Hk;
  const long long x = (long long)num_tiles - 1 - cta / Hk;  // heaviest tiles first

  // Which sequence and which of its row tiles (every warp computes the same, so exits are uniform).
  const int B = batch_size;
  RowTile rt;
  if (!locate_row_tile<ROWS>(cum, B, token_count, x, G, lane, rt)) return;
  const int b = rt.b;

  // Each row's token, ownership and admitted range (thread i: row i), as prefill.cu; each locating
  // warp also reduces its rows' union and intersection (over rows with a non-empty range).
  __shared__ NewKeys sNew;
  if (tid == 0) sNew = new_keys(kv_new, rt, __ldg(past + b), G);
  if (tid < ROWS) {
    int lo, hi;
    locate_tile_row(rt, tid, g, G, cum, past, B, query_positions, (long long)max_blocks * block_size,
                    rotary_max_pos, is_causal, window, sTok, sHead, sLo, sHi, lo, hi);
    const bool live = hi > lo;
    const int ulo = __reduce_min_sync(0xffffffffu, live ? lo : RANGE_NONE_LO);
    const int uhi = __reduce_max_sync(0xffffffffu, live ? hi : RANGE_NONE_HI);
    const int ilo = __reduce_max_sync(0xffffffffu, live ? lo : RANGE_NONE_HI);
    const int ihi = __reduce_min_sync(0xffffffffu, live ? hi : RANGE_NONE_LO);
    if (lane == 0) sLocRange[warp] = make_int4(ulo, uhi, ilo, ihi);
  }
  __syncthreads();
  int klo = RANGE_NONE_LO, khi = RANGE_NONE_HI;  // the union of the rows' ranges
#pragma unroll
  for (int w = 0; w < LOC_WARPS; ++w) {
    klo = min(klo, sLocRange[w].x);
    khi = max(khi, sLocRange[w].y);
  }
  const int ntiles = khi > klo ? (khi - klo + KEYS - 1) / KEYS : 0;
  // Every admitted key is one of the sequence's new tokens: K/V tiles come from key / value (NewKeys).
  const bool from_inputs = kv_new && ntiles > 0 && klo >= sNew.lo && khi <= sNew.hi;
  const int tok_shift = sNew.tok_shift;  // (a register: find_rows runs on the loop's critical path)
  // This warpgroup's 64 rows = locating warps 2*wg and 2*wg + 1: the union of their ranges (tiles
  // outside it are skipped by the whole warpgroup) and the intersection (tiles inside it, all keys
  // mapped, need no per-element mask). Uniform over the warpgroup, as wgmma requires.
  // Kept in shared memory and read at each tile (ordered by the loop's barrier): four registers
  // fewer across the key loop, where the two accumulators (96 registers) leave few to spare.
  __shared__ int4 sWgRange[Cfg::WGS];
  if (tid < Cfg::WGS) {
    const int4 r0 = sLocRange[2 * tid], r1 = sLocRange[2 * tid + 1];
    sWgRange[tid] = make_int4(min(r0.x, r1.x), max(r0.y, r1.y), max(r0.z, r1.z), min(r0.w, r1.w));
  }

  // Q rows, copied as they are with cp.async in the first copy group (with the first K/V tile);
  // rows without admitted keys are zero-filled. When no tile is loaded the epilogue writes zeros
  // without reading sQ.
  if (ntiles > 0) {
#pragma unroll
    for (int c = tid; c < ROWS * (D / 8); c += THREADS) {
      const int r = c / (D / 8), col = (c % (D / 8)) * 8;
      const bool live = sHi[r] > sLo[r];
      const T* src = live ? q + ((long long)sTok[r] * H + sHead[r]) * D + col : q;
      cp_async_16_or_zero(sQ_a + wg_off<ROWS>(r, col), src, live);
    }
  }

  const long long row_stride_bytes = (long long)Hk * D * 2;
  const long long head_bytes = (long long)g * D * 2;
  const FastDiv block_div(block_size);
  // Byte offsets of the rows of key tile `kt` into rows slot `rs` (0 for masked keys, whose copies
  // are zero-filled: sBytes 0), and the tile's mapped-key bit mask (as prefill.cu).
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
  // 16-byte chunk (column) of keys key0, key0 + KSTEP, ...; KSTEP is a multiple of 8, so every
  // one of its keys has the same key % 8 and its swizzled destination steps by KSTEP rows.
  constexpr int CHUNKS_PER_ROW = D * 2 / 16, KSTEP = THREADS / CHUNKS_PER_ROW;
  static_assert(THREADS % CHUNKS_PER_ROW == 0 && KEYS % KSTEP == 0 && KSTEP % 8 == 0, "whole copy rounds");
  const int copy_key0 = tid / CHUNKS_PER_ROW, copy_chunk = tid % CHUNKS_PER_ROW;
  const unsigned copy_dst = wg_off<KEYS>(copy_key0, copy_chunk * 8);
  const unsigned char* k_src =
      reinterpret_cast<const unsigned char*>(from_inputs ? (const void*)key : (const void*)key_cache) + copy_chunk * 16;
  const unsigned char* v_src = reinterpret_cast<const unsigned char*>(
                                   from_inputs ? (const void*)value : (const void*)value_cache) + copy_chunk * 16;
  auto load_tile = [&](int st, int rs) {
    const unsigned dK = stages_a + st * L::stage_bytes + copy_dst;
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
      cp_async_16_or_zero(dK + i * KSTEP * 128, k_src + off[i], n[i]);
      cp_async_16_or_zero(dK + L::tile_bytes + i * KSTEP * 128, v_src + off[i], n[i]);
    }
  };

#pragma unroll
  for (int s = 0; s < NST; ++s) find_rows(s, s);
  __syncthreads();  // row offsets of the first NST tiles
  if (kv_new && ntiles > 0 && !from_inputs) grid_dependency_wait();  // reads cache rows
#pragma unroll
  for (int s = 0; s < NST - 1; ++s) {
    if (s < ntiles) load_tile(s, s);
    cp_async_commit();
  }

  // This thread's two rows (of the CTA's ROWS): warp*16 + lane/4 and + 8 (warp = 4*wg + warp in wg).
  const int r0 = lane >> 2;
  auto my_row = [&](int i) { return warp * 16 + r0 + i * 8; };

  // Descriptors (see the layout notes at the top). Steps along K add (bytes >> 4) to the low field.
  const unsigned long long q_desc0 = wg_desc_sw128(sQ_a + wg * 64 * 128, 16, 1024);
  const unsigned long long kv_desc0 = wg_desc_sw128(stages_a, 16, 1024);  // + stage, + slab/step offsets
  const unsigned long long v_desc0 = wg_desc_sw128(stages_a + L::tile_bytes, KEYS * 128, 1024);
  auto qk_step = [](int kk, int rows) { return (unsigned long long)(((kk >> 2) * rows * 128 + (kk & 3) * 32) >> 4); };

  const WgScores sc(scale, softcap);
  float o[D / 2];  // O accumulator: o[4n + e] = O[row (e/2 ? +8)][8n + 2(lane%4) + e%2]
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] = 0.0f;
  float row_max[2], row_sum[2];  // online-softmax state (log2 domain); row_sum is this lane's share
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    row_max[i] = CUPA_NEG_INF;
    row_sum[i] = 0.0f;
  }

  int stage = 0, slot = 0;  // kt % NST, kt % (NST + 1)
  for (int kt = 0; kt < ntiles; ++kt, stage = stage + 1 == NST ? 0 : stage + 1, slot = slot == NST ? 0 : slot + 1) {
    cp_async_wait<NST - 2>();
    fence_proxy_async_shared();  // this thread's landed copies -> visible to wgmma (async proxy)
    __syncthreads();             // ... and to every thread; also: every wgmma of tile kt-1 is complete
    if (kt + NST - 1 < ntiles) load_tile(stage == 0 ? NST - 1 : stage - 1, slot <= 1 ? slot + NST - 1 : slot - 2);
    cp_async_commit();
    if (kt + NST < ntiles) find_rows(kt + NST, slot == 0 ? NST : slot - 1);  // read after the next barrier

    const int kt0 = klo + kt * KEYS;
    const int4 wr = sWgRange[wg];
    if (kt0 >= wr.y || kt0 + KEYS <= wr.x) continue;  // no row of this warpgroup admits these keys
    const unsigned* mapped = sMapped + slot * MASK_WORDS;
    unsigned mw[MASK_WORDS];
    bool all_mapped = true;
#pragma unroll
    for (int w = 0; w < MASK_WORDS; ++w) {
      mw[w] = mapped[w];
      all_mapped = all_mapped && mw[w] == 0xffffffffu;
    }
    const bool interior = all_mapped && kt0 >= wr.z && kt0 + KEYS <= wr.w;

    // S = Q K^T for this warpgroup's 64 rows and the tile's KEYS keys: 8 k16 steps over D = 128.
    const unsigned long long k_desc = kv_desc0 + (unsigned long long)((stage * L::stage_bytes) >> 4);
    float s[KEYS / 2];  // s[4j + e] = S[row (e/2 ? +8)][8j + 2(lane%4) + e%2]
#pragma unroll
    for (int i = 0; i < KEYS / 2; ++i) s[i] = 0.0f;
    // The zeros must be written BEFORE wgmma.fence (PTX ISA: a register access between the fence and
    // a wgmma that touches the same register is undefined); without this the compiler emitted the
    // zeroing movs after the fence. CUTLASS: warpgroup_fence_operand(accum); warpgroup_arrive().
    wg_fence_operands(s);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
      wgmma_ss_m64n64k16<T>(s, q_desc0 + qk_step(kk, ROWS), k_desc + qk_step(kk, KEYS), 1);
    wgmma_commit();
    wgmma_wait<0>();
    wg_fence_operands(s);

    unsigned p[KEYS / 16][4];
    wg_softmax_tile<T, KEYS, D>(s, o, p, row_max, row_sum, mw, interior, kt0, sLo, sHi, my_row(0), lane, sc);
    // O += P V: V's k16 step j2 = keys 16*j2.. = rows 16*j2.. of the V tile = +2048 bytes each.
    const unsigned long long v_desc = v_desc0 + (unsigned long long)((stage * L::stage_bytes) >> 4);
    // As for S: the rescaled o and the packed p are complete before wgmma.fence.
    wg_fence_operands(o);
#pragma unroll
    for (int j2 = 0; j2 < KEYS / 16; ++j2) wg_fence_operands(p[j2]);
    wgmma_fence();
#pragma unroll
    for (int j2 = 0; j2 < KEYS / 16; ++j2) {
      if constexpr (CUPA_WGMMA_PV_SPLIT_N) {
        float(&o0)[D / 4] = *reinterpret_cast<float(*)[D / 4]>(&o[0]);
        float(&o1)[D / 4] = *reinterpret_cast<float(*)[D / 4]>(&o[D / 4]);
        wgmma_rs_m64n64k16_tb<T>(o0, p[j2], v_desc + (unsigned long long)((j2 * 16 * 128) >> 4), 1);
        wgmma_rs_m64n64k16_tb<T>(o1, p[j2], v_desc + (unsigned long long)((KEYS * 128 + j2 * 16 * 128) >> 4), 1);
      } else {
        wgmma_rs_m64n128k16_tb<T>(o, p[j2], v_desc + (unsigned long long)((j2 * 16 * 128) >> 4), 1);
      }
    }
    wgmma_commit();
    wgmma_wait<0>();
    wg_fence_operands(o);
  }
  cp_async_wait<0>();
  __syncthreads();  // every warpgroup's last wgmma (reading sQ) is complete before sQ is rewritten

  // Epilogue: finalize this warp's rows into its own rows of sQ (as T), then store whole rows.
  wg_store_rows<T, ROWS, D>(o, row_max, row_sum, warp * 16, lane, reinterpret_cast<unsigned char*>(sQ), sLo, sHi, sHead,
                            sTok, head_sink, out, H);
}
