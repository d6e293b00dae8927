// Which V tiles of a work item of the warp-specialized wgmma prefill (prefill_wgmma_ws.cu) are
// cleaned of Inf / NaN, the mbarrier phases that follow from that, and the score masks of a key tile
// (wg_softmax_tile, also the wgmma MLA kernel's): plain functions, also host functions
// (tests/test_prefill_ws_plan.py compiles them for the host and checks them against a brute-force
// model). KEYS is the key tile (128 in the prefill).
#pragma once
#include "common.cuh"

#ifndef CUPA_HOST_DEVICE
#define CUPA_HOST_DEVICE __host__ __device__ __forceinline__
#endif

CUPA_HOST_DEVICE int ws_max(int a, int b) { return a > b ? a : b; }
CUPA_HOST_DEVICE int ws_min(int a, int b) { return a < b ? a : b; }

// The keys of the tile from kt0 whose V rows are cleaned of Inf / NaN before its P V: those some live
// row of the item does not admit (outside `in`, the item's intersection of admitted ranges), within the
// unmasked keys [kmin, khi), as [a, hi1) and [lo2, b); false when there are none (every other key either
// meets a P that some admitting row computes, or was zero-filled). ws_clean_tiles gives the tiles for
// which it is true, once per item: the copiers send exactly those to v_land, and the scheduler cleans
// exactly those.
template <int KEYS>
CUPA_HOST_DEVICE bool ws_clean_keys(int kt0, int2 in, int kmin, int khi, int& a, int& hi1, int& lo2, int& b) {
  if (kt0 >= in.x && kt0 + KEYS <= in.y) return false;
  a = ws_max(kt0, kmin);
  b = ws_min(kt0 + KEYS, khi);
  const bool none = in.x >= in.y;  // (no key every live row admits)
  hi1 = none ? b : ws_min(b, in.x);
  lo2 = none ? b : ws_max(a, in.y);
  return hi1 > a || b > lo2;
}

// The tiles of an item (origin klo, unmasked keys [kmin, khi), intersection in, ntiles tiles) for which
// ws_clean_keys is true: kt < x or kt >= y of the result (y >= x). A tile's unmasked keys lie inside `in`
// unless it starts below in.x with kmin < in.x, or ends above in.y with khi > in.y (in lies in [kmin, khi)
// when not empty; when empty, every tile has keys to clean).
template <int KEYS>
CUPA_HOST_DEVICE int2 ws_clean_tiles(int klo, int kmin, int khi, int2 in, int ntiles) {
  if (in.x >= in.y) return make_int2(ntiles, ntiles);
  const int x = kmin < in.x ? (in.x - klo + KEYS - 1) / KEYS : 0;
  return make_int2(x, ws_max(x, khi > in.y ? (in.y - klo) / KEYS : ntiles));  // (y >= x)
}

// Bit s: the parity of the number of a CTA's tiles [p, q) in stage s (= index % 2, two stages).
CUPA_HOST_DEVICE unsigned ws_stage_parity(unsigned p, unsigned q) {
  return (((q + 1) / 2 - (p + 1) / 2) & 1u) | (((q / 2 - p / 2) & 1u) << 1);
}

// The v_land parities after an item (its first tile is the CTA's tile first_tile; tiles to clean
// `clean` from ws_clean_tiles): those at its start, land_parity, flipped by its tiles to clean.
CUPA_HOST_DEVICE unsigned ws_land_after(unsigned first_tile, int ntiles, int2 clean, unsigned land_parity) {
  const unsigned f = first_tile, nt = (unsigned)ntiles, x = (unsigned)clean.x < nt ? (unsigned)clean.x : nt;
  const unsigned y0 = (unsigned)ws_max(clean.x, clean.y), y = y0 > x ? y0 : x;
  return land_parity ^ ws_stage_parity(f, f + x) ^ (y < nt ? ws_stage_parity(f + y, f + nt) : 0u);
}

// Bits [0, n) set, n clamped to [0, 32].
CUPA_HOST_DEVICE unsigned ws_bits_below(int n) {
#ifdef __CUDA_ARCH__
  return __funnelshift_lc(0xffffffffu, 0u, (unsigned)max(n, 0));  // the high word of (0 : ~0) << n
#else
  return n <= 0 ? 0u : n >= 32 ? 0xffffffffu : (1u << n) - 1u;
#endif
}

// The masks of a thread's two rows of a key tile (keys kt0 .. kt0 + KEYS - 1) on the wgmma accumulator
// layout: row row0 + 8 i admits [lo_row[..], hi_row[..]) and the tile's mapped keys (bit t of mw[w]: key
// 32 w + t); the thread of lane holds its columns 8 j + 2 (lane % 4) + e (j < KEYS / 8, e < 2) as
// s[4 j + 2 i + e], and those the row does not admit become `masked`. Per 32 keys the admitted keys are
// the range as bits ANDed with the mapped ones; shifted by the lane's first column 2 (lane % 4),
// element (j, e) is bit 8 (j % 4) + e of word j / 4.
template <int KEYS>
CUPA_HOST_DEVICE void ws_mask_rows(float (&s)[KEYS / 2], const int* lo_row, const int* hi_row, int row0, int kt0,
                                   const unsigned (&mw)[KEYS / 32], int lane, float masked) {
  const int q2 = (lane & 3) * 2;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int a = min(max(lo_row[row0 + 8 * i], kt0), kt0 + KEYS) - kt0;  // (no overflow from the
    const int b = min(max(hi_row[row0 + 8 * i], kt0), kt0 + KEYS) - kt0;  // empty-range sentinels)
#pragma unroll
    for (int w = 0; w < KEYS / 32; ++w) {
      const unsigned bits = ((ws_bits_below(b - 32 * w) & ~ws_bits_below(a - 32 * w)) & mw[w]) >> q2;
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& x = s[4 * (4 * w + jj) + 2 * i + e];
          x = (bits >> (8 * jj + e)) & 1u ? x : masked;
        }
      }
    }
  }
}

// The parity of the phase an item's tile kt to clean waits for (on v_land, or with the copiers' clean on their
// own land barriers): its stage's bit of land_parity, flipped by the item's earlier tiles to clean there.
CUPA_HOST_DEVICE unsigned ws_land_at(unsigned first_tile, int kt, int ntiles, int2 clean, unsigned land_parity) {
  const unsigned f = first_tile, k = (unsigned)kt, nt = (unsigned)ntiles;
  const unsigned x = (unsigned)clean.x < nt ? (unsigned)clean.x : nt;
  const unsigned y0 = (unsigned)ws_max(clean.x, clean.y), y = y0 > x ? y0 : x;
  const unsigned bits =
      land_parity ^ ws_stage_parity(f, f + (k < x ? k : x)) ^ (k > y ? ws_stage_parity(f + y, f + k) : 0u);
  return (bits >> ((f + k) & 1u)) & 1u;
}

// ---- 8-bit codes widened in place (prefill_wgmma_ws.cu, the copiers' widen_rows) ----------------------
// Byte offsets from a K or V tile of KEYS rows. Codes land in slab 1 (bytes KEYS 128 ..): row r's 128 codes
// as one 128-byte row, chunk k (codes of channels 16k..16k+15) at k ^ (r % 8), the 128-byte swizzle TMA
// writes and the copiers' cp.async gathers follow.
template <int KEYS> CUPA_HOST_DEVICE unsigned ws_code_chunk(int r, int k) {
  return (unsigned)(KEYS * 128 + r * 128 + ((k ^ (r & 7)) << 4));
}
// Widened, row r's 16-byte chunk h (channels 8h..8h+7 of T) sits where wgmma reads it (wg_off): slab h / 8,
// chunk h % 8 at (h % 8) ^ (r % 8).
template <int KEYS> CUPA_HOST_DEVICE unsigned ws_wide_chunk(int r, int h) {
  return (unsigned)((h >> 3) * (KEYS * 128) + r * 128 + (((h & 7) ^ (r & 7)) << 4));
}
// Step j of copier warp cw (its rows cw * rows_per_warp ..), lane l: the row it widens (4 rows a step, 8 lanes
// a row); it reads code chunk l % 8 of that row and writes wide chunks 2 (l % 8) and 2 (l % 8) + 1. A row's
// codes and its slab-1 wide chunks share their bytes and one step of one warp, so a __syncwarp between the
// step's reads and writes keeps every code read before it is overwritten.
CUPA_HOST_DEVICE int ws_widen_row(int cw, int rows_per_warp, int lane, int j) {
  return cw * rows_per_warp + 4 * j + (lane >> 3);
}
// The offset of a lane's chunk at step j from the one at step 0 (rows_per_warp a multiple of 8, so row % 8 < 4
// at step 0): 4 j rows on, with row % 8 flipped by 4 at odd steps (chunk bit 2, byte bit 6).
CUPA_HOST_DEVICE unsigned ws_widen_step(unsigned at0, int j) {
  return (at0 + 512u * (unsigned)j) ^ ((unsigned)(j & 1) << 6);
}
