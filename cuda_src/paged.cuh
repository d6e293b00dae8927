// The paged-KV accessor and the per-token rules of contract §4.4, shared by every kernel.
// Every per-step quantity is read on the device from cum / past_seqlens / block_table;
// host values only size launches. All index arithmetic that can overflow int32 is 64-bit.
#pragma once
#include "common.cuh"

struct TokenInfo {
  int b;        // owning sequence
  int j;        // index among the sequence's new tokens
  int pos;      // logical position p
  int kv_len;   // past + q_len
  bool valid;   // owned by a valid sequence and itself valid
};

// Owner of packed token t: the smallest b in [0, B) with cum[b+1] > t, owned iff cum[b] <= t.
// One deterministic outcome for any cum, the same as the NumPy reference.
CUPA_DEVICE int find_owner(const int* cum, int batch_size, int t) {
  int lo = 0, hi = batch_size;
  while (lo < hi) {
    int mid = (lo + hi) >> 1;
    if (__ldg(cum + mid + 1) > t) hi = mid; else lo = mid + 1;
  }
  return lo;
}

// rotary_max_pos == 0 means no rotary (no upper bound on positions).
CUPA_DEVICE TokenInfo locate_token(int t, const int* cum, const int* past, int batch_size,
                                   const int* query_positions, long long kv_capacity, int rotary_max_pos) {
  TokenInfo info;
  info.valid = false;
  info.b = find_owner(cum, batch_size, t);
  info.j = 0;
  info.pos = -1;
  info.kv_len = 0;
  if (info.b >= batch_size) return info;
  const int c0 = __ldg(cum + info.b), c1 = __ldg(cum + info.b + 1);
  if (c0 > t) return info;
  const int pst = __ldg(past + info.b);
  const long long kv_len = (long long)pst + (long long)c1 - (long long)c0;
  if (pst < 0 || c1 < c0 || kv_len > kv_capacity) return info;
  info.j = t - c0;
  info.kv_len = (int)kv_len;
  info.pos = query_positions ? __ldg(query_positions + t) : pst + info.j;
  if (info.pos < 0) return info;
  if (rotary_max_pos > 0 && info.pos >= rotary_max_pos) return info;
  info.valid = true;
  return info;
}

// locate_token for a warp-uniform t, called by all 32 lanes of a warp (same result, bit for bit).
// For batch_size < 128 the warp reads cum[0..B], past_seqlens[0..B) and query_positions[t] in ONE
// round of independent loads (lane l holds entries l, l+32, l+64, l+96) and runs find_owner's
// binary search -- the same probes, so the same owner for any cum -- on those registers with
// shuffles: one global-memory latency instead of log2(B) + 2 dependent ones before the first
// block-table read. Larger batches take locate_token.
constexpr int LOCATE_WARP_MAX_BATCH = 127;
CUPA_DEVICE int warp_entry(const int (&r)[4], int index) {  // entry `index` (warp-uniform) of a 4x32 table
  const int i = index >> 5;
  const int v = i == 0 ? r[0] : (i == 1 ? r[1] : (i == 2 ? r[2] : r[3]));
  return __shfl_sync(0xffffffffu, v, index & 31);
}
CUPA_DEVICE TokenInfo locate_token_warp(int t, const int* cum, const int* past, int batch_size,
                                        const int* query_positions, long long kv_capacity, int rotary_max_pos,
                                        int lane) {
  if (batch_size > LOCATE_WARP_MAX_BATCH) return locate_token(t, cum, past, batch_size, query_positions, kv_capacity,
                                                               rotary_max_pos);
  int c[4], p[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int e = 32 * i + lane;
    c[i] = e <= batch_size ? __ldg(cum + e) : 0;
    p[i] = e < batch_size ? __ldg(past + e) : 0;
  }
  const int qpos = query_positions ? __ldg(query_positions + t) : 0;
  TokenInfo info;
  info.valid = false;
  int lo = 0, hi = batch_size;
  while (lo < hi) {  // find_owner
    const int mid = (lo + hi) >> 1;
    if (warp_entry(c, mid + 1) > t) hi = mid; else lo = mid + 1;
  }
  info.b = lo;
  info.j = 0;
  info.pos = -1;
  info.kv_len = 0;
  if (info.b >= batch_size) return info;
  const int c0 = warp_entry(c, info.b), c1 = warp_entry(c, info.b + 1);
  if (c0 > t) return info;
  const int pst = warp_entry(p, info.b);
  const long long kv_len = (long long)pst + (long long)c1 - (long long)c0;
  if (pst < 0 || c1 < c0 || kv_len > kv_capacity) return info;
  info.j = t - c0;
  info.kv_len = (int)kv_len;
  info.pos = query_positions ? qpos : pst + info.j;
  if (info.pos < 0) return info;
  if (rotary_max_pos > 0 && info.pos >= rotary_max_pos) return info;
  info.valid = true;
  return info;
}

// Physical block of logical block `index` of sequence b, or -1 when unmapped / out of range.
CUPA_DEVICE int physical_block(const int* block_table, int max_blocks, int num_blocks, int b, int index) {
  if (index < 0 || index >= max_blocks) return -1;
  const int blk = __ldg(block_table + (long long)b * max_blocks + index);
  return (blk >= 0 && blk < num_blocks) ? blk : -1;
}

// Write slot of a valid token, or -1 to skip the write (contract §4.1, 4.4).
CUPA_DEVICE long long write_slot(const TokenInfo& info, int t, const int* slot_mapping, const int* block_table,
                                 int max_blocks, int num_blocks, int block_size) {
  const long long slots = (long long)num_blocks * block_size;
  if (slot_mapping) {
    const long long s = __ldg(slot_mapping + t);
    return (s >= 0 && s < slots) ? s : -1;
  }
  const int blk = physical_block(block_table, max_blocks, num_blocks, info.b, info.pos / block_size);
  return blk < 0 ? -1 : (long long)blk * block_size + info.pos % block_size;
}

// Admitted key range [lo, hi) of a valid token before block masking (contract §4.2).
CUPA_DEVICE void key_range(const TokenInfo& info, int is_causal, int window, int& lo, int& hi) {
  hi = info.kv_len;
  if (is_causal && info.pos + 1 < hi) hi = info.pos + 1;
  lo = 0;
  if (window > 0 && info.pos - window + 1 > 0) lo = info.pos - window + 1;
}
