// What the two absorbed-MLA kernels share (mla_mma.cu: mma.sync, sm_80+; mla_wgmma.cu: wgmma, sm_90a).
//
// LATENT layout: one KV head whose 576-channel rows are [512 compressed channels | 64 rotary channels],
// V being channels 0..511 of the same row. A CTA owns a row tile -- ROWS consecutive rows of one
// sequence, row = (new token, query head) token-major, so all heads of a token sit in one tile and
// share every latent tile read from memory -- and one split of the key axis. Tiles are numbered
// as the prefill kernels number theirs (prefill_tiles.cuh, group = num_heads since kv_num_heads = 1);
// global row R = t * num_heads + h addresses Q (R * 576), the output (R * 512), lse (R) and the split
// partials ((R * num_splits + split) * 512), so the rows of a tile are contiguous everywhere.
// Splits (mla_splits): each tile cuts its own keys -- the union of its rows' admitted ranges, from a
// multiple of MLA_CHUNK_ALIGN -- into at most `tile_splits` (a host value from static sizes) chunks of at
// least MLA_MIN_CHUNK keys, so a tile's split depends on its own range only, never on attention_metadata;
// CTAs of splits past the tile's count exit. A tile of one split is finalized by it; otherwise each split
// writes fp32 partial states, split 0 records the tile (MlaTileRecord), and paged_mla_merge
// (mla_merge.cu), launched next, merges them over the whole GPU.
#pragma once
#include "common.cuh"
#include "paged.cuh"
#include "prefill_tiles.cuh"
#include "quant.cuh"
#include "softmax.cuh"

constexpr int MLA_D = 576;   // latent row: 512 compressed channels + 64 rotary channels
constexpr int MLA_DV = 512;  // V: the leading 512 channels of the row
constexpr unsigned MLA_NO_ROW = 0xffffffffu;  // a masked key's cache row (zero-filled, never read)
constexpr int MLA_CHUNK_ALIGN = 64;  // splits start at multiples of this (a key tile, the wgmma tile origin)
constexpr int MLA_MIN_CHUNK = 256;   // fewest keys per split (mirrored in cupa/kernels/mla.py)

// A CTA's row tile, as mla_locate_tile leaves it in shared memory.
struct MlaTile {
  long long r0;            // global row of tile row 0
  int b;                   // the sequence
  int owned_lo, owned_hi;  // tile rows [owned_lo, owned_hi) are rows of owned tokens: the ones this tile writes
  int lo, hi;              // union of the live rows' admitted key ranges (lo >= hi: none)
  int ilo, ihi;            // their intersection (a key tile inside it, every key mapped, needs no mask)
};

// The split plan of a tile with admitted keys [lo, hi): keys from `base` (lo rounded down to
// MLA_CHUNK_ALIGN) in `count` chunks of `chunk` keys (a multiple of MLA_CHUNK_ALIGN and at least
// MLA_MIN_CHUNK unless count is 1), count <= tile_splits, the last one ending at or past hi; count is
// clamped to the launched splits (an undersized attention_metadata bound omits the keys past them).
// No keys: one split.
struct MlaSplits {
  int base, chunk, count;
};
CUPA_DEVICE MlaSplits mla_splits(int lo, int hi, int tile_splits, int num_splits) {
  MlaSplits sp;
  sp.base = 0;
  sp.chunk = MLA_CHUNK_ALIGN;
  sp.count = 1;
  if (hi > lo) {
    sp.base = lo - lo % MLA_CHUNK_ALIGN;
    const long long span = hi - sp.base;
    const int n = (int)max(1ll, min((long long)tile_splits, span / MLA_MIN_CHUNK));
    sp.chunk = (int)(((span + n - 1) / n + MLA_CHUNK_ALIGN - 1) / MLA_CHUNK_ALIGN * MLA_CHUNK_ALIGN);
    sp.count = (int)min((span + sp.chunk - 1) / sp.chunk, (long long)num_splits);
  }
  return sp;
}

// What paged_mla_merge reads of a row tile of several splits: output rows [row0, row0 + rows) and the
// splits 0 .. count - 1 that hold their partial states. Zero (the prologue's fill) for the other tiles.
struct __align__(16) MlaTileRecord {
  int row0, rows, count, unused;
};

// Locate row tile x (every thread of the CTA calls it; ROWS <= 64, blockDim.x >= ROWS). Per row r:
// sLo[r], sHi[r] (admitted key range; 0, 0 when none); sTok / sHead are scratch of ROWS ints. False
// (uniformly) when x is a gap between two sequences' tiles.
template <int ROWS>
CUPA_DEVICE bool mla_locate_tile(long long x, const int* cum, const int* past, int batch_size, int token_count,
                                 int num_heads, const int* query_positions, long long kv_capacity, int rotary_max_pos,
                                 int is_causal, int window, int* sTok, int* sHead, int* sLo, int* sHi,
                                 MlaTile* tile) {
  static_assert(ROWS <= 64, "two ballots cover a tile");
  const int tid = threadIdx.x, lane = tid & 31;
  RowTile rt;
  if (!locate_row_tile<ROWS>(cum, batch_size, token_count, x, num_heads, lane, rt)) return false;  // (every warp alike)
  if (tid < ROWS) {
    int lo, hi;
    locate_tile_row(rt, tid, 0, num_heads, cum, past, batch_size, query_positions, kv_capacity, rotary_max_pos,
                    is_causal, window, sTok, sHead, sLo, sHi, lo, hi);
  }
  __syncthreads();
  if (tid < 32) {
    unsigned owned[2];
    int ulo = RANGE_NONE_LO, uhi = RANGE_NONE_HI, ilo = RANGE_NONE_HI, ihi = RANGE_NONE_LO;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int r = lane + 32 * i;
      const bool in = r < ROWS;
      owned[i] = __ballot_sync(0xffffffffu, in && sTok[r] >= 0);
      if (in && sHi[r] > sLo[r]) {
        ulo = min(ulo, sLo[r]);
        uhi = max(uhi, sHi[r]);
        ilo = max(ilo, sLo[r]);
        ihi = min(ihi, sHi[r]);
      }
    }
    ulo = __reduce_min_sync(0xffffffffu, ulo);
    uhi = __reduce_max_sync(0xffffffffu, uhi);
    ilo = __reduce_max_sync(0xffffffffu, ilo);
    ihi = __reduce_min_sync(0xffffffffu, ihi);
    if (lane == 0) {
      // Owned rows are contiguous: the sequence's rows from its first owned token on.
      const unsigned long long mask = (unsigned long long)owned[0] | ((unsigned long long)owned[1] << 32);
      tile->r0 = (long long)rt.seq_origin * num_heads + rt.rows0;
      tile->b = rt.b;
      tile->owned_lo = mask ? __ffsll((long long)mask) - 1 : 0;
      tile->owned_hi = mask ? 64 - __clzll((long long)mask) : 0;
      tile->lo = ulo;
      tile->hi = uhi;
      tile->ilo = ilo;
      tile->ihi = ihi;
    }
  }
  __syncthreads();
  return true;
}

// The start of an MLA CTA past the zero pass (every thread calls it): locate row tile x and its split plan.
// False -- after waiting for the prologue, as every CTA does before it exits -- when the CTA has nothing
// to write (a gap between sequences' tiles, no owned row, or a split past the tile's count).
template <int ROWS>
CUPA_DEVICE bool mla_begin_tile(long long x, int split, int tile_splits, int num_splits, const int* cum,
                                const int* past, int batch_size, int token_count, int num_heads,
                                const int* query_positions, long long kv_capacity, int rotary_max_pos, int is_causal,
                                int window, int* sTok, int* sHead, int* sLo, int* sHi, MlaTile* tile, MlaTile& tl,
                                MlaSplits& sp) {
  // The rows and ranges read only inputs the prologue does not write: before the wait.
  if (!mla_locate_tile<ROWS>(x, cum, past, batch_size, token_count, num_heads, query_positions, kv_capacity,
                             rotary_max_pos, is_causal, window, sTok, sHead, sLo, sHi, tile)) {
    grid_dependency_wait();
    return false;
  }
  tl = *tile;
  sp = mla_splits(tl.lo, tl.hi, tile_splits, num_splits);
  if (tl.owned_hi <= tl.owned_lo || split >= sp.count) {
    grid_dependency_wait();
    return false;
  }
  return true;
}

// Split 0 of a tile of several splits records it for paged_mla_merge (one thread; after the prologue's
// wait: the prologue zeroes the records).
CUPA_DEVICE void mla_record_tile(MlaTileRecord* records, long long x, const MlaTile& tl, const MlaSplits& sp,
                                 int split) {
  if (split == 0 && sp.count > 1 && threadIdx.x == 0) {
    MlaTileRecord rec;
    rec.row0 = (int)(tl.r0 + tl.owned_lo);
    rec.rows = tl.owned_hi - tl.owned_lo;
    rec.count = sp.count;
    rec.unused = 0;
    records[x] = rec;
  }
}

// Rows of tokens no sequence owns (t >= cum[B], or cum[find_owner(t)] > t) get zeros and lse -inf; the
// row tiles write every other row once. CTA z checks tokens z * blockDim.x + threadIdx.x; each warp
// then zeroes its unowned tokens one after the other.
template <typename T>
CUPA_DEVICE void mla_zero_pass(T* __restrict__ out, float* __restrict__ lse, const int* __restrict__ cum,
                               int batch_size, int token_count, int num_heads) {
  const int lane = threadIdx.x & 31;
  const long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  bool zero = false;
  if (t < token_count) {
    const int b = find_owner(cum, batch_size, (int)t);
    zero = b >= batch_size || __ldg(cum + b) > t;
  }
  unsigned unowned = __ballot_sync(0xffffffffu, zero);
  while (unowned) {
    const int i = __ffs(unowned) - 1;
    unowned &= unowned - 1;
    const long long tok = t - lane + i;
    uint4* row = reinterpret_cast<uint4*>(out + tok * num_heads * MLA_DV);
    for (int c = lane; c < num_heads * (MLA_DV / 8); c += 32) row[c] = make_uint4(0u, 0u, 0u, 0u);
    if (lse)
      for (int h = lane; h < num_heads; h += 32) lse[tok * num_heads + h] = CUPA_NEG_INF;
  }
}

// The first zero_ctas CTAs of an MLA grid: the zero pass (split 0), then the prologue wait every CTA makes
// before it exits. True for them.
template <typename T>
CUPA_DEVICE bool mla_zero_ctas(int zero_ctas, T* __restrict__ out, float* __restrict__ lse, const int* __restrict__ cum,
                               int batch_size, int token_count, int num_heads) {
  if ((int)blockIdx.x >= zero_ctas) return false;
  if (blockIdx.y == 0) mla_zero_pass<T>(out, lse, cum, batch_size, token_count, num_heads);
  grid_dependency_wait();
  return true;
}

// Output of one thread's accumulator block: rows row0 and row0 + 8 of the tile (i = 0, 1; written only
// where write[i]), channels ch0 + 8j + 2(lane % 4) + {0, 1} for j < NT, value o(j, 2i + e) -- the
// m16n8 C-fragment layout of mma.sync and of every wgmma accumulator. direct: finalized into `out`
// (QUANT: times the V scale of the channel, k_scale's: the latent's own); else this split's fp32
// partial into part_o.
template <typename T, int NT, bool QUANT, typename Acc>
CUPA_DEVICE void mla_store_o(const Acc& o, int lane, int row0, int ch0, const float (&M)[2], const float (&L)[2],
                             const bool (&write)[2], long long r0, int split, int num_splits, bool direct,
                             const float* k_scale, int k_quant, T* __restrict__ out, float* __restrict__ part_o) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    if (!write[i]) continue;
    const long long R = r0 + row0 + 8 * i;
    // finalize() of a unit O is the row's factor (1/L; 0 without admitted keys)
    const float factor = finalize(M[i], L[i], 1.0f, false, 0.0f, 1.0f);
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const int ch = ch0 + 8 * j + 2 * (lane & 3);
      const float v0 = o(j, 2 * i), v1 = o(j, 2 * i + 1);
      if (direct) {
        float s0 = factor, s1 = factor;
        if (QUANT) {
          s0 *= quant_scale(k_scale, k_quant, 0, MLA_D, ch);
          s1 *= quant_scale(k_scale, k_quant, 0, MLA_D, ch + 1);
        }
        T pair[2] = {Act<T>::from_float(v0 * s0), Act<T>::from_float(v1 * s1)};
        *reinterpret_cast<unsigned*>(out + R * MLA_DV + ch) = *reinterpret_cast<const unsigned*>(pair);
      } else {
        *reinterpret_cast<float2*>(part_o + (R * num_splits + split) * MLA_DV + ch) = make_float2(v0, v1);
      }
    }
  }
}

// The per-row state of tile row `row` (owned): lse when direct (and asked for), else this split's (M, L).
CUPA_DEVICE void mla_store_state(float M, float L, long long R, int split, int num_splits, bool direct,
                                 float* __restrict__ lse, float2* __restrict__ part_ml) {
  if (direct) {
    if (lse) lse[R] = state_lse(M, L);
  } else {
    part_ml[R * num_splits + split] = make_float2(M, L);
  }
}

// The keys of one CTA: [kbeg, kend) = the tile's union range within its split `split` (mla_splits), walked
// in key tiles from korg (kbeg rounded down to `align`; keys below kbeg are masked).
struct MlaKeys {
  int kbeg, kend, korg, ntiles;
};
CUPA_DEVICE MlaKeys mla_keys(const MlaTile& tl, const MlaSplits& sp, int split, int keys_per_tile, int align) {
  MlaKeys k;
  k.kbeg = k.kend = k.korg = k.ntiles = 0;
  if (tl.hi > tl.lo) {
    k.kbeg = (int)max((long long)tl.lo, sp.base + (long long)split * sp.chunk);
    k.kend = (int)min((long long)tl.hi, sp.base + (long long)(split + 1) * sp.chunk);
    k.korg = k.kbeg - k.kbeg % align;
    if (k.kend > k.kbeg) k.ntiles = (k.kend - k.korg + keys_per_tile - 1) / keys_per_tile;
  }
  return k;
}

// Cache row (slot) of key k for a CTA of sequence b, or MLA_NO_ROW: outside [kbeg, kend), or unmapped.
CUPA_DEVICE unsigned mla_key_row(int k, const MlaKeys& keys, const int* block_table, int max_blocks, int num_blocks,
                                 int block_size, const FastDiv& block_div, int b) {
  if (k < keys.kbeg || k >= keys.kend) return MLA_NO_ROW;
  const int index = block_div.div(k);
  const int blk = physical_block(block_table, max_blocks, num_blocks, b, index);
  return blk < 0 ? MLA_NO_ROW : (unsigned)blk * (unsigned)block_size + (unsigned)(k - index * block_size);
}
