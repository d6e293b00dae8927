// Which V tiles of a work item of the warp-specialized wgmma prefill (prefill_wgmma_ws.cu) are
// cleaned of Inf / NaN, and the mbarrier phases that follows from: plain integer functions, also host
// functions (tests/test_prefill_ws_plan.py compiles them for the host and checks them against a
// brute-force model). KEYS is the key tile (128).
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
