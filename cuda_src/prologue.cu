// Fused prologue (SPEC 4.1): one pass over the new tokens.
// A CTA owns one packed token and every gridDim.y-th group of 4 of its head rows: the H query
// heads (unless the attention kernel reads an untransformed query itself), then the Hk key heads,
// then the Hk value heads (none in LATENT); one warp per row. Few tokens: one group of rows per
// CTA (latency); many tokens: fewer CTAs, each doing more rows (the token lookup amortized). A row is staged in shared
// memory as floats, QK-normed and rotated (Q and K rows), rounded to T, then Q goes to the
// (N, H, D) workspace the attention kernels read, and K/V are encoded into their cache slot.
// Reads: query/key/value, cum, past_seqlens, block_table or slot_mapping, rotary and norm
// inputs, scales. Writes: the Q workspace, the cache rows of valid tokens, and zeros into the
// decode kernel's split counters when given. The launch is
// sized by token_count alone; no host value enters a mask.
#include "common.cuh"
#include "paged.cuh"
#include "quant.cuh"
#include "rope.cuh"

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
    int rotary_interleaved, float qk_norm_epsilon, int k_quant, int v_quant) {
  grid_dependency_launch_dependents();  // the attention kernel may be scheduled now (it waits for us)
  extern __shared__ float row_smem[];
  const int t = blockIdx.x;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, num_warps = blockDim.x >> 5;
  float* row = row_smem + warp * head_size;
  // Zero the decode kernel's split-arrival counters of this token (null for the other backends).
  if (split_counters && blockIdx.y == 0)
    for (int i = threadIdx.x; i < counters_per_token; i += blockDim.x) split_counters[(long long)t * counters_per_token + i] = 0;

  const int H = num_heads, Hk = kv_num_heads, D = head_size;
  const int rows = H + Hk + (has_value ? Hk : 0);
  const long long q_stride = packed ? (long long)(H + 2 * Hk) * D : (long long)H * D;
  const long long kv_stride = packed ? q_stride : (long long)Hk * D;
  const T* q_src = query + t * q_stride;
  const T* k_src = packed ? q_src + H * D : key + t * kv_stride;
  const T* v_src = packed ? q_src + (H + Hk) * D : (has_value ? value + t * kv_stride : nullptr);

  // Rows stored as they come (a cache of T: V always, K without QK-norm and rotary) are plain
  // copies: 16-byte chunks spread over every thread of the token's CTAs. A thread's first U chunks
  // are loaded before the token lookup (they depend on t alone), so the loads overlap the lookup's
  // latency; its stores wait for the slot. The row loop below skips these rows.
  constexpr bool same_type = !Cache::quantized && sizeof(typename Cache::storage) == sizeof(T);
  constexpr int U = 4;
  const bool k_plain = same_type && !q_norm_weight && rotary_dim == 0;
  const int first_plain = k_plain ? H : H + Hk;  // the plain rows are [first_plain, rows)
  const int cpr = D * (int)sizeof(T) / 16;       // 16-byte chunks per row (D % 8 == 0)
  const int plain_total = same_type ? (rows - first_plain) * cpr : 0;
  const int plain_stride = (int)(blockDim.x * gridDim.y), plain_base = (int)(blockIdx.y * blockDim.x + threadIdx.x);
  auto plain_row = [&](int i, bool& is_k, int& head, int& chunk) {
    const int r = first_plain + i / cpr;
    chunk = i % cpr;
    is_k = r < H + Hk;
    head = is_k ? r - H : r - H - Hk;
  };
  auto plain_load = [&](int base, uint4 (&v)[U]) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int i = base + u * plain_stride;
      if (i < plain_total) {
        bool is_k;
        int head, chunk;
        plain_row(i, is_k, head, chunk);
        const T* src = (is_k ? k_src : v_src) + head * D + chunk * (16 / (int)sizeof(T));
        v[u] = __ldg(reinterpret_cast<const uint4*>(src));
      }
    }
  };
  uint4 pre[U];
  if (same_type) plain_load(plain_base, pre);

  const TokenInfo info = locate_token_warp(t, cum, past, batch_size, query_positions,
                                           (long long)max_blocks * block_size, rotary_dim > 0 ? rotary_max_pos : 0,
                                           lane);
  const long long slot = info.valid ? write_slot(info, t, slot_mapping, block_table, max_blocks, num_blocks, block_size) : -1;

  if (same_type && slot >= 0) {
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
          bool is_k;
          int head, chunk;
          plain_row(i, is_k, head, chunk);
          typename Cache::storage* dst = (is_k ? key_cache : value_cache) + (slot * Hk + head) * D;
          *reinterpret_cast<uint4*>(dst + chunk * (16 / (int)sizeof(T))) = v[u];
        }
      }
    }
  }

  // write_q == 0: Q needs no transform (unpacked, no QK-norm, no rotary) and the attention kernel
  // reads `query` itself; only the K/V rows are done here.
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
