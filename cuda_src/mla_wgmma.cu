// Absorbed MLA (kv_cache_layout LATENT, head_size 576, v_head_size 512, one latent head) on Hopper warpgroup
// MMA (sm_90a only): fp16/bf16 T, caches of T. Same contract, tiles, splits and epilogue as mla_mma.cu
// (mla.cuh); the tile is 64 rows (the M of wgmma), the key tile 64 latent rows.
//
// One CTA (256 threads, ~227 KB of shared memory: one per SM) owns (row tile x of 64 (token, head) rows,
// split s). Shared memory: Q [64][576] (72 KB), two stages of K [64 keys][576] (72 KB each), P [64][64].
// Both operands of S = Q K^T and the V of O += P V come from the 128B-swizzled slabs wgmma reads
// (9 slabs of 64 channels; V = slabs 0..7 of the K tile, read MN-major), so each latent byte is read
// from memory once per tile and token, for all the tile's heads. Two warpgroups:
//   A (warps 0-3): per key tile, S on wgmma.m64n64k16 (36 k-steps), the online softmax in registers
//     (prefill_wgmma_tile.cuh), P and the rows' rescale factors to shared memory, then O[:, 0:256] += P V
//     on wgmma.m64n128k16 with P from registers;
//   B (warps 4-7): the loads -- Q, then each key tile into the stage freed two tiles earlier, rows found
//     one tile ahead through the block table; by TMA (boxes of gcd(block_size, 64) rows, host tensor
//     map) where every key of the tile is mapped and admitted, else cp.async gathers with zero fill --
//     and O[:, 256:512] += P V with P read from shared memory.
// The 64 x 512 fp32 accumulator is split between the warpgroups (128 registers a thread each). mbarriers:
// full / empty per stage (B's copies and tx bytes; A's and B's last reads), p_full / p_empty for P.
// A tile is live from its S to both halves of its P V, so with two stages the load of tile i + 2 runs
// during tile i + 1 (one tile of lead); B's P V half of tile i overlaps A's S of tile i + 1.
// Floors (H200, fp16): per key and row 2*(576+512) FLOPs, per key 1152 bytes. H=128 x B=64 x L=4096:
// 73 GFLOP, ~92 us at 790 TFLOP/s (~74 us at the 989 TFLOP/s peak) against 302 MB, ~67 us at 4.5 TB/s:
// compute-bound, 128 CTAs (2 per token) fill the 132 SMs in one wave without splits. B=8, L=8192:
// 16 tiles, so 8 splits of 1024 keys give 128 CTAs (18 GFLOP, ~23 us). H=16: memory-bound (302 MB,
// ~67 us; the 64-row tile's tensor time stays below the load time of a key tile), 64 tiles x 2 splits.
// Host values that size the launch: token_count, batch_size, num_heads (tiles), tile_splits and num_splits
// (static sizes, SM count), tma_box (block_size); attention_metadata only drops trailing splits.
#include "common.cuh"
#include "mla.cuh"
#include "mma.cuh"
#include "paged.cuh"
#include "prefill_tiles.cuh"
#include "quant.cuh"  // CacheSame<T>
#include "softmax.cuh"
#include "wgmma.cuh"
#include "prefill_wgmma_tile.cuh"

struct MlaWgConfig {
  static constexpr int ROWS = 64, KEYS = 64, THREADS = 256, STAGES = 2;
  static constexpr int SLAB = KEYS * 128;  // one 64-channel slab of a key tile (or of Q), bytes
};

// Shared memory (dynamic, from a 1024-aligned base; mirrored by wgmma_shared_bytes in cupa/kernels/mla.py).
struct MlaWgSmem {
  using Cfg = MlaWgConfig;
  static constexpr int q_at = 0;                                        // Q: 9 slabs of [64 rows][64]
  static constexpr int stage_bytes = Cfg::KEYS * MLA_D * 2;             // a key tile: 9 slabs
  static constexpr int stage_at = q_at + Cfg::ROWS * MLA_D * 2;
  static constexpr int p_at = stage_at + Cfg::STAGES * stage_bytes;     // P [64][64] T (swz<64>)
  static constexpr int rows_at = p_at + Cfg::ROWS * Cfg::KEYS * 2;      // key rows: 3 slots of 64
  static constexpr int mask_at = rows_at + 3 * Cfg::KEYS * 4;           // mapped-key bits: 3 slots x 2 words
  static constexpr int mapped_at = mask_at + 3 * 2 * 4;                 // per stage: the tile's bits
  static constexpr int lo_at = mapped_at + Cfg::STAGES * 2 * 4;         // sLo, sHi [64]
  static constexpr int scale_at = lo_at + 2 * Cfg::ROWS * 4;            // rows' rescale factors of a tile
  static constexpr int bar_at = scale_at + Cfg::ROWS * 4;               // 7 mbarriers
  static constexpr int tile_at = bar_at + 8 * 8;
  static constexpr int used = tile_at + 64;
  static constexpr int align_pad = 1024;
  static constexpr int total = used + align_pad;
  static_assert(stage_at % 1024 == 0 && p_at % 1024 == 0 && bar_at % 8 == 0, "swizzle atoms 1024-aligned");
  static_assert(total <= 232448, "one CTA per SM on sm_90");
};

// Named barrier (0 is __syncthreads): warpgroup B's row lookups.
constexpr int MLA_BAR_ROWS = 1;

template <typename T, typename Cache>
__global__ void __launch_bounds__(MlaWgConfig::THREADS, 1) paged_mla_wgmma(
    const T* __restrict__ q,  // (N, H, 576): prologue output, or `query` itself
    const typename Cache::storage* __restrict__ key_cache, const int* __restrict__ cum, const int* __restrict__ past,
    const int* __restrict__ block_table, const int* __restrict__ query_positions, const float* __restrict__ k_scale,
    T* __restrict__ out, float* __restrict__ lse, float* __restrict__ part_o, float2* __restrict__ part_ml,
    MlaTileRecord* __restrict__ records, int token_count, int num_heads, int batch_size, int num_blocks,
    int block_size, int max_blocks, int zero_ctas, int num_tiles, int tile_splits, int num_splits,
    int rotary_max_pos, float scale, float softcap, int window, int is_causal, int k_quant,
    // TMA: the cache as (576, 1, slots) in boxes of 64 x 1 x tma_box rows, 128B swizzle; tma_box 0 (cp.async
    // only) or 8, 16, 32, 64 dividing block_size (box destinations stay 1024-byte aligned).
    const __grid_constant__ TmaMap tm_cache, int tma_box) {
  // (k_scale, k_quant: the argument list of paged_mla_mma; unused, T caches only.)
  using Cfg = MlaWgConfig;
  using L = MlaWgSmem;
  static_assert(!Cache::quantized && sizeof(typename Cache::storage) == 2, "T caches only (16-bit)");
  constexpr int D = MLA_D, ROWS = Cfg::ROWS, KEYS = Cfg::KEYS, SLAB = Cfg::SLAB;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;

  if (mla_zero_ctas<T>(zero_ctas, out, lse, cum, batch_size, token_count, num_heads)) return;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024u - (smem_addr(smem_raw) & 1023u)) & 1023u);
  T* sP = reinterpret_cast<T*>(smem + L::p_at);
  unsigned* sRows = reinterpret_cast<unsigned*>(smem + L::rows_at);
  unsigned* sMask = reinterpret_cast<unsigned*>(smem + L::mask_at);
  unsigned* sMapped = reinterpret_cast<unsigned*>(smem + L::mapped_at);
  int* sLo = reinterpret_cast<int*>(smem + L::lo_at);
  int* sHi = sLo + ROWS;
  float* sScale = reinterpret_cast<float*>(smem + L::scale_at);
  MlaTile* tile = reinterpret_cast<MlaTile*>(smem + L::tile_at);
  const unsigned q_a = smem_addr(smem + L::q_at), stages_a = smem_addr(smem + L::stage_at);
  const unsigned bar_a = smem_addr(smem + L::bar_at);
  auto full = [&](int st) { return bar_a + 8u * st; };
  auto empty = [&](int st) { return bar_a + 8u * (2 + st); };
  const unsigned q_full = bar_a + 32u, p_full = bar_a + 40u, p_empty = bar_a + 48u;

  const long long x = (long long)num_tiles - 1 - ((int)blockIdx.x - zero_ctas);  // heaviest tiles first
  const int split = blockIdx.y;
  const long long kv_capacity = (long long)max_blocks * block_size;
  int* scratch = reinterpret_cast<int*>(sP);  // sTok / sHead: the P buffer is free until the first tile
  MlaTile tl;
  MlaSplits sp;
  if (!mla_begin_tile<ROWS>(x, split, tile_splits, num_splits, cum, past, batch_size, token_count, num_heads,
                            query_positions, kv_capacity, rotary_max_pos, is_causal, window, scratch,
                            scratch + ROWS, sLo, sHi, tile, tl, sp))
    return;
  const bool direct = sp.count == 1;
  const MlaKeys keys = mla_keys(tl, sp, split, KEYS, KEYS);  // tiles from a multiple of 64: whole TMA boxes
  const int ntiles = keys.ntiles;
  if (tid == 0) {
    for (int st = 0; st < Cfg::STAGES; ++st) {
      mbar_init(full(st), 2 * 128);  // two arrivals a copier thread: its cp.async copies', its own
      mbar_init(empty(st), 256);
    }
    mbar_init(q_full, 2 * 128);
    mbar_init(p_full, 128);
    mbar_init(p_empty, 128);
    mbar_init_fence();
  }
  grid_dependency_wait();  // Q, cache rows and the zeroed tile records come from the prologue
  mla_record_tile(records, x, tl, sp, split);
  __syncthreads();

  // V of channels [ch0, ch0 + 128) for keys 16 j2.. of stage st: MN-major, LBO = the next 64-channel slab.
  const unsigned long long v_desc0 = wg_desc_sw128(stages_a, SLAB, 1024);
  auto v_desc = [&](int st, int ch0, int j2) {
    return v_desc0 + (unsigned long long)((st * L::stage_bytes + (ch0 / 64) * SLAB + j2 * 16 * 128) >> 4);
  };
  float o[2][64];  // O[:, ch0 + 128h + ...] of this warpgroup (A: ch0 = 0, B: ch0 = 256), accumulator layout
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int i = 0; i < 64; ++i) o[h][i] = 0.0f;
  const int wr = warp & 3;                  // warp within its warpgroup: rows 16 wr ..
  const int row0 = 16 * wr + (lane >> 2);   // this thread's rows: row0, row0 + 8

  if (tid < 128) {
    // ------------------------------------------------------------------ warpgroup A
    const WgScores sc(scale, softcap);
    const unsigned long long q_desc0 = wg_desc_sw128(q_a, 16, 1024), k_desc0 = wg_desc_sw128(stages_a, 16, 1024);
    auto kstep = [](int kk) { return (unsigned long long)(((kk >> 2) * SLAB + (kk & 3) * 32) >> 4); };
    float row_max[2] = {CUPA_NEG_INF, CUPA_NEG_INF}, row_sum[2] = {0.0f, 0.0f};
    if (ntiles > 0) mbar_wait(q_full, 0);
    for (int kt = 0; kt < ntiles; ++kt) {
      const int st = kt & 1;
      mbar_wait(full(st), (kt >> 1) & 1);
      fence_proxy_async_shared();  // the tile's cp.async rows -> visible to wgmma
      const unsigned mw[2] = {sMapped[2 * st], sMapped[2 * st + 1]};
      float s[32];
      wg_fence_operands(s);
      wgmma_fence();
      const unsigned long long k_desc = k_desc0 + (unsigned long long)((st * L::stage_bytes) >> 4);
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) wgmma_ss_m64n64k16<T>(s, q_desc0 + kstep(kk), k_desc + kstep(kk), kk > 0);
      wgmma_commit();
      wgmma_wait<0>();
      wg_fence_operands(s);
      // Online softmax (wg_softmax_tile rescales only its dummy accumulator: o is rescaled here, with the
      // factors it derives the same way, and B gets them through shared memory).
      const float before[2] = {row_max[0], row_max[1]};
      const int kt0 = keys.korg + kt * KEYS;
      const bool interior = (mw[0] & mw[1]) == 0xffffffffu && kt0 >= tl.ilo && kt0 + KEYS <= tl.ihi;
      unsigned p[KEYS / 16][4];
      float unused[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      wg_softmax_tile<T, KEYS, 8>(s, unused, p, row_max, row_sum, mw, interior, kt0, sLo, sHi, row0, lane, sc);
      float c[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) c[i] = before[i] == row_max[i] ? 1.0f : ex2_approx(before[i] - row_max[i]);
      if (__any_sync(0xffffffffu, c[0] != 1.0f || c[1] != 1.0f)) {
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int n = 0; n < 16; ++n) {
            o[h][4 * n + 0] *= c[0];
            o[h][4 * n + 1] *= c[0];
            o[h][4 * n + 2] *= c[1];
            o[h][4 * n + 3] *= c[1];
          }
      }
      if (kt > 0) mbar_wait(p_empty, (kt - 1) & 1);  // B holds the previous P in registers
#pragma unroll
      for (int j2 = 0; j2 < KEYS / 16; ++j2) {
        const int key = 16 * j2 + 2 * (lane & 3);
        *reinterpret_cast<unsigned*>(sP + swz<64>(row0, key)) = p[j2][0];
        *reinterpret_cast<unsigned*>(sP + swz<64>(row0 + 8, key)) = p[j2][1];
        *reinterpret_cast<unsigned*>(sP + swz<64>(row0, key + 8)) = p[j2][2];
        *reinterpret_cast<unsigned*>(sP + swz<64>(row0 + 8, key + 8)) = p[j2][3];
      }
      if ((lane & 3) == 0) {
        sScale[row0] = c[0];
        sScale[row0 + 8] = c[1];
      }
      mbar_arrive(p_full);
      // O[:, 0:256] += P V (P from registers).
      wg_fence_operands(o[0]);
      wg_fence_operands(o[1]);
#pragma unroll
      for (int j2 = 0; j2 < KEYS / 16; ++j2) wg_fence_operands(p[j2]);
      wgmma_fence();
#pragma unroll
      for (int j2 = 0; j2 < KEYS / 16; ++j2) {
        wgmma_rs_m64n128k16_tb<T>(o[0], p[j2], v_desc(st, 0, j2), 1);
        wgmma_rs_m64n128k16_tb<T>(o[1], p[j2], v_desc(st, 128, j2), 1);
      }
      wgmma_commit();
      wgmma_wait<0>();
      wg_fence_operands(o[0]);
      wg_fence_operands(o[1]);
      mbar_arrive(empty(st));
    }
    // The rows' final state, for both warpgroups (in the P buffer, once B has read the last P).
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      row_sum[i] += __shfl_xor_sync(0xffffffffu, row_sum[i], 1);
      row_sum[i] += __shfl_xor_sync(0xffffffffu, row_sum[i], 2);
    }
    if (ntiles > 0) mbar_wait(p_empty, (ntiles - 1) & 1);
    float* fin = reinterpret_cast<float*>(sP);
    if ((lane & 3) == 0) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        fin[row0 + 8 * i] = row_max[i] == CUPA_NEG_INF ? CUPA_NEG_INF : row_max[i] * CUPA_LN2;
        fin[ROWS + row0 + 8 * i] = row_sum[i];
      }
    }
  } else {
    // ------------------------------------------------------------------ warpgroup B
    const int btid = tid - 128;
    const FastDiv block_div(block_size);
    // Rows of the keys of tile kt (threads 0..63) into slot kt % 3, with their mapped bits.
    auto find_rows = [&](int kt) {
      if (btid < KEYS) {
        const unsigned row = kt < ntiles ? mla_key_row(keys.korg + kt * KEYS + btid, keys, block_table, max_blocks,
                                                       num_blocks, block_size, block_div, tl.b)
                                         : MLA_NO_ROW;
        sRows[(kt % 3) * KEYS + btid] = row;
        const unsigned bits = __ballot_sync(0xffffffffu, row != MLA_NO_ROW);
        if (lane == 0) sMask[(kt % 3) * 2 + (btid >> 5)] = bits;
      }
      bar_sync(MLA_BAR_ROWS, 128);
    };
    // Tile kt into stage kt % 2: TMA boxes when every key is mapped and admitted, else cp.async gathers.
    auto issue = [&](int kt) {
      const int st = kt & 1;
      const unsigned* rows = sRows + (kt % 3) * KEYS;
      const unsigned m0 = sMask[(kt % 3) * 2], m1 = sMask[(kt % 3) * 2 + 1];
      if (btid < 2) sMapped[2 * st + btid] = btid ? m1 : m0;
      const unsigned dst = stages_a + st * L::stage_bytes;
      if (tma_box > 0 && (m0 & m1) == 0xffffffffu) {
        if (btid == 0) {
          mbar_expect_tx(full(st), (unsigned)L::stage_bytes);
          for (int slab = 0; slab < D / 64; ++slab)
            for (int j = 0; j < KEYS; j += tma_box)
              tma_load_3d(dst + slab * SLAB + j * 128, &tm_cache, slab * 64, 0, (int)rows[j], full(st));
        }
      } else {
        for (int e = btid; e < KEYS * (D / 8); e += 128) {
          const int key = e / (D / 8), c = e % (D / 8);
          const unsigned row = rows[key];
          const T* src = key_cache + (unsigned long long)(row == MLA_NO_ROW ? 0u : row) * D + c * 8;
          cp_async_16_or_zero(dst + wg_off<KEYS>(key, c * 8), src, row != MLA_NO_ROW);
        }
        mbar_arrive_on_cp_async(full(st));  // (each thread arrives twice: see the barriers' counts)
        mbar_arrive(full(st));
        return;
      }
      mbar_arrive2(full(st));
    };
    if (ntiles > 0) {
      if (btid == 0 && tma_box > 0) tma_prefetch_map(&tm_cache);
      for (int e = btid; e < ROWS * (D / 8); e += 128) {
        const int r = e / (D / 8), c = e % (D / 8);
        const bool live = r >= tl.owned_lo && r < tl.owned_hi;
        cp_async_16_or_zero(q_a + wg_off<ROWS>(r, c * 8), live ? q + (tl.r0 + r) * D + c * 8 : q, live);
      }
      mbar_arrive_on_cp_async(q_full);
      mbar_arrive(q_full);
      find_rows(0);
      issue(0);
      find_rows(1);
      if (ntiles > 1) {
        issue(1);
        find_rows(2);
      }
    }
    for (int kt = 0; kt < ntiles; ++kt) {
      const int st = kt & 1;
      mbar_wait(p_full, kt & 1);
      unsigned a[KEYS / 16][4];
#pragma unroll
      for (int j2 = 0; j2 < KEYS / 16; ++j2)
        ldmatrix_x4(a[j2], sP + swz<64>(16 * wr + (lane & 15), 16 * j2 + (lane >> 4) * 8));
      const float c0 = sScale[row0], c1 = sScale[row0 + 8];
      mbar_arrive(p_empty);
      mbar_wait(full(st), (kt >> 1) & 1);  // (complete: A waited for it before this tile's S)
      fence_proxy_async_shared();
      if (__any_sync(0xffffffffu, c0 != 1.0f || c1 != 1.0f)) {
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int n = 0; n < 16; ++n) {
            o[h][4 * n + 0] *= c0;
            o[h][4 * n + 1] *= c0;
            o[h][4 * n + 2] *= c1;
            o[h][4 * n + 3] *= c1;
          }
      }
      // O[:, 256:512] += P V (P from shared memory, through registers).
      wg_fence_operands(o[0]);
      wg_fence_operands(o[1]);
#pragma unroll
      for (int j2 = 0; j2 < KEYS / 16; ++j2) wg_fence_operands(a[j2]);
      wgmma_fence();
#pragma unroll
      for (int j2 = 0; j2 < KEYS / 16; ++j2) {
        wgmma_rs_m64n128k16_tb<T>(o[0], a[j2], v_desc(st, 256, j2), 1);
        wgmma_rs_m64n128k16_tb<T>(o[1], a[j2], v_desc(st, 384, j2), 1);
      }
      wgmma_commit();
      wgmma_wait<0>();
      wg_fence_operands(o[0]);
      wg_fence_operands(o[1]);
      mbar_arrive(empty(st));
      if (kt + 2 < ntiles) {
        mbar_wait(empty(st), (kt >> 1) & 1);  // A is done with tile kt too: its stage takes tile kt + 2
        issue(kt + 2);
        find_rows(kt + 3);
      }
    }
    cp_async_wait<0>();
  }

  // ------------------------------------------------------------------ epilogue (both warpgroups)
  __syncthreads();
  const float* fin = reinterpret_cast<const float*>(sP);
  float M[2], Lsum[2];
  bool write[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int row = row0 + 8 * i;
    const bool live = sHi[row] > sLo[row];
    M[i] = live && ntiles > 0 ? fin[row] : CUPA_NEG_INF;
    Lsum[i] = live && ntiles > 0 ? fin[ROWS + row] : 0.0f;
    write[i] = row >= tl.owned_lo && row < tl.owned_hi;
    if (tid < 128 && (lane & 3) == 0 && write[i])
      mla_store_state(M[i], Lsum[i], tl.r0 + row, split, num_splits, direct, lse, part_ml);
  }
  const int ch0 = tid < 128 ? 0 : 256;
#pragma unroll
  for (int h = 0; h < 2; ++h)
    mla_store_o<T, 16, false>([&](int j, int e) { return o[h][4 * j + e]; }, lane, row0, ch0 + 128 * h, M, Lsum, write,
                       tl.r0, split, num_splits, direct, k_scale, 0, out, part_o);
}
