// Host driver of cuda_src/prefill_ws_plan.cuh (tests/test_prefill_ws_plan.py). Little-endian int32 on
// stdin and stdout:
//   tiles: records (klo, kmin, khi, in.x, in.y, ntiles) -> per record clean.x, clean.y, then per tile
//          ws_clean_keys' result (0 / 1) and its key count (hi1 - a) + (b - lo2) (0 when false)
//   land:  records (ntiles, clean.x, clean.y) of one CTA's items in order -> per item first_tile and
//          land_parity at its start, chained as the scheduler chains them
//   land_at: records (ntiles, clean.x, clean.y) as for land -> per tile to clean of each item, ws_land_at
//   mask:  records (lo0, hi0, lo1, hi1, kt0, mw[0..3], lane) -> per record the 64 scores of that lane
//          after ws_mask_rows<128> (1: kept, 0: masked), in the order of s
//   widen: no input -> per copier warp cw < 4, lane < 32, step j < 8 (the order of the loops): the row the
//          kernel's widen_rows handles, the offsets of its code chunk and of its two wide chunks (from step
//          0's by ws_widen_step, as the kernel computes them), and the cp.async destination of the
//          copier's code chunk of key 4 j + lane / 8 of the warp (ws_code_chunk)
#include <cstdio>
#include <cstring>
#include <vector>
#include "prefill_ws_plan.cuh"

constexpr int KEYS = 128;

static std::vector<int> read_all() {
  std::vector<int> v;
  int x;
  while (fread(&x, 4, 1, stdin) == 1) v.push_back(x);
  return v;
}

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  const std::vector<int> in = read_all();
  std::vector<int> out;
  if (!strcmp(argv[1], "tiles")) {
    for (size_t i = 0; i + 6 <= in.size(); i += 6) {
      const int klo = in[i], kmin = in[i + 1], khi = in[i + 2], nt = in[i + 5];
      const int2 range = make_int2(in[i + 3], in[i + 4]);
      const int2 c = ws_clean_tiles<KEYS>(klo, kmin, khi, range, nt);
      out.push_back(c.x);
      out.push_back(c.y);
      for (int kt = 0; kt < nt; ++kt) {
        int a = 0, hi1 = 0, lo2 = 0, b = 0;
        const bool t = ws_clean_keys<KEYS>(klo + kt * KEYS, range, kmin, khi, a, hi1, lo2, b);
        out.push_back(t ? 1 : 0);
        out.push_back(t ? ws_max(0, hi1 - a) + ws_max(0, b - lo2) : 0);
      }
    }
  } else if (!strcmp(argv[1], "land")) {
    unsigned first = 0, parity = 0;
    for (size_t i = 0; i + 3 <= in.size(); i += 3) {
      out.push_back((int)first);
      out.push_back((int)parity);
      const int2 c = make_int2(in[i + 1], in[i + 2]);
      parity = ws_land_after(first, in[i], c, parity);
      first += (unsigned)in[i];
    }
  } else if (!strcmp(argv[1], "land_at")) {
    unsigned first = 0, parity = 0;
    for (size_t i = 0; i + 3 <= in.size(); i += 3) {
      const int nt = in[i];
      const int2 c = make_int2(in[i + 1], in[i + 2]);
      for (int kt = 0; kt < nt; ++kt)
        if (kt < c.x || kt >= c.y) out.push_back((int)ws_land_at(first, kt, nt, c, parity));
      parity = ws_land_after(first, nt, c, parity);
      first += (unsigned)nt;
    }
  } else if (!strcmp(argv[1], "mask")) {
    for (size_t i = 0; i + 10 <= in.size(); i += 10) {
      const int lo_row[9] = {in[i], 0, 0, 0, 0, 0, 0, 0, in[i + 2]}, hi_row[9] = {in[i + 1], 0, 0, 0, 0, 0, 0, 0, in[i + 3]};
      const unsigned mw[KEYS / 32] = {(unsigned)in[i + 5], (unsigned)in[i + 6], (unsigned)in[i + 7], (unsigned)in[i + 8]};
      float s[KEYS / 2];
      for (float& x : s) x = 1.0f;
      ws_mask_rows<KEYS>(s, lo_row, hi_row, 0, in[i + 4], mw, in[i + 9], -1.0f);
      for (float x : s) out.push_back(x == 1.0f ? 1 : 0);
    }
  } else if (!strcmp(argv[1], "widen")) {
    for (int cw = 0; cw < 4; ++cw)
      for (int lane = 0; lane < 32; ++lane) {
        const int c8 = lane & 7, r0 = ws_widen_row(cw, 32, lane, 0);
        const unsigned ld = ws_code_chunk<KEYS>(r0, c8), lo = ws_wide_chunk<KEYS>(r0, 2 * c8),
                       hi = ws_wide_chunk<KEYS>(r0, 2 * c8 + 1);
        for (int j = 0; j < 8; ++j) {
          out.push_back(ws_widen_row(cw, 32, lane, j));
          out.push_back((int)ws_widen_step(ld, j));
          out.push_back((int)ws_widen_step(lo, j));
          out.push_back((int)ws_widen_step(hi, j));
          out.push_back((int)ws_code_chunk<KEYS>(cw * 32 + 4 * j + (lane >> 3), c8));
        }
      }
  } else {
    return 2;
  }
  fwrite(out.data(), 4, out.size(), stdout);
  return 0;
}
