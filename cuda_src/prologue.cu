// Fused prologue (contract §4.1): one pass over the new tokens.
// A CTA owns tokens_per_cta consecutive packed tokens (1 unless there are many) and every
// gridDim.y-th group of 4 of their head rows: the H query heads (unless the attention kernel reads
// an untransformed query itself), then the Hk key heads, then the Hk value heads (none in LATENT).
// Rows that are plain copies go in 16-byte chunks over all the CTA's threads; the others one warp
// per row. Few tokens: one group of rows per CTA (latency); many tokens: fewer CTAs, each doing
// more rows and then more tokens (the token lookup amortized, more bytes in flight per thread).
// TOKEN_LOOP (the prologue beside the prefill kernel, only plain K/V copies): a few 512-thread CTAs
// of many consecutive tokens each, warp k copying tokens k, k + 16, ... (cupa/kernels/prefill.py
// prologue_beside).
// A row is staged in shared memory as floats, QK-normed and rotated (Q and K rows), rounded to T,
// then Q goes to the (N, H, D) workspace the attention kernels read, and K/V are encoded into
// their cache slot: Cache for K, VCache for V (they differ only for two packed 4-bit kinds). A
// packed cache row is D/2 bytes, each byte two channels of the row (lane l writes bytes l, l + 32,
// ...), so two tokens never share a byte.
// Reads: query/key/value, cum, past_seqlens, block_table or slot_mapping, rotary and norm
// inputs, scales. Writes: the Q workspace, the cache rows of valid tokens, and zeros into the
// decode kernel's split counters when given. The launch is
// sized by token_count alone; no host value enters a mask.
#include "common.cuh"
#include "paged.cuh"
#include "quant.cuh"
#include "rope.cuh"

// Plain-copy chunks of 16 bytes a thread keeps in flight per pass (a token with more plain chunks
// than PROLOGUE_U x its team takes several passes); at most PROLOGUE_MAX_TPC tokens per CTA, no more
// than its warps (warp k copies token k's plain rows; cupa/kernels/prologue.py keeps to it).
constexpr int PROLOGUE_U = 8;
constexpr int PROLOGUE_MAX_TPC = 4;
// CTA size of the prologue that runs beside the prefill attention kernel (TOKEN_LOOP; mirrored in
// cupa/kernels/prologue.py); the others have 128 threads.
constexpr int PROLOGUE_BESIDE_THREADS = 512;
static_assert(PROLOGUE_MAX_TPC <= 128 / 32, "warp k copies token k: no more tokens per CTA than warps");

template <typename T, typename Cache, bool TOKEN_LOOP = false, typename VCache = Cache>
__global__ void __launch_bounds__(TOKEN_LOOP ? PROLOGUE_BESIDE_THREADS : 128) paged_prologue(
    const T* __restrict__ query, const T* __restrict__ key, const T* __restrict__ value,
    typename Cache::storage* __restrict__ key_cache, typename VCache::storage* __restrict__ value_cache,
    const int* __restrict__ cum, const int* __restrict__ past, const int* __restrict__ block_table,
    const T* __restrict__ cos_cache, const T* __restrict__ sin_cache, const int* __restrict__ slot_mapping,
    const T* __restrict__ q_norm_weight, const T* __restrict__ k_norm_weight,
    const float* __restrict__ k_scale, const float* __restrict__ v_scale, const int* __restrict__ query_positions,
    T* __restrict__ q_out, int* __restrict__ split_counters, int counters_per_token, int write_q,
    int num_heads, int kv_num_heads, int head_size, int batch_size, int num_blocks, int block_size,
    int max_blocks, int packed, int has_value, int rotary_dim, int rotary_max_pos, int rotary_offset,
    int rotary_interleaved, float qk_norm_epsilon, int k_quant, int v_quant, int token_count,
    int tokens_per_cta) {
  static_assert(Cache::quantized == VCache::quantized && Cache::PACK == VCache::PACK,
                "K and V caches of one storage layout");
  grid_dependency_launch_dependents();  // the attention kernel may be scheduled now (it waits for us)
  // Dynamic shared memory: one row of head_size floats per warp.
  extern __shared__ float row_smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, num_warps = blockDim.x >> 5;
  float* row = row_smem + warp * head_size;
  const int t0 = blockIdx.x * tokens_per_cta;  // this CTA's tokens: t0 .. t0 + ntok - 1
  const int ntok = min(tokens_per_cta, token_count - t0);
  // Zero the decode kernel's split-arrival counters of these tokens (null for the other backends).
  if (split_counters && blockIdx.y == 0)
    for (int i = threadIdx.x; i < ntok * counters_per_token; i += blockDim.x)
      split_counters[(long long)t0 * counters_per_token + i] = 0;

  const int H = num_heads, Hk = kv_num_heads, D = head_size;
  const int rows = H + Hk + (has_value ? Hk : 0);
  const long long q_stride = packed ? (long long)(H + 2 * Hk) * D : (long long)H * D;
  const long long kv_stride = packed ? q_stride : (long long)Hk * D;
  auto q_src_of = [&](int t) { return query + t * q_stride; };
  auto k_src_of = [&](int t) { return packed ? q_src_of(t) + H * D : key + t * kv_stride; };
  auto v_src_of = [&](int t) {
    return packed ? q_src_of(t) + (H + Hk) * D : (has_value ? value + t * kv_stride : nullptr);
  };

  // Rows stored as they come (a cache of T: V always, K without QK-norm and rotary) are plain
  // copies in 16-byte chunks, done by a team of threads per token: all of a token's threads (its
  // gridDim.y CTAs) when a CTA has one token, else warp k of the CTA for its token k. A member
  // loads its first PROLOGUE_U chunks (j = member, member + team, ...) before the token's lookup
  // (they depend on the token alone), so the loads overlap the lookup's latency; no barrier and no
  // shared memory between the two. The row loop below skips these rows.
  constexpr bool same_type = !Cache::quantized && sizeof(typename Cache::storage) == sizeof(T);
  constexpr int U = PROLOGUE_U;
  const bool k_plain = same_type && !q_norm_weight && rotary_dim == 0;
  if constexpr (same_type) {
    const int first_plain = k_plain ? H : H + Hk;  // the plain rows are [first_plain, rows)
    const int cpr = D * (int)sizeof(T) / 16;       // 16-byte chunks per row (D % 8 == 0)
    const bool cpr_pow2 = (cpr & (cpr - 1)) == 0;
    const int cpr_shift = __ffs(cpr) - 1;
    const int per_token = (rows - first_plain) * cpr;
    const bool one_token = tokens_per_cta == 1;
    const int team = one_token ? (int)(blockDim.x * gridDim.y) : 32;
    const int member = one_token ? (int)(blockIdx.y * blockDim.x + threadIdx.x) : lane;
    // the CTA's tokens this thread copies: k = warp, warp + num_warps, ... (0 alone for one token)
    for (int k = one_token ? 0 : warp; k < ntok && per_token > 0; k += num_warps) {
      const int t = t0 + k;
      const T* k_src = k_src_of(t);
      const T* v_src = v_src_of(t);
      // row and 16-byte column of the token's chunk j
      auto chunk_at = [&](int j, bool& is_k, int& head, int& col) {
        const int r = first_plain + (cpr_pow2 ? j >> cpr_shift : j / cpr);
        col = cpr_pow2 ? j & (cpr - 1) : j % cpr;
        is_k = r < H + Hk;
        head = is_k ? r - H : r - H - Hk;
      };
      auto load_pass = [&](int j0, uint4(&v)[U]) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int j = j0 + u * team;
          if (j < per_token) {
            bool is_k;
            int head, col;
            chunk_at(j, is_k, head, col);
            v[u] = __ldg(reinterpret_cast<const uint4*>((is_k ? k_src : v_src) + head * D + col * (16 / (int)sizeof(T))));
          }
        }
      };
      uint4 v[U];
      load_pass(member, v);
      const TokenInfo info = locate_token_warp(t, cum, past, batch_size, query_positions,
                                               (long long)max_blocks * block_size,
                                               rotary_dim > 0 ? rotary_max_pos : 0, lane);
      const long long slot =
          info.valid ? write_slot(info, t, slot_mapping, block_table, max_blocks, num_blocks, block_size) : -1;
      if (slot >= 0) {
        for (int j0 = member; j0 < per_token; j0 += U * team) {
          if (j0 != member) load_pass(j0, v);
#pragma unroll
          for (int u = 0; u < U; ++u) {
            const int j = j0 + u * team;
            if (j < per_token) {
              bool is_k;
              int head, col;
              chunk_at(j, is_k, head, col);
              typename Cache::storage* dst = (is_k ? key_cache : value_cache) + (slot * Hk + head) * D;
              *reinterpret_cast<uint4*>(dst + col * (16 / (int)sizeof(T))) = v[u];
            }
          }
        }
      }
      if constexpr (!TOKEN_LOOP) break;  // one token per warp: a single pass (ntok <= warps)
    }
  }

  // The other rows, token by token, one warp per row: Q rows (unless write_q == 0: Q needs no
  // transform -- unpacked, no QK-norm, no rotary -- and the attention kernel reads `query` itself),
  // K rows with QK-norm / rotary, and every K/V row of a quantized cache.
  if (!write_q && same_type && k_plain) return;
  for (int k = 0; k < ntok; ++k) {
    const int t = t0 + k;
    const TokenInfo info = locate_token_warp(t, cum, past, batch_size, query_positions,
                                             (long long)max_blocks * block_size, rotary_dim > 0 ? rotary_max_pos : 0,
                                             lane);
    const long long slot =
        info.valid ? write_slot(info, t, slot_mapping, block_table, max_blocks, num_blocks, block_size) : -1;
    const T* q_src = q_src_of(t);
    const T* k_src = k_src_of(t);
    const T* v_src = v_src_of(t);
    for (int r = (write_q ? 0 : H) + blockIdx.y * num_warps + warp; r < rows; r += num_warps * gridDim.y) {
      const bool is_q = r < H, is_k = !is_q && r < H + Hk;
      const int head = is_q ? r : (is_k ? r - H : r - H - Hk);
      if (!is_q && slot < 0) continue;  // nothing to write for this token
      if (same_type && !is_q && (!is_k || k_plain)) continue;  // copied above
      const T* src = is_q ? q_src + head * D : (is_k ? k_src : v_src) + head * D;
      for (int c = lane * 8; c < D; c += 256) {
        float v[8];
        load8(src + c, v);
#pragma unroll
        for (int i = 0; i < 8; ++i) row[c + i] = v[i];
      }
      __syncwarp();
      if (!is_q && !is_k) {
        // V: encode as given.
        typename VCache::storage* dst = value_cache + (slot * Hk + head) * (D / VCache::PACK);
        if constexpr (VCache::PACK == 2) {
          for (int i = lane; i < D / 2; i += 32) {
            const float inv0 = __fdiv_rn(1.0f, quant_scale(v_scale, v_quant, head, D, 2 * i));
            const float inv1 = __fdiv_rn(1.0f, quant_scale(v_scale, v_quant, head, D, 2 * i + 1));
            dst[i] = encode_pair<VCache>(row[2 * i], inv0, row[2 * i + 1], inv1);
          }
        } else {
          for (int c = lane; c < D; c += 32) {
            const float inv = VCache::quantized ? __fdiv_rn(1.0f, quant_scale(v_scale, v_quant, head, D, c)) : 1.0f;
            dst[c] = VCache::encode(row[c], inv);
          }
        }
        __syncwarp();
        continue;
      }
      if (q_norm_weight) rms_norm_row<T>(row, is_q ? q_norm_weight : k_norm_weight, D, qk_norm_epsilon, lane);
      if (rotary_dim > 0 && info.valid)
        rope_row<T>(row, cos_cache, sin_cache, info.pos, rotary_dim, rotary_offset, rotary_interleaved, lane);
      if (is_q) {
        T* dst = q_out + ((long long)t * H + head) * D;
        for (int c = lane; c < D; c += 32) dst[c] = Act<T>::from_float(row[c]);
      } else {
        typename Cache::storage* dst = key_cache + (slot * Hk + head) * (D / Cache::PACK);
        if constexpr (Cache::PACK == 2) {
          for (int i = lane; i < D / 2; i += 32) {
            const float inv0 = __fdiv_rn(1.0f, quant_scale(k_scale, k_quant, head, D, 2 * i));
            const float inv1 = __fdiv_rn(1.0f, quant_scale(k_scale, k_quant, head, D, 2 * i + 1));
            dst[i] = encode_pair<Cache>(round_to<T>(row[2 * i]), inv0, round_to<T>(row[2 * i + 1]), inv1);
          }
        } else {
          for (int c = lane; c < D; c += 32) {
            const float inv = Cache::quantized ? __fdiv_rn(1.0f, quant_scale(k_scale, k_quant, head, D, c)) : 1.0f;
            dst[c] = Cache::encode(round_to<T>(row[c]), inv);
          }
        }
      }
      __syncwarp();
    }
  }
}
