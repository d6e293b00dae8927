// Paged prefill on Hopper, warp-specialized and persistent (sm_90a only): fp16/bf16 T, caches of T or of
// 8-bit codes (int8, fp8 e4m3: both caches one kind), head_size 128. The contract, row tiles (ROWS = 128
// (new token, query head) rows of one sequence and one KV head, token-major), tile numbering over a ragged
// batch, zero pass and contract §4.4 rules of paged_prefill (prefill.cu, prefill_tiles.cuh), with both
// products on wgmma. Reads: Q (the prologue's workspace or `query`), the caches through the block table (or
// new K/V from key / value: NewKeys), cum / past_seqlens / query_positions, head_sink, the scales of 8-bit
// caches. Writes: `out`, and `lse` when asked for (non-null: each row's log-sum-exp in the epilogue, -inf
// for unowned tokens in the zero pass; no other pass over the keys). Host values that size the launch:
// token_count, batch_size, head counts (num_tiles, tiles_per_seq, zero_ctas) and the CTA count (at most one
// per SM); none enters a mask.
//
// One CTA per SM (512 threads, ~200 KB of shared memory) loops over the work items (row tile x, KV
// head g; numbered heaviest first as the one-CTA-per-item kernels number their CTAs), round r taking
// item r * CTAs + c, or r * CTAs + CTAs - 1 - c in odd rounds (a snake, so that every CTA's items add
// up to about the same work), with four warpgroups:
//   copier (warps 0-3, 64 registers after setmaxnreg): fills each item's K and V tiles of KEYS =
//     128 keys row by row through the block table (any block_size) into a 2-stage ring, in the
//     128B-swizzled layout wgmma reads: warp w handles keys 32w..32w+31, lane l finds the row of key
//     32w + l one tile ahead (its block-table read in flight during the current copies) and puts it
//     in shared memory; then lane 0 issues TMA boxes of consecutive rows (tma_box cache rows of one
//     block, or 32 new rows of key / value; tensor maps from the host, 128B swizzle), or, where a box
//     would mix masked and unmasked keys or TMA does not apply, each round the warp copies 2 keys x 16
//     chunks of 16 bytes (cp.async). 8-bit codes: a row is 128 bytes, one row of slab 1 of the tile
//     (TMA boxes of 128 codes, or 4 keys x 8 chunks a round); once its rows of a tile have landed (its
//     own mbarrier, land), the warp widens them in place to T (exactly), cleaning NaN codes in V tiles
//     with keys to clean, and completes k_full / v_full itself.
//   scheduler (warps 4-7, 48 registers): for each item, finds its sequence and the admitted key range
//     of each of its 128 rows (thread r: row r), publishes them (WsItem for the copiers; the row data
//     and the Q rows, cp.async into one of two Q buffers, for the consumers) as soon as the consumers
//     give the buffer back, so the next item is ready before the current one ends; then (T caches)
//     cleans the V tiles of the current item that hold keys some live row does not admit (clean_item).
//   two consumers (warps 8-11 and 12-15, 200 registers): warpgroup u owns rows 64u..64u+63 of the
//     item. Per key tile: S = Q K^T on wgmma.m64n128k16 (Q and K from shared memory), online
//     softmax in registers, O += P V on wgmma.m64n128k16 (P from registers, V MN-major). Tile kt+1's
//     S and tile kt's P V are issued together ("turn", two commit groups: the K stage is released
//     when S is complete, before P V is), and the two warpgroups take turns in
//     strict alternation (named barriers 1 and 2: FA3's ping-pong), so one warpgroup's softmax runs
//     while the other's products keep the tensor cores busy. The epilogue writes each warp's 16 rows
//     through its own rows of the item's Q buffer, then gives the buffer back to the scheduler.
// Full / empty mbarriers per Q buffer (the Q rows and row data for the consumers, the WsItem for the
// copiers) and per stage (K and V apart) replace the per-tile CTA barrier. A key a row does not admit
// never reaches its output: masked scores are selected to -inf, V rows that meet P = 0 in a tile are
// cleaned of Inf / NaN before the product (by the scheduler, between v_land and v_full: clean_item; for
// 8-bit codes by the copiers as they widen), and rows without admitted keys write zeros. Scales of 8-bit
// caches: K's per tensor in the score scale, per channel in Q's rows (the scheduler scales them in shared
// memory once they land), V's in the epilogue.
// Ordering: TMA writes complete the full barriers' tx bytes (expect_tx by the issuing lane first);
// q_full, k_full and v_full count two arrivals a thread: a thread that copied with cp.async arrives
// once when its copies land (cp.async.mbarrier.arrive.noinc) and once itself, any other thread twice
// at once; the consumers run
// fence.proxy.async after each wait, before wgmma reads the data (async proxy); a
// consumer releases a stage after wgmma.wait_group, whose completion orders its reads before the
// copier's next writes (wgmma.cuh). Every wgmma is issued unconditionally (see the consumer loop).
// Its times on the H200 are in docs/performance.md.
#include "common.cuh"
#include "mma.cuh"
#include "paged.cuh"
#include "quant.cuh"  // CacheSame<T>
#include "softmax.cuh"
#include "prefill_tiles.cuh"
#include "wgmma.cuh"
#include "prefill_wgmma_tile.cuh"
#include "prefill_ws_plan.cuh"

// Tile shape (mirrored in cupa/kernels/prefill_wgmma.py: WS_*).
struct WsPrefillConfig {
  static constexpr int D = 128;
  static constexpr int CONSUMERS = 2;                   // consumer warpgroups
  static constexpr int ROWS = 64 * CONSUMERS;           // query rows per work item
  static constexpr int COPIER_THREADS = 128;            // warpgroup 0: K/V gathers
  static constexpr int SCHEDULER_THREADS = 128;         // warpgroup 1: items' rows and Q
  static constexpr int PRODUCER_THREADS = COPIER_THREADS + SCHEDULER_THREADS;
  static constexpr int CONSUMER_THREADS = 128 * CONSUMERS;
  static constexpr int THREADS = PRODUCER_THREADS + CONSUMER_THREADS;
  static constexpr int KEYS = 128;                      // keys per K / V tile (the N of S)
  static constexpr int STAGES = 2;                      // K/V ring (3 stages of 128 keys exceed shared memory)
  static constexpr int QBUFS = 2;                       // Q buffers (item i + 1 loads while i runs)
  // setmaxnreg: the copier needs 64 (40 spilled its loop, 3-4% slower), the scheduler fits 48, and
  // the consumers take the rest.
  static constexpr int COPIER_REGS = 64, SCHEDULER_REGS = 48, CONSUMER_REGS = 200;
};
static_assert(WsPrefillConfig::COPIER_REGS * WsPrefillConfig::COPIER_THREADS +
                      WsPrefillConfig::SCHEDULER_REGS * WsPrefillConfig::SCHEDULER_THREADS +
                      WsPrefillConfig::CONSUMER_REGS * WsPrefillConfig::CONSUMER_THREADS <= 65536,
              "one CTA per SM: the register file");

struct WsPrefillSmem {
  using Cfg = WsPrefillConfig;
  static constexpr int q_bytes = Cfg::ROWS * Cfg::D * 2;   // one Q buffer (then the item's output)
  static constexpr int tile_bytes = Cfg::KEYS * Cfg::D * 2;  // one K or V tile
  static constexpr int stage_bytes = 2 * tile_bytes;         // K then V
  static constexpr int align_pad = 1024;  // the dynamic region is rounded up to a 1024-byte boundary
  static constexpr int total = Cfg::QBUFS * q_bytes + Cfg::STAGES * stage_bytes + align_pad;
  static_assert(q_bytes % 1024 == 0 && tile_bytes % 1024 == 0, "swizzle atoms stay 1024-aligned");
};

// What the scheduler publishes about a work item (with its Q rows): the keys it covers, where they
// come from, and per consumer warpgroup the intersection [x, y) of its rows' admitted ranges (a tile
// inside it with every key mapped needs no per-element mask).
struct WsItem {
  int klo, khi, ntiles;  // key tiles klo + kt * KEYS, kt < ntiles (keys >= khi masked); ntiles < 0: no more items
  int kmin;              // keys < kmin masked (klo: kmin rounded down to a whole TMA box of cache rows)
  int b, g;              // sequence, KV head
  int from_inputs, tok_shift;  // new K/V rows read from key / value (NewKeys)
  int2 wg[WsPrefillConfig::CONSUMERS];
  int2 all;              // the intersection over every live row of the item (V rows outside it are cleaned)
  int2 clean;            // tiles kt < clean.x and kt >= clean.y have V rows to clean (ws_clean_tiles)
  unsigned first_tile;   // K/V tiles of the CTA's items before this one (its tile kt is in stage (first_tile + kt) % 2)
  unsigned land_parity;  // bit s: parity of the v_land(s) phase of this item's first tile to clean in stage s
};

// Named barriers (0 is __syncthreads): the consumers' turns, each consumer warpgroup's own, the scheduler's.
constexpr int WS_BAR_TURN = 1, WS_BAR_WG = 3, WS_BAR_SCHEDULER = 5;

// COPIER_CLEAN (T caches; Options._tuning.prefill_ws_copier_clean): V tiles with keys to clean are cleaned by
// the copier warps, each its own rows once they land (as it widens 8-bit codes), instead of by the scheduler;
// setmaxnreg then gives the copier 72 registers and the scheduler 40.
template <typename T, typename Cache, int D, bool COPIER_CLEAN = false>
__global__ void __launch_bounds__(WsPrefillConfig::THREADS, 1) paged_prefill_wgmma_ws(
    const T* __restrict__ q,  // (N, H, D): prologue output, or `query` itself
    const T* __restrict__ key, const T* __restrict__ value,  // new K/V rows to read (NewKeys), or null
    const typename Cache::storage* __restrict__ key_cache, const typename Cache::storage* __restrict__ value_cache,
    const int* __restrict__ cum, const int* __restrict__ past, const int* __restrict__ block_table,
    const int* __restrict__ query_positions, const T* __restrict__ head_sink,
    const float* __restrict__ k_scale, const float* __restrict__ v_scale, T* __restrict__ out,
    float* __restrict__ lse, int token_count, int num_heads, int kv_num_heads, int batch_size, int num_blocks,
    int block_size, int max_blocks, int zero_ctas, int num_tiles, int rotary_max_pos, float scale,
    float softcap, int window, int is_causal, int k_quant, int v_quant,
    // TMA: tensor maps of key_cache / value_cache as (D, Hk, slots) and of key / value as (D, Hk, tokens),
    // boxes of 64 x 1 x tma_box rows (cache; 8-bit codes: 128 x 1 x tma_box) or 64 x 1 x 32 (inputs), 128B
    // swizzle. tma_box: 0 (cache rows by cp.async only) or 8, 16, 32 dividing block_size (box destinations,
    // box-aligned 128-byte rows, then stay 1024-byte aligned as the swizzle needs); tma_inputs 0: key /
    // value rows by cp.async only.
    const __grid_constant__ TmaMap tm_kc, const __grid_constant__ TmaMap tm_vc, const __grid_constant__ TmaMap tm_k,
    const __grid_constant__ TmaMap tm_v, int tma_box, int tma_inputs,
    // row tiles: num_tiles in the numbering of paged_prefill (0), or at most tiles_per_seq a sequence
    int tiles_per_seq) {
  using Cfg = WsPrefillConfig;
  using L = WsPrefillSmem;
  static_assert(D == Cfg::D, "head_size 128 only");
  // 8-bit caches (int8, fp8 e4m3): a tile's codes land in slab 1 of its 16-bit stage tile (128 bytes a
  // row, as one slab row) and each copier warp widens its own rows there, exactly; K's per-tensor scale
  // joins the score scale and its per-channel scale Q's rows, V's scale is applied in the epilogue (as in
  // paged_prefill; k_scale, v_scale, k_quant, v_quant are unused for T caches).
  constexpr bool QUANT = Cache::quantized;
  static_assert(QUANT ? Cache::PACK == 1 && sizeof(typename Cache::storage) == 1 : sizeof(typename Cache::storage) == 2,
                "T caches or 8-bit codes");
  constexpr int CB = sizeof(typename Cache::storage);  // bytes a cache element
  constexpr bool CCLEAN = !QUANT && COPIER_CLEAN;       // T caches: the copiers clean V tiles
  constexpr bool OWN_LAND = QUANT || CCLEAN;            // copier warps wait for their own rows (land)
  constexpr int ROWS = Cfg::ROWS, KEYS = Cfg::KEYS, NST = Cfg::STAGES, NQ = Cfg::QBUFS;
  constexpr int PT = Cfg::PRODUCER_THREADS, CT = Cfg::CONSUMER_THREADS;
  constexpr int CPT = Cfg::COPIER_THREADS, ST = Cfg::SCHEDULER_THREADS;
  constexpr int KC = KEYS / (CPT / 32);  // keys of a tile per copier warp
  static_assert(KEYS == 128 && KC == 32 && ROWS == ST && NQ == 2, "copier lane l: key l of its warp's 32; scheduler thread i: row i");
  static_assert(NST == 2, "ws_stage_parity: two stages");

  // As paged_prefill: without new-key inputs every CTA waits for the prologue here; with them CTA 0
  // does, and a copier warp before its first cache read.
  const bool kv_new = !QUANT && key != nullptr;  // (a quantized cache never gets them)
  if (!kv_new || blockIdx.x == 0) grid_dependency_wait();
  if ((int)blockIdx.x < zero_ctas) {
    prefill_zero_pass<T, Cfg::THREADS / 32>(out, cum, batch_size, token_count, num_heads, D, lse);
    return;
  }

  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024u - (smem_addr(smem_raw) & 1023u)) & 1023u);
  __shared__ int sTok[NQ][ROWS];   // per Q buffer: packed token of each row, -1: not the item's row
  __shared__ int sHead[NQ][ROWS];  // query head of each row
  __shared__ int sLo[NQ][ROWS], sHi[NQ][ROWS];  // admitted key range of each row (empty: zero output)
  __shared__ int4 sLocRange[NQ][ROWS / 32];     // per 32 rows (scheduler warp): union lo, hi, intersection lo, hi
  __shared__ WsItem sItem[NQ];
  __shared__ unsigned sMapped[NST][KEYS / 32];  // per stage: mapped-key bit mask of its K/V tile
  __shared__ __align__(16) int sRows[Cfg::COPIER_THREADS / 32][2][16];  // per copier warp: rows of its keys (this tile)
  __shared__ __align__(8) unsigned long long sBar[4 * NQ + 5 * NST + (OWN_LAND ? 2 * NST * (CPT / 32) : 0)];
  const unsigned q_a = smem_addr(smem), stages_a = q_a + NQ * L::q_bytes;
  const unsigned bar_a = smem_addr(sBar);
  // mbarriers: q_full / q_empty / info_full / info_empty per Q buffer, k_full / v_full / k_empty / v_empty
  // / v_land per stage. info_empty: every copier thread has read the item's WsItem, so the scheduler may
  // rewrite it (the consumers' q_empty does not say so: they never wait for the copiers on an item without
  // tiles). v_land: a V tile with keys to clean (ws_clean_keys) lands there instead of on v_full; the
  // scheduler cleans it and completes v_full itself. 8-bit caches: each copier warp's rows of a K or V tile
  // land on its own barrier (land), and the warp completes k_full / v_full once it has widened them.
  auto q_full = [&](int i) { return bar_a + 8u * i; };
  auto q_empty = [&](int i) { return bar_a + 8u * (NQ + i); };
  auto info_full = [&](int i) { return bar_a + 8u * (2 * NQ + i); };  // the item's WsItem, for the copiers
  auto info_empty = [&](int i) { return bar_a + 8u * (3 * NQ + i); };
  auto k_full = [&](int s) { return bar_a + 8u * (4 * NQ + s); };
  auto v_full = [&](int s) { return bar_a + 8u * (4 * NQ + NST + s); };
  auto k_empty = [&](int s) { return bar_a + 8u * (4 * NQ + 2 * NST + s); };
  auto v_empty = [&](int s) { return bar_a + 8u * (4 * NQ + 3 * NST + s); };
  auto v_land = [&](int s) { return bar_a + 8u * (4 * NQ + 4 * NST + s); };  // V tiles to clean: landed
  // 8-bit codes of copier warp w's rows of the K (v = 0) or V (v = 1) tile in stage s: landed
  auto land = [&](int s, int v, int w) { return bar_a + 8u * (4 * NQ + 5 * NST + (2 * s + v) * (CPT / 32) + w); };

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  // (COPIER_CLEAN: the copiers read their lane from %laneid, so that no value lives across every role's
  // registers; ptxas spilled tid % 32 there otherwise)
  auto copier_lane = [&] {
    if constexpr (CCLEAN) {
      unsigned l;
      asm volatile("mov.u32 %0, %%laneid;\n" : "=r"(l));
      return (int)l;
    } else {
      return lane;
    }
  };
  if (tid == 0) {
    for (int i = 0; i < NQ; ++i) {
      mbar_init(q_full(i), 2 * ST);  // two arrivals a thread (see Ordering)
      mbar_init(q_empty(i), CT);
      mbar_init(info_full(i), 1);
      mbar_init(info_empty(i), CPT);
    }
    for (int s = 0; s < NST; ++s) {
      mbar_init(k_full(s), 2 * CPT);
      mbar_init(v_full(s), 2 * CPT);
      mbar_init(v_land(s), 2 * CPT);
      for (int w = 0; OWN_LAND && w < CPT / 32; ++w) {
        mbar_init(land(s, 0, w), 64);  // (two arrivals a lane)
        mbar_init(land(s, 1, w), 64);
      }
      mbar_init(k_empty(s), CT);
      mbar_init(v_empty(s), CT);
    }
    mbar_init_fence();
  }
  __syncthreads();  // the last CTA-wide barrier: from here on the warpgroups meet only at mbarriers

  const int H = num_heads, Hk = kv_num_heads, G = H / Hk, B = batch_size;
  const int first = (int)blockIdx.x - zero_ctas, step = (int)gridDim.x - zero_ctas;

  if (warp < PT / 32) {
    if (warp >= CPT / 32) {
      setmaxnreg_dec<CCLEAN ? Cfg::SCHEDULER_REGS - 8 : Cfg::SCHEDULER_REGS>();
      // ---------------------------------------------------------------- scheduler warpgroup
      // Thread i: row i of each item.
      const int sw = warp - CPT / 32, stid = tid - CPT;
      const long long kv_capacity = (long long)max_blocks * block_size;
      unsigned n = 0;  // items published
      // After publishing item n + 1, the scheduler cleans item n's V tiles with keys to clean (V rows of
      // keys some live row does not admit meet P = 0 there, and 0 times an Inf or NaN V element is NaN
      // in O += P V): each lands on v_land; the warpgroup replaces the non-finite values of those rows by
      // 0 in shared memory (for a row that admits the key the result is unspecified anyway), runs
      // fence.proxy.async (its writes before wgmma's reads) and completes v_full for the consumers. The
      // consumers cannot release such a stage before v_full, so v_land's phases stay in step; the
      // copier fills the next items meanwhile, and publishing item n + 2 waits for the consumers to end
      // item n in any case.
      auto clean_item = [&](int ib) {
        const int nt = sItem[ib].ntiles, klo = sItem[ib].klo, kmin = sItem[ib].kmin, khi = sItem[ib].khi;
        const int2 in = sItem[ib].all, cl = sItem[ib].clean;
        const unsigned first_tile = sItem[ib].first_tile;
        unsigned land_parity = sItem[ib].land_parity;
        auto clean_tile = [&](int kt) {
          const int kt0 = klo + kt * KEYS;
          int a, hi1, lo2, b;
          ws_clean_keys<KEYS>(kt0, in, kmin, khi, a, hi1, lo2, b);  // (true here: ws_clean_tiles)
          const int st = (int)((first_tile + kt) % NST);
          mbar_wait(v_land(st), (land_parity >> st) & 1u);
          land_parity ^= 1u << st;
          const int n1 = max(0, hi1 - a), n2 = max(0, b - lo2);  // keys [a, hi1) and [lo2, b)
          // (shared-space addresses: the loop runs in the scheduler's 48 registers)
          const unsigned v_tile = stages_a + (unsigned)st * L::stage_bytes + L::tile_bytes;
#pragma unroll 2
          for (int i = stid; i < (n1 + n2) * 16; i += ST) {
            const int r = i >> 4, c = i & 15;  // 16-byte chunk c of key row r of the two ranges
            const int k = r < n1 ? a + r : lo2 + (r - n1);
            const unsigned at = v_tile + (unsigned)((c >> 3) * (KEYS * 128) + (k - kt0) * 128 + (c & 7) * 16);
            unsigned w[4];
            lds128(at, w);
            const unsigned f0 = finite_or_zero2<T>(w[0]), f1 = finite_or_zero2<T>(w[1]), f2 = finite_or_zero2<T>(w[2]),
                           f3 = finite_or_zero2<T>(w[3]);
            if (f0 != w[0] || f1 != w[1] || f2 != w[2] || f3 != w[3]) sts128(at, f0, f1, f2, f3);
          }
          fence_proxy_async_shared();
          mbar_arrive2(v_full(st));
        };
        for (int kt = 0; kt < min(cl.x, nt); ++kt) clean_tile(kt);  // in order: the tiles below cl.x,
        for (int kt = max(cl.x, cl.y); kt < nt; ++kt) clean_tile(kt);  // then those from cl.y on
      };
      // Work item of round r: r * step + first, or r * step + step - 1 - first in odd rounds (a snake:
      // items come heaviest first, so plain round robin would hand CTA 0 the heaviest item of every
      // round; snaking evens the CTAs' sums).
      // (32-bit: the host sends at most 2^30 items, prefill_wgmma.py MAX_ITEMS)
      for (int r = 0;; ++r) {
        const int w = r * step + ((r & 1) ? step - 1 - first : first);
        const bool more = w < num_tiles * Hk;
        int g = 0;
        RowTile rt;
        if (more) {
          g = w % Hk;
          // (every scheduler warp computes the same, so the skip is uniform)
          const int x = num_tiles - 1 - w / Hk;
          if (!(tiles_per_seq > 0 ? locate_bounded_tile<ROWS>(cum, B, token_count, x, tiles_per_seq, G, rt)
                                  : locate_row_tile<ROWS>(cum, B, token_count, x, G, lane, rt)))
            continue;
        }
        const int buf = n & 1;
        if (n >= NQ) {
          mbar_wait(q_empty(buf), ((n >> 1) + 1) & 1);     // the consumers are done with item n - 2
          mbar_wait(info_empty(buf), ((n >> 1) + 1) & 1);  // and so are the copiers (at once, but for
        }                                                   // items without tiles)
        if (!more) {  // no more items: tell the consumers and the copiers, and clean the last item
          if (stid == 0) {
            sItem[buf].ntiles = -1;
            mbar_arrive(info_full(buf));
          }
          mbar_arrive2(q_full(buf));
          if (!OWN_LAND && n > 0) {
            bar_sync(WS_BAR_SCHEDULER, ST);  // (stid 0's writes of that WsItem, before its last arrival)
            clean_item(buf ^ 1);
          }
          break;
        }
#pragma unroll
        for (int rr = 0; rr < ROWS / ST; ++rr) {
          int lo, hi;
          locate_tile_row(rt, stid + rr * ST, g, G, cum, past, B, query_positions, kv_capacity, rotary_max_pos,
                          is_causal, window, sTok[buf], sHead[buf], sLo[buf], sHi[buf], lo, hi);
          const bool live = hi > lo;
          const int ulo = __reduce_min_sync(0xffffffffu, live ? lo : RANGE_NONE_LO);
          const int uhi = __reduce_max_sync(0xffffffffu, live ? hi : RANGE_NONE_HI);
          const int ilo = __reduce_max_sync(0xffffffffu, live ? lo : RANGE_NONE_HI);
          const int ihi = __reduce_min_sync(0xffffffffu, live ? hi : RANGE_NONE_LO);
          if (lane == 0) sLocRange[buf][sw + rr * (ST / 32)] = make_int4(ulo, uhi, ilo, ihi);  // rows 32 sw..
        }
        bar_sync(WS_BAR_SCHEDULER, ST);  // every row of the item located
        int klo = RANGE_NONE_LO, khi = RANGE_NONE_HI;
#pragma unroll
        for (int i = 0; i < ROWS / 32; ++i) {
          klo = min(klo, sLocRange[buf][i].x);
          khi = max(khi, sLocRange[buf][i].y);
        }
        const bool any_keys = khi > klo;
        if (stid == 0) {
          const NewKeys nk = new_keys(kv_new, rt, __ldg(past + rt.b), G);
          WsItem item;
          item.from_inputs = kv_new && any_keys && klo >= nk.lo && khi <= nk.hi;
          // Cache rows by TMA: tiles start on a box boundary, so each box of tma_box keys lies in one block.
          const int origin = any_keys && !item.from_inputs && tma_box > 0 ? klo - klo % tma_box : klo;
          item.klo = origin;
          item.kmin = klo;
          item.khi = khi;
          item.ntiles = any_keys ? (khi - origin + KEYS - 1) / KEYS : 0;
          item.b = rt.b;
          item.g = g;
          item.tok_shift = nk.tok_shift;
#pragma unroll
          for (int u = 0; u < Cfg::CONSUMERS; ++u) {
            const int4 r0 = sLocRange[buf][2 * u], r1 = sLocRange[buf][2 * u + 1];
            item.wg[u] = make_int2(max(r0.z, r1.z), min(r0.w, r1.w));
          }
          item.all = make_int2(max(item.wg[0].x, item.wg[1].x), min(item.wg[0].y, item.wg[1].y));
          item.clean = ws_clean_tiles<KEYS>(item.klo, item.kmin, item.khi, item.all, item.ntiles);
          if (n == 0) {
            item.first_tile = item.land_parity = 0u;
          } else {  // (item n - 1 stays in the other buffer until item n + 1 is published)
            const WsItem& prev = sItem[buf ^ 1];
            item.first_tile = prev.first_tile + (unsigned)prev.ntiles;
            item.land_parity = ws_land_after(prev.first_tile, prev.ntiles, prev.clean, prev.land_parity);
          }
          sItem[buf] = item;
          mbar_arrive(info_full(buf));  // the copiers may start on the item's keys
        }
        // Q rows, as they are (rows without admitted keys zero-filled); none when no key tile follows.
        // With a per-channel K scale (8-bit caches) the scale is folded in once they have landed.
        if (any_keys) {
          const unsigned dq = q_a + buf * L::q_bytes;
#pragma unroll 1
          for (int c = stid; c < ROWS * (D / 8); c += ST) {
            const int r = c / (D / 8), col = (c % (D / 8)) * 8;
            const bool live = sHi[buf][r] > sLo[buf][r];
            const T* src = live ? q + ((long long)sTok[buf][r] * H + sHead[buf][r]) * D + col : q;
            cp_async_16_or_zero(dq + wg_off<ROWS>(r, col), src, live);
          }
          if (QUANT && k_quant == QUANT_PER_CHANNEL) {
            // Once the thread's chunks have landed (all of channels col..col + 7: ST is a multiple of D / 8),
            // each is multiplied by the scales in float and rounded to T once, in place.
            static_assert(ST % (D / 8) == 0, "one column of chunks a thread");
            const int col = (stid % (D / 8)) * 8;
            float ks[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) ks[i] = __ldg(k_scale + g * D + col + i);
            cp_async_wait<0>();
#pragma unroll 2
            for (int c = stid; c < ROWS * (D / 8); c += ST) {
              const unsigned at = dq + wg_off<ROWS>(c / (D / 8), col);
              unsigned w[4];
              lds128(at, w);
              unsigned x[4];
#pragma unroll
              for (int e = 0; e < 4; ++e) {
                const T* h = reinterpret_cast<const T*>(&w[e]);
                x[e] = Mma<T>::pack(Act<T>::to_float(h[0]) * ks[2 * e], Act<T>::to_float(h[1]) * ks[2 * e + 1]);
              }
              sts128(at, x[0], x[1], x[2], x[3]);
            }
            fence_proxy_async_shared();  // (these writes before wgmma's reads)
          }
        }
        mbar_arrive_on_cp_async(q_full(buf));  // when the thread's Q rows land
        mbar_arrive(q_full(buf));  // also publishes sTok.. sHi and sItem (release)
        if (!OWN_LAND && n > 0) clean_item(buf ^ 1);  // item n - 1 (its WsItem stays until item n + 1 is published)
        ++n;
      }
    } else {
      // ------------------------------------------------------------------ copier warps
      setmaxnreg_dec<CCLEAN ? Cfg::COPIER_REGS + 8 : Cfg::COPIER_REGS>();
      const int lane = copier_lane();
      // Copier warp cw fills keys 32cw..32cw+31 of each tile; lane l finds the row of key 32cw + l (one
      // tile ahead). Where each box of `box` consecutive keys (tma_box of a block, or all 32 new
      // tokens) is either wholly mapped -- consecutive rows -- or wholly masked, the warp's rows come
      // by TMA: lane 0 loads both halves (64 columns each) of every box, a masked box from a row past
      // the tensor (zeros). Otherwise (a box straddling kmin or khi, block sizes TMA does not tile,
      // TMA off) each round copies 2 keys (lanes 0-15: key 2i, 16-31: key 2i + 1 of the warp's 32),
      // chunk l % 16 each, by cp.async (masked keys zero-filled).
      const int cw = warp;
      const long long row_stride_bytes = (long long)Hk * D * CB;
      const FastDiv block_div(block_size);
      if (lane == 0 && cw == 0) {
        if (tma_box > 0) {
          tma_prefetch_map(&tm_kc);
          tma_prefetch_map(&tm_vc);
        }
        if (tma_inputs) {
          tma_prefetch_map(&tm_k);
          tma_prefetch_map(&tm_v);
        }
      }
      // Key 2i + h of the warp lands at row 32cw + 2i + h, chunk c = lane % 16: byte (c / 8) KEYS 128 +
      // row 128 + ((c % 8) ^ (row % 8)) 16 (wg_off), whose swizzle term repeats every 4 rounds.
      const int h = lane >> 4, c = lane & 15;
      const unsigned copy_base = (unsigned)((c >> 3) * (KEYS * 128) + (cw * KC + h) * 128);
      // ((c % 8) ^ ((2i + h) % 8)) 16 for i % 4 = j is swz0 ^ 32 j (2j + h < 8, h one bit): one register.
      const unsigned swz0 = (unsigned)(((c & 7) ^ h) << 4);
      // 8-bit codes: rows of 128 bytes into slab 1, each round 4 keys (lane (q4, c8): key 4i + q4 of the
      // warp's 32, chunk c8, at ws_code_chunk).
      const int q4 = lane >> 3, c8 = lane & 7;
      unsigned it = 0;  // K/V tiles issued, over all items
      for (unsigned n = 0;; ++n) {
        const int buf = n & 1;
        // Item n - 1's WsItem is read (by this thread): the scheduler may rewrite it. (Arriving here rather
        // than after the item's tiles keeps a register free in the tile loop.)
        if (n > 0) mbar_arrive(info_empty(buf ^ 1));
        mbar_wait(info_full(buf), (n >> 1) & 1);
        const int ntiles = sItem[buf].ntiles;
        if (ntiles < 0) break;
        const WsItem& item = sItem[buf];
        // An item reading cache rows the prologue writes waits for it (at once when it has completed: no
        // register holds whether this warp waited before).
        if (kv_new && ntiles > 0 && !item.from_inputs) grid_dependency_wait();
        // The item's tiles, inlined twice: for items that may use TMA (tma_item) every field is read from
        // sItem where used (f = s = item: the TMA branch leaves none of the copier's 64 registers for them;
        // the memory clobbers of the barrier waits make each use a shared-memory read); for items gathered
        // by cp.async only, f is a copy in registers (klo, khi, b, from_inputs; kmin == klo there) and s
        // (g, tok_shift) is read from sItem -- as many registers as the loop has without spills.
        auto tiles = [&](const WsItem& f, const WsItem& s, const bool tma_item) {
          // Row of key 32cw + lane of tile kt in key / value or the cache (-1: masked, zero-filled).
          auto row_of = [&](int kt) -> int {
            const int k = f.klo + kt * KEYS + cw * KC + lane;
            // (kmin == klo unless tiles start on a TMA box boundary, below kmin)
            if (kt >= ntiles || k >= f.khi || (tma_item && k < f.kmin)) return -1;
            const int index = block_div.div(k);
            const int blk = physical_block(block_table, max_blocks, num_blocks, f.b, index);
            if (blk < 0) return -1;
            // the row: new token k + tok_shift of key / value, or the cache slot (32-bit: the host sends
            // this kernel caches of fewer than 2^31 slots, num_blocks * block_size; prefill_wgmma.py)
            return f.from_inputs ? new_token_row(k, s.tok_shift) : blk * block_size + (k - index * block_size);
          };
          // Source of chunk c of the rows: key / value or the cache, at KV head g.
          auto source = [&](bool v) {
            const void* base = f.from_inputs ? (v ? (const void*)value : (const void*)key)
                                             : (v ? (const void*)value_cache : (const void*)key_cache);
            return reinterpret_cast<const unsigned char*>(base) + (long long)s.g * D * CB + (QUANT ? c8 : c) * 16;
          };
          // The rows of the warp's keys go through shared memory (sRows, written once per tile) rather than
          // shuffles: a shuffle's latency before each dependent copy serialized the copier warp.
          // Key j's row sits at sRows[cw][j % 2][j / 2], so lane (h, c) reads its 16 rows (keys 2i + h)
          // as four 16-byte vectors.
          int (*const rows)[KC / 2] = sRows[cw];
          auto copy_tile = [&](unsigned dst, const unsigned char* src) {
            if constexpr (QUANT) {
#pragma unroll
              for (int i = 0; i < KC / 4; ++i) {
                const int key = 4 * i + q4, r = rows[key & 1][key >> 1];
                cp_async_16_or_zero(dst + ws_code_chunk<KEYS>(cw * KC + key, c8),
                                    src + (long long)max(r, 0) * row_stride_bytes, r >= 0);
              }
              return;
            }
            dst += copy_base;
            int r[KC / 2];
#pragma unroll
            for (int i = 0; i < KC / 8; ++i) *reinterpret_cast<int4*>(&r[4 * i]) = reinterpret_cast<const int4*>(rows[h])[i];
#pragma unroll
            for (int i = 0; i < KC / 2; ++i)
              cp_async_16_or_zero(dst + i * 256 + (swz0 ^ (unsigned)((i & 3) << 5)), src + (long long)max(r[i], 0) * row_stride_bytes, r[i] >= 0);
          };
          // 8-bit codes: the warp's 32 rows of a tile (at `tile`), widened in place, 4 rows a step
          // (ws_widen_row, ws_widen_step; prefill_ws_plan.cuh): lane (q4, c8) reads code chunk c8 of its row
          // and writes it as two chunks of T, after every lane of the warp has read (__syncwarp: a row's
          // codes and its slab-1 chunks share their bytes); `finite`: codes that decode to NaN become 0.
          auto widen_rows = [&](unsigned tile, bool finite) {
            if constexpr (QUANT) {
              const int r0 = ws_widen_row(cw, KC, lane, 0);
              const unsigned ld = ws_code_chunk<KEYS>(r0, c8), lo = ws_wide_chunk<KEYS>(r0, 2 * c8),
                             hi = ws_wide_chunk<KEYS>(r0, 2 * c8 + 1);
#pragma unroll 1
              for (int j = 0; j < KC / 4; ++j) {
                unsigned w[4], x[8];
                lds128(tile + ws_widen_step(ld, j), w);
                __syncwarp();
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                  unsigned v = w[e];
                  if constexpr (!Cache::always_finite) v = finite ? Cache::finite4(v) : v;
                  Widen4<T, Cache>::run(v, x[2 * e], x[2 * e + 1]);
                }
                sts128(tile + ws_widen_step(lo, j), x[0], x[1], x[2], x[3]);
                sts128(tile + ws_widen_step(hi, j), x[4], x[5], x[6], x[7]);
              }
            }
          };
          // COPIER_CLEAN: Inf / NaN replaced by 0 in the warp's rows of V tile `tile` (keys kt0 ..) that some
          // live row of the item does not admit (outside `in`; keys outside [kmin, khi) were zero-filled), at
          // the places the copies put them (copy_tile's destinations).
          auto clean_rows = [&](unsigned tile, int kt0, int2 in) {
            if constexpr (CCLEAN) {
              const int k0 = kt0 + cw * KC + h;  // key of row 2i + h of the warp: k0 + 2i
#pragma unroll 1
              for (int i = 0; i < KC / 2; ++i) {
                const int k = k0 + 2 * i;
                if (k >= in.x && k < in.y) continue;
                const unsigned at = tile + copy_base + (unsigned)i * 256u + (swz0 ^ (unsigned)((i & 3) << 5));
                unsigned w[4];
                lds128(at, w);
                const unsigned f0 = finite_or_zero2<T>(w[0]), f1 = finite_or_zero2<T>(w[1]),
                               f2 = finite_or_zero2<T>(w[2]), f3 = finite_or_zero2<T>(w[3]);
                if (f0 != w[0] || f1 != w[1] || f2 != w[2] || f3 != w[3]) sts128(at, f0, f1, f2, f3);
              }
            }
          };
          // The V tile still to widen (8-bit codes) or clean (COPIER_CLEAN): bit 0 set, its stage in bit 1, its
          // land parity in bit 2, bit 3: NaN codes become 0 (8-bit codes, keys to clean), bits 4..: its kt.
          unsigned pend = 0u;
          auto widen_v = [&](unsigned pv) {
            if (OWN_LAND && (pv & 1u)) {
              const int pst = (int)((pv >> 1) & 1u);
              const unsigned vt = stages_a + (unsigned)pst * L::stage_bytes + L::tile_bytes;
              mbar_wait(land(pst, 1, cw), (pv >> 2) & 1u);
              if constexpr (QUANT) {
                widen_rows(vt, !Cache::always_finite && (pv & 8u));
              } else {
                clean_rows(vt, f.klo + (int)(pv >> 4) * KEYS, s.all);
              }
              fence_proxy_async_shared();
              mbar_arrive2(v_full(pst));
            }
          };
          int next = row_of(0);
          for (int kt = 0; kt < ntiles; ++kt, ++it) {
            const int st = it % NST;
            const unsigned parity = ((it / NST) + 1) & 1;  // of the release of this stage's previous tile
            const int row = next;
            next = row_of(kt + 1);  // (the next tile's block-table read, in flight during this tile's copies)
            const unsigned mapped = __ballot_sync(0xffffffffu, row >= 0);
            // TMA: rows per box, where every box of the warp's keys is wholly mapped or wholly masked.
            int box = 0;
            if (tma_item) {
              box = f.from_inputs ? KC : tma_box;
              const unsigned box_mask = box >= 32 ? 0xffffffffu : (1u << box) - 1u;
              for (int j = 0; box > 0 && j < KC; j += box) {
                const unsigned m = (mapped >> j) & box_mask;
                if (m != 0u && m != box_mask) box = 0;
              }
            }
            const unsigned dst = stages_a + (unsigned)st * L::stage_bytes;
            // Lane 0 issues the warp's boxes (rows of their first keys from sRows; a masked box: zeros
            // from a row past the tensor, slots < 2^31 where tma_box > 0).
            auto load_boxes = [&](unsigned tile, bool v, unsigned bar) {
              const TmaMap* map = f.from_inputs ? (v ? &tm_v : &tm_k) : (v ? &tm_vc : &tm_kc);
              const int past_end = f.from_inputs ? token_count : num_blocks * block_size;
              const int g = s.g;
              mbar_expect_tx(bar, KC * D * CB);
              for (int j = 0; j < KC; j += box) {
                const int first = rows[0][j >> 1];
                const unsigned to = tile + (unsigned)(cw * KC + j) * 128u;
                if (!QUANT) tma_load_3d(to, map, 0, g, first >= 0 ? first : past_end, bar);
                // (8-bit codes: one box of 128 into slab 1)
                tma_load_3d(to + KEYS * 128, map, QUANT ? 0 : 64, g, first >= 0 ? first : past_end, bar);
              }
            };
            if (it >= NST) mbar_wait(k_empty(st), parity);
            if (lane == 0) sMapped[st][cw] = mapped;
            __syncwarp();  // (the previous tile's reads of rows are done)
            rows[lane & 1][lane >> 1] = row;
            __syncwarp();
            if (box > 0) {
              if (lane == 0) load_boxes(dst, false, QUANT ? land(st, 0, cw) : k_full(st));
              mbar_arrive2(QUANT ? land(st, 0, cw) : k_full(st));
            } else {
              copy_tile(dst, source(false));
              mbar_arrive_on_cp_async(QUANT ? land(st, 0, cw) : k_full(st));
              mbar_arrive(QUANT ? land(st, 0, cw) : k_full(st));
            }
            // 8-bit codes, each once landed: widened in place, fenced for wgmma, published. First V(kt - 1),
            // which landed during the last tile's copies, while K(kt) is in flight, then K(kt) (both meet their
            // products in turn kt - 1), all before the wait for V(kt)'s stage, which ends turn kt - 2; V of an
            // item's last tile after its loop. (COPIER_CLEAN: V(kt - 1) cleaned there, when it has keys to clean.)
            if constexpr (OWN_LAND) widen_v(pend);
            if constexpr (QUANT) {
              mbar_wait(land(st, 0, cw), (it / NST) & 1);
              widen_rows(dst, false);
              fence_proxy_async_shared();
              mbar_arrive2(k_full(st));
            }
            if (it >= NST) mbar_wait(v_empty(st), parity);
            // A tile with keys to clean goes to the scheduler first (T caches; 8-bit codes are cleaned as they
            // are widened).
            const bool clean_v = (unsigned)(kt - s.clean.x) >= (unsigned)(s.clean.y - s.clean.x);
            const unsigned vbar = QUANT || (CCLEAN && clean_v) ? land(st, 1, cw)
                                                                : v_full(st) + (clean_v ? v_land(0) - v_full(0) : 0u);
            if (box > 0) {
              if (lane == 0) load_boxes(dst + L::tile_bytes, true, vbar);
              mbar_arrive2(vbar);
            } else {
              copy_tile(dst + L::tile_bytes, source(true));
              mbar_arrive_on_cp_async(vbar);
              mbar_arrive(vbar);
            }
            if constexpr (QUANT) pend = 1u | (unsigned)st << 1 | ((it / NST) & 1u) << 2 | (clean_v ? 8u : 0u);
            if constexpr (CCLEAN) {
              // (the parity of this tile's phase of land(st, 1): as the scheduler numbers v_land's phases)
              const unsigned ph = ws_land_at(s.first_tile, kt, ntiles, s.clean, s.land_parity);
              pend = clean_v ? 1u | (unsigned)st << 1 | ph << 2 | (unsigned)kt << 4 : 0u;
            }
          }
          widen_v(pend);
        };
        if (item.from_inputs ? tma_inputs : tma_box > 0) {
          tiles(item, item, true);
        } else {
          WsItem fields;
          fields.klo = fields.kmin = item.klo;
          fields.khi = item.khi;
          fields.b = item.b;
          fields.from_inputs = item.from_inputs;
          tiles(fields, item, false);
        }
      }
    }
    cp_async_wait<0>();  // (the copies land before the copiers and the scheduler exit)
    return;
  }

  // -------------------------------------------------------------------- consumers
  setmaxnreg_inc<Cfg::CONSUMER_REGS>();
  const int cw = warp - PT / 32;  // consumer warp: rows 16cw..16cw+15 of an item
  const int u = cw >> 2;          // consumer warpgroup: rows 64u..64u+63
  const int r0 = lane >> 2;
  auto my_row = [&](int i) { return cw * 16 + r0 + i * 8; };
  const int my_turn = WS_BAR_TURN + u, other_turn = WS_BAR_TURN + (u ^ 1);
  if (u == 1) bar_arrive(WS_BAR_TURN, CT);  // warpgroup 0 takes the first turn

  const WgScores sc(QUANT && k_quant == QUANT_PER_TENSOR ? scale * k_scale[0] : scale, softcap);
  // Shared-memory layouts (16-bit, 128B swizzle; descriptor fields in wgmma.cuh): a [rows][128] tile
  // (a Q buffer: rows = ROWS; K, V: rows = KEYS) is two slabs [rows][64], slab h holding columns
  // 64h..64h+63 at byte h*rows*128, element (r, c) of a slab at r*128 + ((c/8 ^ r%8) * 16) + (c%8)*2
  // (wg_off); every slab starts 1024-aligned.
  //   Q (A of S, K-major), warpgroup u, k16 step kk: start = Q + (kk/4)*ROWS*128 + u*64*128 + (kk%4)*32,
  //     SBO = 1024 (the next 8 rows), LBO unused.
  //   K (B of S, K-major, N = KEYS keys): start = K + (kk/4)*KEYS*128 + (kk%4)*32, SBO = 1024.
  //   V (B of O, MN-major, N = 128 channels = two 64-wide slabs, K = 16 keys per step j2):
  //     start = V + j2*16*128, LBO = KEYS*128 (slab 0 -> slab 1 along N), SBO = 1024 (keys 0..7 -> 8..15).
  const unsigned long long kv_desc0 = wg_desc_sw128(stages_a, 16, 1024);
  const unsigned long long v_desc0 = wg_desc_sw128(stages_a + L::tile_bytes, KEYS * 128, 1024);
  auto qk_step = [](int kk, int rows) { return (unsigned long long)(((kk >> 2) * rows * 128 + (kk & 3) * 32) >> 4); };
  auto stage_off = [](int st) { return (unsigned long long)((st * L::stage_bytes) >> 4); };

  unsigned it = 0;  // K/V tiles consumed, over all items (the copiers' count)
  for (unsigned n = 0;; ++n) {
    const int buf = n & 1;
    mbar_wait(q_full(buf), (n >> 1) & 1);
    const int ntiles = sItem[buf].ntiles;
    if (ntiles < 0) {
      // Warpgroup 1 arrived once more than warpgroup 0 waits at its barrier (the first turn's
      // go-ahead): absorb that arrival, so no named barrier is left half-way at exit.
      if (u == 0) bar_sync(my_turn, CT);
      break;
    }
    const int klo = sItem[buf].klo;
    const int2 wr = sItem[buf].wg[u];
    fence_proxy_async_shared();  // the item's Q rows (cp.async) -> visible to wgmma
    const unsigned long long q_desc0 = wg_desc_sw128(q_a + buf * L::q_bytes + u * 64 * 128, 16, 1024);
    const int* lo_row = sLo[buf];
    const int* hi_row = sHi[buf];

    float o[D / 2];  // O accumulator: o[4n + e] = O[row (e/2 ? +8)][8n + 2(lane%4) + e%2]
#pragma unroll
    for (int i = 0; i < D / 2; ++i) o[i] = 0.0f;
    float row_max[2] = {CUPA_NEG_INF, CUPA_NEG_INF}, row_sum[2] = {0.0f, 0.0f};
    float s[KEYS / 2];         // s[4j + e] = S[row (e/2 ? +8)][8j + 2(lane%4) + e%2]
    unsigned p[KEYS / 16][4];  // P (T) as the A fragments of the k16 steps over the tile's keys
    unsigned mw[KEYS / 32];

    auto read_mapped = [&](int st) {
#pragma unroll
      for (int w = 0; w < KEYS / 32; ++w) mw[w] = sMapped[st][w];
    };
    // S = Q K^T of tile kt (stage st): 8 k16 steps over D (the first overwrites s).
    auto issue_s = [&](int st) {
      const unsigned long long k_desc = kv_desc0 + stage_off(st);
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk)
        wgmma_ss_m64n128k16<T>(s, q_desc0 + qk_step(kk, ROWS), k_desc + qk_step(kk, KEYS), kk > 0);
    };
    // O += P V of the tile in stage st: 8 k16 steps over its keys (rows 16 j2.. of V: +2048 bytes each).
    auto issue_pv = [&](int st) {
      const unsigned long long v_desc = v_desc0 + stage_off(st);
#pragma unroll
      for (int j2 = 0; j2 < KEYS / 16; ++j2)
        wgmma_rs_m64n128k16_tb<T>(o, p[j2], v_desc + (unsigned long long)((j2 * 16 * 128) >> 4), 1);
    };
    // Online softmax of tile kt's scores s (masks from mw and the rows' ranges) -> p; rescales o.
    auto softmax_tile = [&](int kt) {
      const int kt0 = klo + kt * KEYS;
      bool all_mapped = true;
#pragma unroll
      for (int w = 0; w < KEYS / 32; ++w) all_mapped = all_mapped && mw[w] == 0xffffffffu;
      const bool interior = all_mapped && kt0 >= wr.x && kt0 + KEYS <= wr.y;
      wg_softmax_tile<T, KEYS, D>(s, o, p, row_max, row_sum, mw, interior, kt0, lo_row, hi_row, my_row(0), lane, sc);
    };
    // Before a turn's products: every register they read or write is final (PTX: no access between
    // wgmma.fence and the wgmma that uses the register), and the compiler moves nothing across.
    auto fence_operands = [&] {
      wg_fence_operands(o);
      wg_fence_operands(s);
#pragma unroll
      for (int j2 = 0; j2 < KEYS / 16; ++j2) wg_fence_operands(p[j2]);
      wgmma_fence();
    };

    // Every turn issues its products unconditionally (a wgmma under a branch the compiler cannot prove
    // uniform is serialized: ptxas C7520); a tile none of the warpgroup's rows admits is masked out
    // entirely by softmax_tile (its row ranges exclude every key), which costs its products only.
    if (ntiles > 0) {
      // Turn 0: S of tile 0.
      {
        const int st = it % NST;
        mbar_wait(k_full(st), (it / NST) & 1);
        fence_proxy_async_shared();
        read_mapped(st);
        bar_sync(my_turn, CT);
        fence_operands();
        issue_s(st);
        wgmma_commit();
        bar_arrive(other_turn, CT);
        wgmma_wait<0>();
        wg_fence_operands(s);
        mbar_arrive(k_empty(st));
        softmax_tile(0);
      }
      // Turns 1 .. ntiles - 1: S of tile kt + 1, then P V of tile kt, as two groups: the K stage goes
      // back to the copier as soon as S is complete, the V stage when P V is; then the softmax of tile
      // kt + 1. (Running the softmax while P V is in flight measured slower: chunked B=8 x (8192 + 512),
      // 1082 against 999 us: the V stage then goes back only after the softmax.)
      for (int kt = 0; kt + 1 < ntiles; ++kt) {
        const unsigned iv = it + kt, ik = iv + 1;
        const int sv = iv % NST, sk = ik % NST;
        mbar_wait(k_full(sk), (ik / NST) & 1);
        mbar_wait(v_full(sv), (iv / NST) & 1);
        read_mapped(sk);
        fence_proxy_async_shared();
        bar_sync(my_turn, CT);
        fence_operands();
        issue_s(sk);
        wgmma_commit();
        issue_pv(sv);
        wgmma_commit();
        bar_arrive(other_turn, CT);
        wgmma_wait<1>();
        wg_fence_operands(s);
        mbar_arrive(k_empty(sk));
        wgmma_wait<0>();
        wg_fence_operands(o);
        mbar_arrive(v_empty(sv));
        softmax_tile(kt + 1);
      }
      // Last turn: P V of the last tile.
      {
        const unsigned iv = it + ntiles - 1;
        const int sv = iv % NST;
        mbar_wait(v_full(sv), (iv / NST) & 1);
        fence_proxy_async_shared();
        bar_sync(my_turn, CT);
        fence_operands();
        issue_pv(sv);
        wgmma_commit();
        bar_arrive(other_turn, CT);
        wgmma_wait<0>();
        wg_fence_operands(o);
        mbar_arrive(v_empty(sv));
      }
      it += ntiles;
    }

    // Epilogue: finalize this warp's rows into its own rows of the item's Q buffer (as T), then store
    // whole rows. The warpgroup barrier: every wgmma of the warpgroup (reading these rows) is complete.
    bar_sync(WS_BAR_WG + u, 128);
    if constexpr (QUANT) {  // V's scale: per tensor in the rows' factor, per channel on each channel
      const int g = sItem[buf].g;
      wg_store_rows<T, ROWS, D, true>(o, row_max, row_sum, cw * 16, lane, smem + buf * L::q_bytes, lo_row, hi_row,
                                      sHead[buf], sTok[buf], head_sink, out, lse, H,
                                      v_quant == QUANT_PER_CHANNEL ? v_scale + g * D : nullptr,
                                      v_quant == QUANT_PER_TENSOR ? v_scale[0] : 1.0f);
    } else {
      wg_store_rows<T, ROWS, D>(o, row_max, row_sum, cw * 16, lane, smem + buf * L::q_bytes, lo_row, hi_row, sHead[buf],
                                sTok[buf], head_sink, out, lse, H);
    }
    mbar_arrive(q_empty(buf));  // the item's buffer and row data go back to the scheduler
  }
}
