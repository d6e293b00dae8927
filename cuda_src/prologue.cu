// Fused prologue (SPEC 4.1): one pass over the new tokens.
// A CTA owns tokens_per_cta consecutive packed tokens (1 unless there are many) and every
// gridDim.y-th group of 4 of their head rows: the H query heads (unless the attention kernel reads
// an untransformed query itself), then the Hk key heads, then the Hk value heads (none in LATENT).
// Rows that are plain copies go in 16-byte chunks over all the CTA's threads; the others one warp
// per row. Few tokens: one group of rows per CTA (latency); many tokens: fewer CTAs, each doing
// more rows and then more tokens (the token lookup amortized, more bytes in flight per thread).
// A row is staged in shared memory as floats, QK-normed and rotated (Q and K rows), rounded to T,
// then Q goes to the (N, H, D) workspace the attention kernels read, and K/V are encoded into
// their cache slot.
// Reads: query/key/value, cum, past_seqlens, block_table or slot_mapping, rotary and norm
// inputs, scales. Writes: the Q workspace, the cache rows of valid tokens, and zeros into the
// decode kernel's split counters when given. The launch is
// sized by token_count alone; no host value enters a mask.
#include "common.cuh"
#include "paged.cuh"
#include "quant.cuh"
#include "rope.cuh"

// Plain-copy chunks of 16 bytes a thread keeps in flight per pass (-DCUPA_PROLOGUE_U=1 in a test
// forces the multi-pass path); at most PROLOGUE_MAX_TPC tokens per CTA.
#ifndef CUPA_PROLOGUE_U
#define CUPA_PROLOGUE_U 4
#endif
constexpr int PROLOGUE_U = CUPA_PROLOGUE_U;
constexpr int PROLOGUE_MAX_TPC = 4;

template <typename T, typename Cache>
__global__ void __launch_bounds__(128) paged_prologue(
    const T* __restrict__ query, const T* __restrict__ key, const T* __restrict__ value,
    typename Cache::storage* __restrict__ key_cache, typename Cache::storage* __restrict__ value_cache,
    const int* __restrict__ cum, const int* __restrict__ past, const int* __restrict__ block_table,
    const T* __restrict__ cos_cache, const T* __restrict__ sin_cache, const int* __restrict__ slot_mapping,
    const T* __restrict__ q_norm_weight, const T* __restrict__ k_norm_weight,
    const float* __restrict__ k_scale, const float* __restrict__ v_scale, const int* __restrict__ query_positions,
    T* __restrict__ q_out, int* __restrict__ split_counters, int counters_per_token, int write_q,
    int num_heads, int kv_num_heads, int head_size, int batch_size, int num_blocks, int block_size,
    int max_blocks, int packed, int has_value, int rotary_dim, int rotary_max_pos, int rotary_offset,
    int rotary_interleaved, float qk_norm_epsilon, int k_quant, int v_quant, int token_count,
    int tokens_per_cta) {
  grid_dependency_launch_dependents();  // the attention kernel may be scheduled now (it waits for us)
  // Dynamic shared memory: one row of head_size floats per warp, then PROLOGUE_MAX_TPC write slots.
  extern __shared__ float row_smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, num_warps = blockDim.x >> 5;
  float* row = row_smem + warp * head_size;
  long long* sSlot = reinterpret_cast<long long*>(row_smem + num_warps * head_size);
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
  // copies: 16-byte chunks of all of the CTA's tokens spread over its threads (and over the
  // gridDim.y CTAs of a token). A thread's first PROLOGUE_U chunks are loaded before the token
  // lookups (they depend on the tokens alone), so those loads overlap the lookups' latency; the
  // stores wait for the slots. The row loop below skips these rows.
  constexpr bool same_type = !Cache::quantized && sizeof(typename Cache::storage) == sizeof(T);
  constexpr int U = PROLOGUE_U;
  const bool k_plain = same_type && !q_norm_weight && rotary_dim == 0;
  const int first_plain = k_plain ? H : H + Hk;  // the plain rows are [first_plain, rows)
  const int cpr = D * (int)sizeof(T) / 16;       // 16-byte chunks per row (D % 8 == 0)
  const int per_token = same_type ? (rows - first_plain) * cpr : 0;
  const int plain_total = per_token * ntok;
  const int plain_stride = (int)(blockDim.x * gridDim.y), plain_base = (int)(blockIdx.y * blockDim.x + threadIdx.x);
  // chunk i: token k = i / per_token of the CTA; row r, 16-byte chunk c of it
  auto plain_at = [&](int i, int& k, bool& is_k, int& head, int& chunk) {
    k = i / per_token;
    const int j = i - k * per_token;
    const int r = first_plain + j / cpr;
    chunk = j % cpr;
    is_k = r < H + Hk;
    head = is_k ? r - H : r - H - Hk;
  };
  auto plain_load = [&](int base, uint4(&v)[same_type ? U : 1]) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int i = base + u * plain_stride;
      if (i < plain_total) {
        int k, head, chunk;
        bool is_k;
        plain_at(i, k, is_k, head, chunk);
        const T* src = (is_k ? k_src_of(t0 + k) : v_src_of(t0 + k)) + head * D + chunk * (16 / (int)sizeof(T));
        v[u] = __ldg(reinterpret_cast<const uint4*>(src));
      }
    }
  };
  uint4 pre[same_type ? U : 1];
  if constexpr (same_type) plain_load(plain_base, pre);

  // Write slot of each token (one warp per token), shared through shared memory.
  for (int k = warp; k < ntok; k += num_warps) {
    const TokenInfo info = locate_token_warp(t0 + k, cum, past, batch_size, query_positions,
                                             (long long)max_blocks * block_size, rotary_dim > 0 ? rotary_max_pos : 0,
                                             lane);
    const long long slot =
        info.valid ? write_slot(info, t0 + k, slot_mapping, block_table, max_blocks, num_blocks, block_size) : -1;
    if (lane == 0) sSlot[k] = slot;
  }
  __syncthreads();

  if constexpr (same_type) {
    for (int base = plain_base; base < plain_total; base += U * plain_stride) {
      uint4 v[U];
      if (base == plain_base) {
#pragma unroll
        for (int u = 0; u < U; ++u) v[u] = pre[u];
      } else {
        plain_load(base, v);
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int i = base + u * plain_stride;
        if (i < plain_total) {
          int k, head, chunk;
          bool is_k;
          plain_at(i, k, is_k, head, chunk);
          const long long slot = sSlot[k];
          if (slot < 0) continue;  // nothing to write for this token
          typename Cache::storage* dst = (is_k ? key_cache : value_cache) + (slot * Hk + head) * D;
          *reinterpret_cast<uint4*>(dst + chunk * (16 / (int)sizeof(T))) = v[u];
        }
      }
    }
  }

  // The other rows, token by token, one warp per row: Q rows (unless write_q == 0: Q needs no
  // transform -- unpacked, no QK-norm, no rotary -- and the attention kernel reads `query` itself),
  // K rows with QK-norm / rotary, and every K/V row of a quantized cache.
  if (!write_q && same_type && k_plain) return;
  for (int k = 0; k < ntok; ++k) {
    const int t = t0 + k;
    const long long slot = sSlot[k];
    const TokenInfo info = locate_token_warp(t, cum, past, batch_size, query_positions,
                                             (long long)max_blocks * block_size, rotary_dim > 0 ? rotary_max_pos : 0,
                                             lane);
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
        typename Cache::storage* dst = value_cache + (slot * Hk + head) * D;
        for (int c = lane; c < D; c += 32) {
          const float inv = Cache::quantized ? __fdiv_rn(1.0f, quant_scale(v_scale, v_quant, head, D, c)) : 1.0f;
          dst[c] = Cache::encode(row[c], inv);
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
        typename Cache::storage* dst = key_cache + (slot * Hk + head) * D;
        for (int c = lane; c < D; c += 32) {
          const float inv = Cache::quantized ? __fdiv_rn(1.0f, quant_scale(k_scale, k_quant, head, D, c)) : 1.0f;
          dst[c] = Cache::encode(round_to<T>(row[c]), inv);
        }
      }
      __syncwarp();
    }
  }
}
