// Pieces shared by the prefill kernels (prefill.cu: mma.sync; prefill_wgmma_ws.cu: sm_90a wgmma):
// the tile numbering over a ragged batch (owner_origin, seq_first_tile, tile_owner), each row's
// token and admitted range, new keys read from the key / value inputs, the zero pass for tokens no
// sequence owns, a division by the run-time block size without a divide, and the shared-space
// ldmatrix wrappers.
#pragma once
#include "common.cuh"
#include "mma.cuh"
#include "paged.cuh"
#include "softmax.cuh"

constexpr int RANGE_NONE_LO = 0x7fffffff;  // neutral elements of min/max over empty key ranges
constexpr int RANGE_NONE_HI = -0x7fffffff - 1;

// n / d for 0 <= n < 2^31 and a run-time d >= 1 without a division: q = (umulhi(n, mul) + n) >> shift
// with shift = ceil(log2 d), mul = floor(2^32 (2^shift - d) / d) + 1 (exact in that range).
struct FastDiv {
  unsigned mul, shift;
  CUPA_DEVICE explicit FastDiv(int d) {
    unsigned s = 0;
    while ((1ull << s) < (unsigned long long)d) ++s;
    shift = s;
    mul = (unsigned)(((1ull << 32) * ((1ull << s) - (unsigned long long)d)) / (unsigned long long)d + 1ull);
  }
  CUPA_DEVICE int div(int n) const { return (int)((__umulhi((unsigned)n, mul) + (unsigned)n) >> shift); }
};

// ldmatrix on shared-space addresses (no generic-to-shared conversion per use); cp.async with
// ignore-src (cp_async_16_or_zero) is in mma.cuh, ex2_approx in softmax.cuh.
CUPA_DEVICE void ldsm_x4(unsigned (&r)[4], unsigned saddr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(saddr));
}
CUPA_DEVICE void ldsm_x4_trans(unsigned (&r)[4], unsigned saddr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(saddr));
}

// The first packed token whose owner (find_owner in paged.cuh) is >= b, clamped to [0, N].
// find_owner is non-decreasing in t for ANY cum (each probe's test cum[mid+1] > t can only turn
// from true to false as t grows), so sequence b owns only tokens in [origin(b), origin(b+1)):
// these intervals never overlap, whatever cum holds. Walking the search path toward b, a left turn
// at probe c contributes min(c, .) and a right turn max(c, .) to that first token; the walk keeps
// their composition as a clamp [lo_t, hi_t] and the answer is lo_t.
CUPA_DEVICE int owner_origin(const int* cum, int batch_size, int b, int token_count) {
  long long lo_t = -(1LL << 40), hi_t = 1LL << 40;
  int lo = 0, hi = batch_size;
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    const long long c = __ldg(cum + mid + 1);
    if (b <= mid) {
      hi_t = max(lo_t, min(hi_t, c));
      hi = mid;
    } else {
      lo_t = min(hi_t, max(lo_t, c));
      lo = mid + 1;
    }
  }
  return (int)min(max(lo_t, 0LL), (long long)token_count);
}

// First tile index of sequence b on the shared tile axis: floor(origin(b)*G / rows) + b.
// Strictly increasing in b, and sequence b's tiles [first(b), first(b) + ceil((origin(b+1) -
// origin(b))*G / rows)) end at or before first(b+1).
CUPA_DEVICE long long seq_first_tile(const int* cum, int batch_size, int b, int token_count, int group, int rows) {
  return (long long)owner_origin(cum, batch_size, b, token_count) * group / rows + b;
}

// The sequence whose tiles hold tile x: the largest b in [0, B) with seq_first_tile(b) <= x, or -1.
// The whole warp searches (32 probes a round: log32(B) rounds of one origin walk each).
CUPA_DEVICE int tile_owner(const int* cum, int batch_size, int token_count, long long x, int group, int rows,
                           int lane) {
  // Invariant: lo == 0 or first_tile(lo - 1) <= x; hi == B or first_tile(hi) > x.
  int lo = 0, hi = batch_size;
  while (hi > lo) {
    const int stride = (hi - lo + 31) / 32;
    const int probe = (int)min((long long)lo + (long long)(lane + 1) * stride - 1, (long long)hi - 1);
    const bool above = seq_first_tile(cum, batch_size, probe, token_count, group, rows) > x;
    const unsigned mask = __ballot_sync(0xffffffffu, above);
    if (mask == 0) {  // the last lane probed hi - 1
      lo = hi;
      break;
    }
    const int f = __ffs(mask) - 1;
    const int new_hi = __shfl_sync(0xffffffffu, probe, f);
    const int before = __shfl_sync(0xffffffffu, probe, f > 0 ? f - 1 : 0);
    if (f > 0) lo = before + 1;
    hi = new_hi;
  }
  return lo - 1;
}

// One attention CTA's row tile: tile x of the shared axis and the sequence b that owns it.
struct RowTile {
  int b;               // the owning sequence
  int seq_origin;      // packed token of the sequence's row 0 (owner_origin)
  int seq_cum;         // cum[b]: tokens before it have no owner (the zero pass writes them)
  long long rows0;     // the tile's first row within the sequence's rows
  long long seq_rows;  // the sequence's rows (tokens x G)
};

// Locate tile x (the whole warp; every warp computes the same, so exits are uniform). False when
// the CTA has no rows: no owner, or a gap between two sequences' tiles.
template <int ROWS>
CUPA_DEVICE bool locate_row_tile(const int* cum, int batch_size, int token_count, long long x, int group,
                                 int lane, RowTile& rt) {
  rt.b = tile_owner(cum, batch_size, token_count, x, group, ROWS, lane);
  if (rt.b < 0) return false;
  rt.seq_origin = owner_origin(cum, batch_size, rt.b, token_count);
  rt.rows0 = (x - ((long long)rt.seq_origin * group / ROWS + rt.b)) * ROWS;
  rt.seq_rows = ((long long)owner_origin(cum, batch_size, rt.b + 1, token_count) - rt.seq_origin) * group;
  if (rt.rows0 >= rt.seq_rows) return false;
  rt.seq_cum = __ldg(cum + rt.b);
  return true;
}

// Tile x of the bounded numbering (tiles_per_seq T > 0, from attention_metadata's max_query_len_bound:
// at most T tiles a sequence): tile x % T of sequence x / T, no search. Under an undersized bound a
// sequence's tiles past T are dropped (contract §4.5); every row stays inside its sequence.
template <int ROWS>
CUPA_DEVICE bool locate_bounded_tile(const int* cum, int batch_size, int token_count, long long x, int tiles_per_seq,
                                     int group, RowTile& rt) {
  rt.b = (int)(x / tiles_per_seq);
  if (x < 0 || rt.b >= batch_size) return false;
  rt.seq_origin = owner_origin(cum, batch_size, rt.b, token_count);
  rt.rows0 = (x % tiles_per_seq) * ROWS;
  rt.seq_rows = ((long long)owner_origin(cum, batch_size, rt.b + 1, token_count) - rt.seq_origin) * group;
  if (rt.rows0 >= rt.seq_rows) return false;
  rt.seq_cum = __ldg(cum + rt.b);
  return true;
}

// ---- new keys read from the call's own key / value inputs ----------------------------------------
// When the prologue stores K and V unchanged -- key and value given apart, a T cache, no rotary, no
// QK-norm, derived slots, no query_positions (prefill.py kv_from_inputs decides from static facts) --
// the row of sequence b's new token j is copied as it is to cache position past_b + j. A CTA whose
// admitted keys all lie in [lo, hi), the positions of tokens sequence b owns, reads its K/V tiles
// from `key` / `value` instead (the same bits; the same row layout, Hk * D elements per token with
// head g at g * D: only the base pointers and the row index change), so it needs nothing the
// prologue writes and never waits for it: in a call without a past, no attention CTA waits and the
// two kernels run side by side. Any other CTA -- one that reads a past, or a position whose token is
// not sequence b's (a malformed cum) -- reads the cache after grid_dependency_wait, as without
// inputs. Block masking is the same for both sources (an unmapped block is masked, and the prologue
// writes nothing there either).
struct NewKeys {
  int lo, hi;      // positions of the sequence's own new tokens, [lo, hi) (empty without inputs)
  int tok_shift;   // packed token of new position k: k + tok_shift (mod 2^32: new_token_row)
};

// Packed token (the row of key / value) of new position k in [lo, hi): k + tok_shift, which lies
// in [0, token_count); the sum is taken mod 2^32 (tok_shift = cum[b] - past_b may wrap).
CUPA_DEVICE int new_token_row(int k, int tok_shift) { return (int)((unsigned)k + (unsigned)tok_shift); }

// New-key positions of the CTA's sequence (rt.b) whose past length is past_b: the tokens owned by b
// are [max(origin(b), cum[b]), origin(b + 1)), and token t sits at position past_b + t - cum[b].
CUPA_DEVICE NewKeys new_keys(bool inputs, const RowTile& rt, int past_b, int group) {
  NewKeys nk;
  nk.lo = nk.hi = nk.tok_shift = 0;
  if (!inputs || past_b < 0) return nk;
  const long long t_lo = max(rt.seq_origin, rt.seq_cum), t_hi = rt.seq_origin + rt.seq_rows / group;
  const long long lo = (long long)past_b + (t_lo - rt.seq_cum), hi = (long long)past_b + (t_hi - rt.seq_cum);
  if (t_hi <= t_lo || hi > 0x7fffffffLL) return nk;  // none, or beyond any int position (an invalid sequence)
  nk.lo = (int)lo;
  nk.hi = (int)hi;
  nk.tok_shift = (int)((unsigned)rt.seq_cum - (unsigned)past_b);
  return nk;
}

// Row r of the tile (thread r): its token (-1: not this CTA's row), query head g*G + row % G and
// admitted key range [lo, hi) (an empty range is stored as 0, 0), into the shared arrays and lo/hi.
// Tokens in the sequence's interval have find_owner == b; those before cum[b] have no owner.
CUPA_DEVICE void locate_tile_row(const RowTile& rt, int r, int g, int group, const int* cum, const int* past,
                                 int batch_size, const int* query_positions, long long kv_capacity,
                                 int rotary_max_pos, int is_causal, int window, int* sTok, int* sHead, int* sLo,
                                 int* sHi, int& lo, int& hi) {
  const long long row = rt.rows0 + r;
  int tok = -1;
  lo = hi = 0;
  const long long tok_in_seq = row / group;
  sHead[r] = g * group + (int)(row - tok_in_seq * group);
  if (row < rt.seq_rows) {
    const int t = rt.seq_origin + (int)tok_in_seq;
    if (t >= rt.seq_cum) {
      tok = t;
      const TokenInfo info = locate_token(t, cum, past, batch_size, query_positions, kv_capacity, rotary_max_pos);
      if (info.valid) key_range(info, is_causal, window, lo, hi);
    }
  }
  if (hi <= lo) lo = hi = 0;
  sTok[r] = tok;
  sLo[r] = lo;
  sHi[r] = hi;
}

// The zero pass: CTA z zeroes the output rows of the tokens in [z*THREADS, (z+1)*THREADS) that no
// sequence owns (t >= cum[B], or cum[find_owner(t)] > t), and sets their lse rows to -inf when lse is
// given. The attention CTAs write exactly the rows of owned tokens, so every output element is
// written once per call.
template <typename T, int WARPS>
CUPA_DEVICE void prefill_zero_pass(T* __restrict__ out, const int* __restrict__ cum, int batch_size, int token_count,
                                   int num_heads, int head_size, float* __restrict__ lse = nullptr) {
  constexpr int THREADS = WARPS * 32;
  __shared__ int unowned[THREADS];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const long long t0 = (long long)blockIdx.x * THREADS;
  const long long t = t0 + tid;
  bool zero = false;
  if (t < token_count) {
    const int b = find_owner(cum, batch_size, (int)t);
    zero = b >= batch_size || __ldg(cum + b) > t;
  }
  unowned[tid] = zero;
  if (!__syncthreads_or(zero)) return;
  const long long row_chunks = (long long)num_heads * head_size / 8;  // 16-byte chunks per token
  for (int i = warp; i < THREADS; i += WARPS) {
    if (!unowned[i]) continue;
    uint4* row = reinterpret_cast<uint4*>(out + (t0 + i) * num_heads * head_size);
    for (long long c = lane; c < row_chunks; c += 32) row[c] = make_uint4(0u, 0u, 0u, 0u);
    if (lse)
      for (int h = lane; h < num_heads; h += 32) lse[(t0 + i) * num_heads + h] = CUPA_NEG_INF;
  }
}
