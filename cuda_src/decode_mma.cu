// Paged flash-decoding on tensor cores (fp16/bf16 T; T, int8, fp8 or packed 4-bit caches; head_size 64/128).
// One CTA owns (query token t, KV head g, a chunk of up to 16 query heads of g's group, split s):
// the chunk's heads are the 16 rows of an mma.sync m16n8k16 tile (8 heads, the N of the tile, in
// the KEYS_AS_M loop), so each KV byte is read once per KV head and chunk. Keys of the split's
// admitted range stream through shared memory in tiles of 64 (cp.async, STAGES stages, rows
// gathered through the block table one by one, so any block_size works; masked rows are
// zero-filled). Each of the 4 warps takes 16 keys of a tile and keeps its own online-softmax
// state; the warps are merged in a fixed order, then finalized (the token's only split with
// admitted keys) or written as a partial state that the last split CTA to finish merges
// (epilogue.cuh). Reads: Q (the prologue's workspace or `query`), the caches through the block
// table, cum / past_seqlens / query_positions, head_sink, the scales. Writes: `out` (and `lse` when
// asked for: where the output is finalized), or the split partials and arrival counters; QK instances
// (head-major loop) also the scores of output_qk, which paged_general_finish completes. Host values
// that size the launch: token_count, head counts, num_splits and chunk (see decode.cu); none enters
// a mask.
//
// 16-bit caches: K and V fragments come from XOR-swizzled tiles through ldmatrix (.trans for V).
// 8-bit caches (int8, e4m3): codes stay codes in shared memory and are widened straight into
// mma fragments in registers (exact: their values are representable in fp16/bf16):
// - K: the 16 dims of each k-step are permuted so that the 4 codes a lane needs for one B
//   fragment are 4 consecutive bytes: k-step s of a 64-dim group takes dims 16c + 4s + {0..3} at
//   mma positions {2c, 2c+1, 2c+8, 2c+9} for quad lane c. The same permutation is applied to the
//   Q fragments, so Q.K is unchanged; one 16-byte load gives a lane 4 k-steps of one key.
// - V: lane (n, c) needs, for each output channel it owns, the codes of keys {2c, 2c+1, 2c+8,
//   2c+9}: it loads D/8 consecutive channels of each of those 4 rows and transposes bytes with
//   prmt. Output columns are permuted accordingly (column n of n-tile j is channel n*D/8 + j).
// Both tiles are swizzled in 16-byte chunks so these loads are free of bank conflicts (D=128).
// Packed 4-bit caches (int4, e2m1; V may be the other kind, VCache): rows of D/2 bytes, widened
// straight into fragments too (Widen8 in quant.cuh: a word of 8 codes j = 0..7 gives registers
// (j, j + 4) for j < 4):
// - K: lane c of a quad reads bytes c*D/8 .. (c+1)*D/8 of its key (all D/16 k-steps at once); word
//   x (dims d = c*D/4 + 8x + 0..7) gives k-steps 2x and 2x+1: k-step 2x + j holds dims d + 2j and
//   d + 2j + 4 at mma positions {2c, 2c+1}, d + 2j + 1 and d + 2j + 5 at {2c+8, 2c+9}; the Q
//   fragments are gathered with the same permutation. A K tile is plain rows (conflict free).
// - V: lane (n, c) reads D/16 bytes (channels n*D/8 ..) of keys {2c, 2c+1, 2c+8, 2c+9}; prmt puts
//   the same 4 channels of two keys in one word, which widens into one register per channel of the
//   key pair: the output columns are those of the 8-bit caches. Rows are placed in the V tile
//   (code4_v_offset) so that each half-warp's 8-byte loads (D=128) or warp's 4-byte loads (D=64)
//   hit every bank once.
// The K scale is folded into Q (PER_CHANNEL) or the score scale (PER_TENSOR), the V scale into
// the epilogue.
//
// Floor of the target case (H200, fp16 query, GQA 32/8, D=128, block 16, B=64, L=4096): a 4-bit
// cache reads 64 * 4096 * 8 * 128 bytes of K and as many of V, 0.27 GB, ~60 us at 4.5 TB/s; the
// target is <= 75 us for int4 and e2m1 (the 8-bit caches, 0.54 GB, ~146 us).
#include "common.cuh"
#include "epilogue.cuh"
#include "general.cuh"  // qk_entry (QK instances)
#include "mma.cuh"
#include "paged.cuh"
#include "quant.cuh"
#include "softmax.cuh"

constexpr int MMA_WARPS = 4;
constexpr int MMA_ROWS = 16;
constexpr int KEY_TILE = 64;
constexpr unsigned NO_ROW = 0xffffffffu;  // a masked key's row index

// Pipeline depth STAGES, a template parameter: 3, or 2 where 3 do not fit a CTA or keep fewer than
// 2 CTAs per SM (decode.py mma_stages, which mirrors MmaDecodeSmem). 16-bit tiles at D=128 are 32 KB
// a stage: 3 stages (103 KB) run 2 CTAs per sm_90/100 SM; 2 stages (70 KB) fit the 99 KB of an
// sm_86/89/120 CTA and run 2 CTAs per sm_80 SM. 8-bit tiles are 16 KB a stage; their registers are
// capped at 128 for 4 CTAs per SM.
template <typename Cache> struct MmaMinCtas { static constexpr int value = Cache::quantized ? 4 : 1; };

// KEYS_AS_M (a template parameter, quantized caches only): the loop with keys as the MMA's M dimension.
// S^T = K Q^T (A: the warp's 16 keys widened from codes, B: Q^T, N: 8 query heads per CTA) and
// O^T += V^T P^T (A: 16 channels x 16 keys widened from codes, B: P^T, moved from the S^T
// accumulators by movmatrix.trans). With a GQA group of 8 or fewer heads, half the MMAs and
// accumulators of the head-major loop (whose M is 16 query heads).
// 16-bit caches: the score MMAs' k-steps go to two accumulators (even / odd k-steps), summed after,
// so a tile's S is two dependent chains of D/32 MMAs instead of one of D/16 (the latency of a tile
// matters where few CTAs are left); the 8-bit loops keep one chain (no gain measured there).

// The 8x8 b16 matrix held one row-pair per lane (mma fragment layout), transposed.
CUPA_DEVICE unsigned movmatrix_trans(unsigned x) {
  unsigned y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

// Dynamic shared memory: Q, then during the key loop NST stages of K/V tiles and the row indices of
// NST + 1 tiles; after the loop the warps' states (m and l per warp and row, then o with rows
// padded to D + 4 floats: fewer bank conflicts) overwrite the stages.
template <typename T, typename Cache, int D, int NST>
struct MmaDecodeSmem {
  using C = typename Cache::storage;
  static constexpr int q_bytes = MMA_ROWS * D * 2;
  static constexpr int row_bytes = D * (int)sizeof(C) / Cache::PACK;                // a K or V row as stored
  static constexpr int stage_bytes = 2 * KEY_TILE * row_bytes;                     // K and V tiles
  static constexpr int rows_bytes = (NST + 1) * KEY_TILE * 4;  // row indices, one tile ahead
  static constexpr int combine_bytes = 2 * MMA_WARPS * MMA_ROWS * 4 + MMA_WARPS * MMA_ROWS * (D + 4) * 4;
  static constexpr int loop_bytes = q_bytes + NST * stage_bytes + rows_bytes;
  static constexpr int total = loop_bytes > combine_bytes + q_bytes ? loop_bytes : combine_bytes + q_bytes;
  static_assert(NST >= 2, "a pipeline of at least two stages");
};

// Byte offset of 16-byte chunk `chunk` of key row `key` in an 8-bit K tile (rows of D bytes).
// D=128: chunks of odd rows are moved by 4 (64 bytes), so the two keys of an 8-lane phase of a
// 16-byte load (same chunk range, adjacent rows) use disjoint banks.
template <int D> CUPA_DEVICE int code_k_offset(int key, int chunk) {
  return D == 128 ? key * 128 + ((chunk ^ ((key & 1) << 2)) << 4) : key * D + (chunk << 4);
}
// Byte offset of 16-byte chunk `chunk` of key row `key` in an 8-bit V tile. An 8-lane phase reads
// rows {r, r+2, r+4, r+6} x two chunks: D=128 XORs the chunk with key & 6. D=64 stores two rows
// per 128 bytes (row pair p = key / 2, chunk (key & 1) * 4 + chunk) XORed with 2 * (p & 3).
template <int D> CUPA_DEVICE int code_v_offset(int key, int chunk) {
  if (D == 128) return key * 128 + ((chunk ^ (key & 6)) << 4);
  const int pair = key >> 1;
  return pair * 128 + (((((key & 1) << 2) | chunk) ^ ((pair & 3) << 1)) << 4);
}

// Byte offset of 16-byte chunk `chunk` of key row `key` in a 4-bit V tile (rows of D/2 bytes).
// D=128: two rows per 128 bytes (line key/2); chunk v of key k sits in 16-byte slot
// (v & 1) | ((v >> 1) ^ b ^ m0) << 1 | (b ^ m1) << 2 with b = k & 1, m = (k >> 1) & 3: the 8-byte
// unit r (= 2v + half) of keys 2c + i (c = 0..3, i fixed) lands in 8-byte group r + 4 f(c), f a
// bijection, for each half-warp's r = 0..3 or 4..7. D=64: four rows per 128 bytes (line k/4),
// quarter (k & 3) ^ ((k >> 2) & 1): keys 2c + i take four different quarters.
template <int D> CUPA_DEVICE int code4_v_offset(int key, int chunk) {
  if (D == 128) {
    const int b = key & 1, m = (key >> 1) & 3;
    return (key >> 1) * 128 + (((chunk & 1) | (((chunk >> 1) ^ b ^ (m & 1)) << 1) | ((b ^ (m >> 1)) << 2)) << 4);
  }
  return (key >> 2) * 128 + (((key & 3) ^ ((key >> 2) & 1)) << 5) + (chunk << 4);
}

// The V words lane (r, c) of `warp` widens (4-bit V tile, see the header): channels r*D/8 ..
// r*D/8 + D/8 - 1 of the warp's keys 2c, 2c+1, 2c+8, 2c+9 (i = 0..3), D/64 words of 8 channels each.
template <int D>
CUPA_DEVICE void load_v_code4(const unsigned char* sVc, int warp, int lane, unsigned (&w)[4][D / 64]) {
  const int r = lane >> 2, c = lane & 3;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int key = warp * 16 + 2 * c + (i & 1) + (i >> 1) * 8;
    if constexpr (D == 128) {  // 8-byte unit r: chunk r / 2, half r % 2
      const uint2 v = *reinterpret_cast<const uint2*>(sVc + code4_v_offset<D>(key, r >> 1) + ((r & 1) << 3));
      w[i][0] = v.x;
      w[i][1] = v.y;
    } else {  // 4-byte unit r: chunk r / 4
      static_assert(D == 64, "head_size 64 or 128");
      w[i][0] = *reinterpret_cast<const unsigned*>(sVc + code4_v_offset<D>(key, r >> 2) + ((r & 3) << 2));
    }
  }
}

// The D/32 words of 4-bit K codes at src (a lane's D/8 bytes of a key row).
template <int D> CUPA_DEVICE void load_k_words4(const unsigned char* src, unsigned (&w)[D / 32]) {
  if constexpr (D == 128) {
    const uint4 v = *reinterpret_cast<const uint4*>(src);
    w[0] = v.x;
    w[1] = v.y;
    w[2] = v.z;
    w[3] = v.w;
  } else {
    const uint2 v = *reinterpret_cast<const uint2*>(src);
    w[0] = v.x;
    w[1] = v.y;
  }
}

// Widen8<T, Cache> (quant.cuh) with its constants in registers the CTA holds: ptxas would otherwise
// rebuild a two-constant mask-or's constant before every use. `zero` is 0 at run time (min(num_heads,
// 0)) but not to the compiler, and the shuffle keeps the value from being recomputed.
template <typename T, typename Cache> struct Widener {
  CUPA_DEVICE explicit Widener(int) {}
  CUPA_DEVICE void operator()(unsigned w, unsigned (&r)[4]) const { Widen8<T, Cache>::run(w, r); }
};
// int4: Widen8's values. bf16 as Widen8 computes them; fp16 with one shift a word: codes 1, 5 (3, 7 after
// the shift by 8) are read in place, at bits 4..7 of each half, as 1024 + 16 n, which one fma maps to n - 8
// (x / 16 - 72, exact).
template <typename T> struct Widener<T, CacheInt4> {
  unsigned magic;
  CUPA_DEVICE explicit Widener(int zero)
      : magic(__shfl_sync(0xffffffffu, Bits4<T>::int4_magic | (unsigned)zero, 0)) {}
  CUPA_DEVICE void operator()(unsigned w, unsigned (&r)[4]) const {
#pragma unroll
    for (int i = 0; i < 4; ++i) r[i] = Pair<T>::sub(((w >> (4 * i)) & 0x000f000fu) | magic, Bits4<T>::int4_bias);
  }
};
template <> struct Widener<__half, CacheInt4> {
  unsigned magic;
  CUPA_DEVICE explicit Widener(int zero)
      : magic(__shfl_sync(0xffffffffu, Bits4<__half>::int4_magic | (unsigned)zero, 0)) {}
  static CUPA_DEVICE unsigned fma_16th(unsigned x) {  // x / 16 - 72 for each half
    return Pair<__half>::bits_of(__hfma2(Pair<__half>::of_bits(x), Pair<__half>::of_bits(0x2c002c00u),
                                         Pair<__half>::of_bits(0xd480d480u)));
  }
  CUPA_DEVICE void operator()(unsigned w, unsigned (&r)[4]) const {
    const unsigned w8 = w >> 8;
    r[0] = Pair<__half>::sub((w & 0x000f000fu) | magic, Bits4<__half>::int4_bias);
    r[1] = fma_16th((w & 0x00f000f0u) | magic);
    r[2] = Pair<__half>::sub((w8 & 0x000f000fu) | magic, Bits4<__half>::int4_bias);
    r[3] = fma_16th((w8 & 0x00f000f0u) | magic);
  }
};

// Two 16-bit T values as one fragment register (lo in the low half).
template <typename T> CUPA_DEVICE unsigned pair_bits(T lo, T hi) {
  return (unsigned)*reinterpret_cast<const unsigned short*>(&lo) | ((unsigned)*reinterpret_cast<const unsigned short*>(&hi) << 16);
}

// The V codes lane (r, c) of `warp` widens into MMA fragments (8-bit V tile, see the header):
// channels r*D/8 .. r*D/8 + D/8 - 1 of the warp's keys 2c, 2c+1, 2c+8, 2c+9 (i = 0..3), as D/32
// words of 4 channels each; bank-conflict free through code_v_offset.
template <int D>
CUPA_DEVICE void load_v_codes(const unsigned char* sVc, int warp, int lane, unsigned (&w)[4][D / 32]) {
  constexpr int WORDS = D / 32;
  const int r = lane >> 2, c = lane & 3, chunk = r * (D / 8) / 16, sub = (r * (D / 8)) % 16;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int key = warp * 16 + 2 * c + (i & 1) + (i >> 1) * 8;
    const unsigned char* src = sVc + code_v_offset<D>(key, chunk) + sub;
    if constexpr (WORDS == 4) {
      const uint4 v = *reinterpret_cast<const uint4*>(src);
      w[i][0] = v.x;
      w[i][1] = v.y;
      w[i][2] = v.z;
      w[i][3] = v.w;
    } else {
      static_assert(WORDS == 2, "head_size 64 or 128");
      const uint2 v = *reinterpret_cast<const uint2*>(src);
      w[i][0] = v.x;
      w[i][1] = v.y;
    }
  }
}

// Two 16-byte cp.async copies (a K and a V chunk) of one key row, or 16 zeros into each without
// reading the sources when row == NO_ROW (one compare inside the asm: no int materialized).
CUPA_DEVICE void cp_async_16x2_unless_no_row(unsigned sk, unsigned sv, const void* gk, const void* gv, unsigned row) {
  asm volatile("{\n .reg .pred p;\n setp.eq.u32 p, %4, -1;\n cp.async.cg.shared.global [%0], [%2], 16, p;\n"
               " cp.async.cg.shared.global [%1], [%3], 16, p;\n}\n"
               ::"r"(sk), "r"(sv), "l"(gk), "l"(gv), "r"(row));
}

// The cp.async copies of one K/V tile of KEY_TILE rows gathered through the block table: each
// thread always copies the same 16-byte column of rows key0, key0 + KEY_STEP, ...; every swizzle
// used here depends only on key bits those steps leave alone, so a thread's destinations are one
// base plus constants. Tiles of 16-bit values are swizzled for ldmatrix, code tiles as above
// (BITS: the bits of a stored code, 16, 8 or 4).
template <int BITS, int D>
struct TileCopy {
  static constexpr int ROW_BYTES = D * BITS / 8;
  static constexpr int CHUNKS = ROW_BYTES / 16;
  static constexpr int THREADS = MMA_WARPS * 32;
  static constexpr int KEY_STEP = THREADS / CHUNKS;
  static constexpr int ROUNDS = KEY_TILE / KEY_STEP;
  static_assert(THREADS % CHUNKS == 0 && KEY_TILE % KEY_STEP == 0, "whole copy rounds");
  int key0;
  unsigned dk0, dv0;  // byte offsets in a stage of round 0's K and V chunks
  const char* kcol;   // this thread's 16-byte column of cache row 0 of key_cache
  unsigned long long v_minus_k;  // value_cache - key_cache in bytes (uniform)

  CUPA_DEVICE TileCopy(int tid, const char* key_cache, const char* value_cache) {
    key0 = tid / CHUNKS;
    const int chunk = tid % CHUNKS;
    // Opaque to the compiler, so that it keeps one 64-bit column pointer (one mad.wide per row)
    // instead of re-splitting it into a uniform base plus 64-bit per-thread offsets.
    asm("mov.b64 %0, %1;" : "=l"(kcol) : "l"(key_cache + chunk * 16));
    v_minus_k = reinterpret_cast<unsigned long long>(value_cache) - reinterpret_cast<unsigned long long>(key_cache);
    if constexpr (BITS == 4) {
      dk0 = key0 * ROW_BYTES + chunk * 16;
      dv0 = KEY_TILE * ROW_BYTES + code4_v_offset<D>(key0, chunk);
    } else if constexpr (BITS == 8) {
      dk0 = code_k_offset<D>(key0, chunk);
      dv0 = KEY_TILE * ROW_BYTES + code_v_offset<D>(key0, chunk);
    } else {
      dk0 = swz<D>(key0, chunk * 8) * 2;
      dv0 = KEY_TILE * ROW_BYTES + swz<D>(key0, chunk * 8) * 2;
    }
  }
  // rows: index of each key's row (of D elements) in the caches, NO_ROW for a masked key
  // (zero-filled). One mad.wide per K address, one 64-bit add per V address, one compare.
  CUPA_DEVICE void issue(unsigned stage, const unsigned* rows) const {
#pragma unroll
    for (int i = 0; i < ROUNDS; ++i) {
      const unsigned row = rows[key0 + i * KEY_STEP];
      const char* k = kcol + (unsigned long long)row * ROW_BYTES;
      cp_async_16x2_unless_no_row(stage + dk0 + i * KEY_STEP * ROW_BYTES, stage + dv0 + i * KEY_STEP * ROW_BYTES, k,
                                  k + v_minus_k, row);
    }
  }
};

template <typename T, typename Cache, int D, int STAGES, bool KEYS_AS_M, typename VCache = Cache, bool QK = false>
__global__ void __launch_bounds__(MMA_WARPS * 32, MmaMinCtas<Cache>::value) paged_decode_mma(
    const T* __restrict__ q,  // (N, H, D): prologue output
    const typename Cache::storage* __restrict__ key_cache, const typename VCache::storage* __restrict__ value_cache,
    const int* __restrict__ cum, const int* __restrict__ past, const int* __restrict__ block_table,
    const int* __restrict__ query_positions, const T* __restrict__ head_sink,
    const float* __restrict__ k_scale, const float* __restrict__ v_scale,
    T* __restrict__ out, float* __restrict__ part_o, float2* __restrict__ part_ml, int* __restrict__ counters,
    float* __restrict__ lse,
    int num_heads, int kv_num_heads, int batch_size, int num_blocks, int block_size,
    int max_blocks, int chunk, int num_splits, int rotary_max_pos, float scale, float softcap,
    int window, int is_causal, int k_quant, int v_quant, int q_is_input,
    // QK instances: output_qk (H, N, qk_width) float32, qk_mode 1 or 2 (general.cuh: qk_entry)
    float* __restrict__ output_qk, int qk_mode, int qk_width) {
  using C = typename Cache::storage;
  using L = MmaDecodeSmem<T, Cache, D, STAGES>;
  constexpr int NST = STAGES;
  static_assert(D % 64 == 0 && D <= 128, "head_size 64 or 128");
  static_assert(!KEYS_AS_M || Cache::quantized, "the keys-as-M loop reads quantized caches");
  static_assert(!(QK && KEYS_AS_M), "output_qk: the head-major loop");
  static_assert(Cache::quantized == VCache::quantized && Cache::PACK == VCache::PACK, "K and V rows of one width");
  constexpr bool PACKED = Cache::PACK == 2;  // 4-bit codes, two a byte
  constexpr int CODE_BITS = PACKED ? 4 : 8 * (int)sizeof(C);

  extern __shared__ __align__(16) unsigned char smem[];
  T* sQ = reinterpret_cast<T*>(smem);
  unsigned char* stages = smem + L::q_bytes;
  // Index of each key's row (of D elements) in the caches (NO_ROW: masked), computed one pipeline
  // step before its copies are issued, so the block-table reads never stall the copy issue. The
  // host sends caches of fewer than NO_ROW rows here (uses_mma in decode.py).
  unsigned* sRows = reinterpret_cast<unsigned*>(stages + NST * L::stage_bytes);

  const int t = blockIdx.x, split = blockIdx.z;
  const int H = num_heads, Hk = kv_num_heads, G = H / Hk;
  constexpr bool T8 = KEYS_AS_M;
  constexpr int HEADS = T8 ? 8 : MMA_ROWS;  // query heads per CTA
  const int row_chunks = (G + HEADS - 1) / HEADS;
  const int g = blockIdx.y / row_chunks;
  const int h0 = g * G + (blockIdx.y % row_chunks) * HEADS;
  const int nh = min(HEADS, g * G + G - h0);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;

  const TokenInfo info = locate_token_warp(t, cum, past, batch_size, query_positions,
                                           (long long)max_blocks * block_size, rotary_max_pos, lane);
  int lo = 0, hi = 0;
  if (info.valid) key_range(info, is_causal, window, lo, hi);
  int s_first, s_last;
  split_span(lo, hi, chunk, num_splits, s_first, s_last);
  if (split < s_first || split > s_last) {  // no admitted key in this split: nothing to merge
    grid_dependency_wait();  // (every CTA waits before it exits: see common.cuh)
    return;
  }
  const bool direct = s_first == s_last;
  lo = max(lo, split * chunk);
  hi = (int)min((long long)hi, (long long)(split + 1) * chunk);
  const int ntiles = hi > lo ? (hi - lo + KEY_TILE - 1) / KEY_TILE : 0;

  const bool block_pow2 = (block_size & (block_size - 1)) == 0;
  const int block_shift = __ffs(block_size) - 1;
  // Row offsets of tile `tile` into slot tile % (NST + 1); threads 0..63 take one key each.
  auto find_rows = [&](int tile) {
    if (tid < KEY_TILE) {
      const int k = lo + tile * KEY_TILE + tid;
      // Shifts for a power-of-two block_size (the usual case), a division otherwise.
      const int kb = block_pow2 ? k >> block_shift : k / block_size;
      const int ko = block_pow2 ? k & (block_size - 1) : k - kb * block_size;
      int blk = -1;
      if (tile < ntiles && k < hi) blk = physical_block(block_table, max_blocks, num_blocks, info.b, kb);
      sRows[(tile % (NST + 1)) * KEY_TILE + tid] =
          blk >= 0 ? ((unsigned)blk * (unsigned)block_size + (unsigned)ko) * (unsigned)Hk + (unsigned)g : NO_ROW;
    }
  };
  const TileCopy<CODE_BITS, D> copier(tid, reinterpret_cast<const char*>(key_cache),
                                                 reinterpret_cast<const char*>(value_cache));
  const unsigned stages_addr = smem_addr(stages);
  auto load_tile_at = [&](int tile, int stage) {  // stage == tile % NST
    copier.issue(stages_addr + stage * L::stage_bytes, sRows + (tile % (NST + 1)) * KEY_TILE);
  };
  auto load_tile = [&](int tile) { load_tile_at(tile, tile % NST); };

  // Q rows (K scale folded in per channel), zero rows past the chunk's heads.
  auto load_q = [&]() {
    for (int c = tid; c < MMA_ROWS * (D / 8); c += blockDim.x) {
      const int r = c / (D / 8), col = (c % (D / 8)) * 8;
      float v[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = 0.0f;
      if (r < nh && ntiles > 0) {
        load8(q + ((long long)t * H + h0 + r) * D + col, v);
        if (k_quant == QUANT_PER_CHANNEL) {
#pragma unroll
          for (int i = 0; i < 8; ++i) v[i] *= k_scale[g * D + col + i];
        }
      }
      store8(sQ + swz<D>(r, col), v);
    }
  };
  // What does not depend on the prologue comes first, so that with a programmatic launch it overlaps
  // the prologue: Q when it is `query` itself (q_is_input: the prologue never writes it) and the
  // block-table reads; then wait for the prologue's Q workspace, cache rows and counters.
  if (q_is_input) load_q();
#pragma unroll
  for (int s = 0; s < NST; ++s) find_rows(s);
  grid_dependency_wait();
  if (!q_is_input) load_q();
  __syncthreads();  // sQ, row offsets of the first NST tiles
#pragma unroll
  for (int s = 0; s < NST - 1; ++s) {
    if (s < ntiles) load_tile(s);
    cp_async_commit();
  }

  unsigned qf[D / 16][4];
  if constexpr (PACKED) {
    // k-step 2x + j of lane c: dims d + 2j, d + 2j + 4 (positions 2c, 2c+1) and d + 2j + 1, d + 2j + 5
    // (2c+8, 2c+9), d = c*D/4 + 8x (see the header).
    const int r = lane >> 2, c = lane & 3;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const int d = c * (D / 4) + 8 * (kk >> 1) + 2 * (kk & 1);
#pragma unroll
      for (int h = 0; h < 2; ++h) {  // rows r, r + 8
        qf[kk][h] = pair_bits<T>(sQ[swz<D>(r + 8 * h, d)], sQ[swz<D>(r + 8 * h, d + 4)]);
        qf[kk][2 + h] = pair_bits<T>(sQ[swz<D>(r + 8 * h, d + 1)], sQ[swz<D>(r + 8 * h, d + 5)]);
      }
    }
  } else if constexpr (Cache::quantized) {
    // Permuted k-steps (see the header): k-step 4h + s holds dims 64h + 16c + 4s + {0,1 | 2,3}.
    const int r = lane >> 2, c = lane & 3;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const int col = (kk >> 2) * 64 + 16 * c + 4 * (kk & 3);
      qf[kk][0] = *reinterpret_cast<const unsigned*>(sQ + swz<D>(r, col));
      qf[kk][1] = *reinterpret_cast<const unsigned*>(sQ + swz<D>(r + 8, col));
      qf[kk][2] = *reinterpret_cast<const unsigned*>(sQ + swz<D>(r, col + 2));
      qf[kk][3] = *reinterpret_cast<const unsigned*>(sQ + swz<D>(r + 8, col + 2));
    }
  } else {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) ldmatrix_x4(qf[kk], sQ + swz<D>(lane & 15, kk * 16 + (lane >> 4) * 8));
  }
  const float score_scale = scale * (k_quant == QUANT_PER_TENSOR ? k_scale[0] : 1.0f);
  const float score_scale2 = score_scale * CUPA_LOG2E;
  float* cm = reinterpret_cast<float*>(stages);                 // [warp][row]
  float* cl = cm + MMA_WARPS * MMA_ROWS;                         // [warp][row]
  float* co = cl + MMA_WARPS * MMA_ROWS;                         // [warp][row][D]
  const Widener<T, Cache> widen_k(min(num_heads, 0));  // (4-bit caches)
  const Widener<T, VCache> widen_v(min(num_heads, 0));
  if constexpr (T8) {
    // Keys as M. Lane (r, c) = (lane / 4, lane % 4) holds scores of keys r and r + 8 of its warp's 16
    // and query heads 2c, 2c + 1 (the n-tile's 8 heads); output channels r * D/8 + 4x + {0, 1}
    // (m-tile 2x) and + {2, 3} (m-tile 2x + 1), rows r and r + 8 of the m-tile.
    constexpr int MT = D / 16, WORDS = D / 32;
    const int r = lane >> 2, c = lane & 3;
    float ot[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) ot[mt][0] = ot[mt][1] = ot[mt][2] = ot[mt][3] = 0.0f;
    float mh[2] = {CUPA_NEG_INF, CUPA_NEG_INF}, lh[2] = {0.0f, 0.0f};

    // (4-bit) the lane's byte offsets in a stage of its K row (key r; key r + 8 is 8 rows on) and V words
    const unsigned k4_off = (warp * 16 + r) * (D / 2) + c * (D / 8);
    unsigned v4_off[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int key = warp * 16 + 2 * c + (i & 1) + (i >> 1) * 8;
      v4_off[i] = KEY_TILE * (D / 2) + (D == 128 ? code4_v_offset<D>(key, r >> 1) + ((r & 1) << 3)
                                                 : code4_v_offset<D>(key, r >> 2) + ((r & 3) << 2));
      v4_off[i] = __shfl_sync(0xffffffffu, v4_off[i], lane);  // (kept in a register, not recomputed per tile)
    }
    int stage = 0;  // tile % NST
    for (int tile = 0; tile < ntiles; ++tile) {
      cp_async_wait<NST - 2>();
      __syncthreads();
      if (tile + NST - 1 < ntiles) load_tile_at(tile + NST - 1, stage == 0 ? NST - 1 : stage - 1);
      cp_async_commit();
      if (tile + NST < ntiles) find_rows(tile + NST);  // read after the next barrier
      const unsigned char* st = stages + stage * L::stage_bytes;
      stage = stage == NST - 1 ? 0 : stage + 1;

      // S^T = K Q^T: one 16-byte load per key and 64-dim group gives 4 k-steps (the permuted dims
      // of the header); A rows r and r + 8 are keys r and r + 8.
      float sc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      const int k0 = warp * 16 + r;
      if constexpr (PACKED) {  // keys r, r + 8: a word of each per two k-steps (Widen8 pairs, see the header)
        unsigned w0[D / 32], w1[D / 32];
        load_k_words4<D>(st + k4_off, w0);
        load_k_words4<D>(st + k4_off + 8 * (D / 2), w1);
#pragma unroll
        for (int x = 0; x < D / 32; ++x) {
          unsigned a0[4], a1[4];
          widen_k(w0[x], a0);
          widen_k(w1[x], a1);
          const unsigned lo[4] = {a0[0], a1[0], a0[1], a1[1]}, hi[4] = {a0[2], a1[2], a0[3], a1[3]};
          Mma<T>::run(sc, lo, qf[2 * x][0], qf[2 * x][2]);
          Mma<T>::run(sc, hi, qf[2 * x + 1][0], qf[2 * x + 1][2]);
        }
      } else {
#pragma unroll
        for (int h = 0; h < D / 64; ++h) {
          const uint4 w0 = *reinterpret_cast<const uint4*>(st + code_k_offset<D>(k0, h * 4 + c));
          const uint4 w1 = *reinterpret_cast<const uint4*>(st + code_k_offset<D>(k0 + 8, h * 4 + c));
          const unsigned ws0[4] = {w0.x, w0.y, w0.z, w0.w}, ws1[4] = {w1.x, w1.y, w1.z, w1.w};
#pragma unroll
          for (int q4 = 0; q4 < 4; ++q4) {
            unsigned a[4];
            Widen4<T, Cache>::run(ws0[q4], a[0], a[2]);
            Widen4<T, Cache>::run(ws1[q4], a[1], a[3]);
            Mma<T>::run(sc, a, qf[h * 4 + q4][0], qf[h * 4 + q4][2]);
          }
        }
      }
      const unsigned* rows = sRows + (tile % (NST + 1)) * KEY_TILE + warp * 16;
      const bool dead0 = rows[r] == NO_ROW, dead1 = rows[r + 8] == NO_ROW;
      unsigned pb[2];  // P^T as B fragments (keys 2c, 2c+1 | 2c+8, 2c+9 of head r)
      bool moved = false;
      float ch[2];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        sc[e] = softcap > 0.0f ? softcap_score(sc[e] * score_scale, softcap) * CUPA_LOG2E : sc[e] * score_scale2;
        if (e < 2 ? dead0 : dead1) sc[e] = CUPA_NEG_INF;
      }
      float p[4];
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        float mx = fmaxf(sc[j], sc[j + 2]);
#pragma unroll
        for (int off = 4; off < 32; off <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
        const float n = fmaxf(mh[j], mx);
        ch[j] = mh[j] == CUPA_NEG_INF ? 0.0f : ex2_approx(mh[j] - n);
        mh[j] = n;
        const float b = n == CUPA_NEG_INF ? 0.0f : n;
        p[j] = ex2_approx(sc[j] - b);
        p[j + 2] = ex2_approx(sc[j + 2] - b);
        lh[j] = lh[j] * ch[j] + (p[j] + p[j + 2]);
        moved |= ch[j] != 1.0f;
      }
      pb[0] = movmatrix_trans(Mma<T>::pack(p[0], p[1]));
      pb[1] = movmatrix_trans(Mma<T>::pack(p[2], p[3]));
      if (__any_sync(0xffffffffu, moved)) {  // the running max rarely moves in decode
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          ot[mt][0] *= ch[0];
          ot[mt][1] *= ch[1];
          ot[mt][2] *= ch[0];
          ot[mt][3] *= ch[1];
        }
      }
      // O^T += V^T P^T: lane (r, c) loads channels r*D/8 .. r*D/8 + D/8 - 1 of keys {2c, 2c+1, 2c+8,
      // 2c+9}; byte pairs of two keys are transposed with prmt and widened into A fragments.
      if constexpr (PACKED) {
        // Word x: channels 8x + 0..7 of the lane's D/8; m-tile 4x + q has channels 8x + 2q (row r) and
        // 8x + 2q + 1 (row r + 8), keys (2c, 2c+1 | 2c+8, 2c+9) from the two prmt-joined key pairs.
        unsigned w[4][D / 64];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          if constexpr (D == 128) {
            const uint2 v = *reinterpret_cast<const uint2*>(st + v4_off[i]);
            w[i][0] = v.x;
            w[i][1] = v.y;
          } else {
            w[i][0] = *reinterpret_cast<const unsigned*>(st + v4_off[i]);
          }
        }
#pragma unroll
        for (int x = 0; x < D / 64; ++x) {
#pragma unroll
          for (int hlf = 0; hlf < 2; ++hlf) {  // channels 8x + 4hlf + 0..3
            const unsigned sel = hlf ? 0x7632u : 0x5410u;
            unsigned p01[4], p89[4];  // per channel: keys (2c, 2c+1) and (2c+8, 2c+9)
            widen_v(byte_perm(w[0][x], w[1][x], sel), p01);
            widen_v(byte_perm(w[2][x], w[3][x], sel), p89);
            const unsigned a0[4] = {p01[0], p01[1], p89[0], p89[1]}, a1[4] = {p01[2], p01[3], p89[2], p89[3]};
            Mma<T>::run(ot[4 * x + 2 * hlf], a0, pb[0], pb[1]);
            Mma<T>::run(ot[4 * x + 2 * hlf + 1], a1, pb[0], pb[1]);
          }
        }
      } else {
        unsigned w[4][WORDS];
        load_v_codes<D>(st + KEY_TILE * D, warp, lane, w);
#pragma unroll
        for (int x = 0; x < WORDS; ++x) {
          unsigned a0[4], a1[4];  // m-tiles 2x (channels 4x, 4x+1) and 2x+1 (channels 4x+2, 4x+3)
          Widen4<T, Cache>::run(__byte_perm(w[0][x], w[1][x], 0x5140), a0[0], a0[1]);
          Widen4<T, Cache>::run(__byte_perm(w[2][x], w[3][x], 0x5140), a0[2], a0[3]);
          Widen4<T, Cache>::run(__byte_perm(w[0][x], w[1][x], 0x7362), a1[0], a1[1]);
          Widen4<T, Cache>::run(__byte_perm(w[2][x], w[3][x], 0x7362), a1[2], a1[3]);
          Mma<T>::run(ot[2 * x], a0, pb[0], pb[1]);
          Mma<T>::run(ot[2 * x + 1], a1, pb[0], pb[1]);
        }
      }
    }
    cp_async_wait<0>();
    __syncthreads();
    // Merge the warps in order through shared memory (the stage buffers are free now).
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      float l = lh[j];
#pragma unroll
      for (int off = 4; off < 32; off <<= 1) l += __shfl_xor_sync(0xffffffffu, l, off);
      const int head = 2 * c + j;
      if (r == 0) {
        cm[warp * MMA_ROWS + head] = mh[j] == CUPA_NEG_INF ? mh[j] : mh[j] * CUPA_LN2;
        cl[warp * MMA_ROWS + head] = l;
      }
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const int d0 = r * (D / 8) + 4 * (mt >> 1) + 2 * (mt & 1), d1 = d0 + 1;  // rows r and r + 8
      float* head0 = co + (warp * MMA_ROWS + 2 * c) * (D + 4);
      float* head1 = head0 + (D + 4);
      head0[d0] = ot[mt][0];
      head1[d0] = ot[mt][1];
      head0[d1] = ot[mt][2];
      head1[d1] = ot[mt][3];
    }
    __syncthreads();
  } else {
    float o[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m0 = CUPA_NEG_INF, m1 = CUPA_NEG_INF, l0 = 0.0f, l1 = 0.0f;

    for (int tile = 0; tile < ntiles; ++tile) {
      cp_async_wait<NST - 2>();
      __syncthreads();
      const int stage = tile % NST;
      if (tile + NST - 1 < ntiles) load_tile(tile + NST - 1);
      cp_async_commit();
      if (tile + NST < ntiles) find_rows(tile + NST);  // read after the next barrier

      // S = Q K^T for this warp's 16 keys.
      float s[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
      float s2[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};  // (16-bit caches) odd k-steps
      const unsigned char* st = stages + stage * L::stage_bytes;
      if constexpr (PACKED) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int key = warp * 16 + j * 8 + (lane >> 2);
          unsigned w[D / 32];
          load_k_words4<D>(st + key * (D / 2) + (lane & 3) * (D / 8), w);
#pragma unroll
          for (int x = 0; x < D / 32; ++x) {  // k-steps 2x, 2x + 1 (see the header)
            unsigned b[4];
            widen_k(w[x], b);
            Mma<T>::run(s[j], qf[2 * x], b[0], b[1]);
            Mma<T>::run(s[j], qf[2 * x + 1], b[2], b[3]);
          }
        }
      } else if constexpr (Cache::quantized) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int key = warp * 16 + j * 8 + (lane >> 2);
#pragma unroll
          for (int h = 0; h < D / 64; ++h) {
            const uint4 w = *reinterpret_cast<const uint4*>(st + code_k_offset<D>(key, h * 4 + (lane & 3)));
            const unsigned ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
            for (int q4 = 0; q4 < 4; ++q4) {
              unsigned b0, b1;
              Widen4<T, Cache>::run(ws[q4], b0, b1);
              Mma<T>::run(s[j], qf[h * 4 + q4], b0, b1);
            }
          }
        }
      } else {
        const T* sK = reinterpret_cast<const T*>(st);
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
          unsigned b[4];
          const int mi = lane >> 3;
          ldmatrix_x4(b, sK + swz<D>(warp * 16 + (mi >> 1) * 8 + (lane & 7), kk * 16 + (mi & 1) * 8));
          if (kk & 1) {
            Mma<T>::run(s2[0], qf[kk], b[0], b[1]);
            Mma<T>::run(s2[1], qf[kk], b[2], b[3]);
          } else {
            Mma<T>::run(s[0], qf[kk], b[0], b[1]);
            Mma<T>::run(s[1], qf[kk], b[2], b[3]);
          }
        }
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[j][e] += s2[j][e];
      }
      // Scores in log2 units (the scale times log2(e) folded into one multiply), so each
      // probability is one ex2; m0/m1 are converted back to natural units after the loop.
      const unsigned* rows = sRows + (tile % (NST + 1)) * KEY_TILE + warp * 16;
      if constexpr (QK) {
        // output_qk: the score (after scale and softcap) of each of the split's keys [lo, hi) for the chunk's
        // heads, or qk_entry's value for an unmapped one; paged_general_finish does the rest of the row.
#pragma unroll
        for (int j = 0; j < 2; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int key = j * 8 + (lane & 3) * 2 + (e & 1), r = (lane >> 2) + (e >= 2 ? 8 : 0);
            const int k = lo + tile * KEY_TILE + warp * 16 + key;
            if (r < nh && k < hi && k < qk_width) {
              const float x = s[j][e] * score_scale;
              const float score = softcap > 0.0f ? softcap_score(x, softcap) : x;
              output_qk[((long long)(h0 + r) * gridDim.x + t) * qk_width + k] =
                  qk_entry(rows[key] != NO_ROW, score, qk_mode);
            }
          }
        }
      }
      if (softcap > 0.0f) {
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            s[j][e] = softcap_score(s[j][e] * score_scale, softcap) * CUPA_LOG2E;
      } else {
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[j][e] *= score_scale2;
      }
      float mx0 = CUPA_NEG_INF, mx1 = CUPA_NEG_INF;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = j * 8 + (lane & 3) * 2 + (e & 1);
          if (rows[key] == NO_ROW) s[j][e] = CUPA_NEG_INF;
        }
        mx0 = fmaxf(mx0, fmaxf(s[j][0], s[j][1]));
        mx1 = fmaxf(mx1, fmaxf(s[j][2], s[j][3]));
      }
#pragma unroll
      for (int off = 1; off < 4; off <<= 1) {
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, off));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, off));
      }
      const float n0 = fmaxf(m0, mx0), n1 = fmaxf(m1, mx1);
      const float c0 = m0 == CUPA_NEG_INF ? 0.0f : ex2_approx(m0 - n0);
      const float c1 = m1 == CUPA_NEG_INF ? 0.0f : ex2_approx(m1 - n1);
      m0 = n0;
      m1 = n1;
      // A row with no admitted key yet has max -inf: subtract 0 instead, so ex2(-inf) gives 0.
      const float b0 = n0 == CUPA_NEG_INF ? 0.0f : n0, b1 = n1 == CUPA_NEG_INF ? 0.0f : n1;
      float p[2][4];
#pragma unroll
      for (int j = 0; j < 2; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) p[j][e] = ex2_approx(s[j][e] - (e < 2 ? b0 : b1));
      }
      l0 = l0 * c0 + (p[0][0] + p[0][1] + p[1][0] + p[1][1]);
      l1 = l1 * c1 + (p[0][2] + p[0][3] + p[1][2] + p[1][3]);
      if (__any_sync(0xffffffffu, c0 != 1.0f || c1 != 1.0f)) {  // the running max rarely moves in decode
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
          o[n][0] *= c0;
          o[n][1] *= c0;
          o[n][2] *= c1;
          o[n][3] *= c1;
        }
      }
      unsigned a[4] = {Mma<T>::pack(p[0][0], p[0][1]), Mma<T>::pack(p[0][2], p[0][3]),
                       Mma<T>::pack(p[1][0], p[1][1]), Mma<T>::pack(p[1][2], p[1][3])};
      if constexpr (PACKED) {
        // Lane (n, c): channels n*D/8 + 8x + 4hlf + e (e = 0..3) of keys (2c, 2c+1) and (2c+8, 2c+9).
        unsigned w[4][D / 64];
        load_v_code4<D>(st + KEY_TILE * (D / 2), warp, lane, w);
#pragma unroll
        for (int x = 0; x < D / 64; ++x) {
#pragma unroll
          for (int hlf = 0; hlf < 2; ++hlf) {
            const unsigned sel = hlf ? 0x7632u : 0x5410u;
            unsigned b0[4], b1[4];
            widen_v(byte_perm(w[0][x], w[1][x], sel), b0);
            widen_v(byte_perm(w[2][x], w[3][x], sel), b1);
#pragma unroll
            for (int e = 0; e < 4; ++e) Mma<T>::run(o[8 * x + 4 * hlf + e], a, b0[e], b1[e]);
          }
        }
      } else if constexpr (Cache::quantized) {
        // Lane (n, c): channels n*D/8 .. n*D/8 + D/8 - 1 of keys {2c, 2c+1, 2c+8, 2c+9}, bytes
        // transposed into (key pair, channel) words, then widened into B fragments.
        constexpr int WORDS = D / 32;  // 4-channel words per row and lane
        unsigned w[4][WORDS];
        load_v_codes<D>(st + KEY_TILE * D, warp, lane, w);
#pragma unroll
        for (int x = 0; x < WORDS; ++x) {
          unsigned b0[4], b1[4];  // per channel 4x + e: keys (2c, 2c+1) and (2c+8, 2c+9)
          Widen4<T, Cache>::run(__byte_perm(w[0][x], w[1][x], 0x5140), b0[0], b0[1]);
          Widen4<T, Cache>::run(__byte_perm(w[0][x], w[1][x], 0x7362), b0[2], b0[3]);
          Widen4<T, Cache>::run(__byte_perm(w[2][x], w[3][x], 0x5140), b1[0], b1[1]);
          Widen4<T, Cache>::run(__byte_perm(w[2][x], w[3][x], 0x7362), b1[2], b1[3]);
#pragma unroll
          for (int e = 0; e < 4; ++e) Mma<T>::run(o[4 * x + e], a, b0[e], b1[e]);
        }
      } else {
        const T* sV = reinterpret_cast<const T*>(st) + KEY_TILE * D;
#pragma unroll
        for (int nn = 0; nn < D / 16; ++nn) {
          unsigned b[4];
          const int mi = lane >> 3;
          ldmatrix_x4_trans(b, sV + swz<D>(warp * 16 + (mi & 1) * 8 + (lane & 7), nn * 16 + (mi >> 1) * 8));
          Mma<T>::run(o[2 * nn], a, b[0], b[1]);
          Mma<T>::run(o[2 * nn + 1], a, b[2], b[3]);
        }
      }
    }
    cp_async_wait<0>();
    __syncthreads();

    m0 = m0 == CUPA_NEG_INF ? m0 : m0 * CUPA_LN2;  // back to natural units for the merges
    m1 = m1 == CUPA_NEG_INF ? m1 : m1 * CUPA_LN2;
    // Merge the warps in order through shared memory (the stage buffers are free now).
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    const int r0 = lane >> 2;
    if ((lane & 3) == 0) {
      cm[warp * MMA_ROWS + r0] = m0;
      cm[warp * MMA_ROWS + r0 + 8] = m1;
      cl[warp * MMA_ROWS + r0] = l0;
      cl[warp * MMA_ROWS + r0 + 8] = l1;
    }
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      // Column k of n-tile n is channel n*8 + k (16-bit caches) or k*D/8 + n (8-bit caches).
      const int k = (lane & 3) * 2;
      const int d0 = Cache::quantized ? k * (D / 8) + n : n * 8 + k;
      const int d1 = Cache::quantized ? d0 + D / 8 : d0 + 1;
      float* row0 = co + (warp * MMA_ROWS + r0) * (D + 4);
      float* row1 = co + (warp * MMA_ROWS + r0 + 8) * (D + 4);
      row0[d0] = o[n][0];
      row0[d1] = o[n][1];
      row1[d0] = o[n][2];
      row1[d1] = o[n][3];
    }
    __syncthreads();
  }

  store_rows<T>(cm, cl, co, MMA_WARPS, MMA_ROWS, D + 4, nh, D, t, h0, H, g, split, num_splits, direct, head_sink,
                v_scale, v_quant, out, part_o, part_ml, lse);
  if (!direct)
    merge_splits_if_last<T, D / 32, 4>(counters + (long long)t * gridDim.y + blockIdx.y, reinterpret_cast<int*>(sRows),
                                       s_first, s_last, nh, D, t, h0, H, g, num_splits, head_sink, v_scale, v_quant, out,
                                       part_o, part_ml, lse);
}
