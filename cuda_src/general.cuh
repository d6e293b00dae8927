// Pieces shared by the general backend's kernels (general_mma.cu, general_simt.cu, general_finish.cu):
// the attention_bias view and its capacity rule (contract §4.3), each token's admitted key range, the
// layout of the split partial states, and the output_qk / lse values of a finished row.
//
// Partial states (one per (token, query head, split), written when a call has several KV splits):
// part_ml[(t * H + h) * num_splits + s] = (m, l) in natural units (m: the max score over the split's
// admitted keys, l: sum exp(score - m); l == 0: no admitted key), part_o[... * v_head_size + d] = sum
// exp(score - m) * v (before the V scale). general_finish.cu merges them in split order.
// output_qk rows (H, N, kv_capacity): an attention kernel writes the keys of a row's admitted range
// [lo, hi) that its split covers (the score, or for an unmapped block 0 under qk_output=1 and -inf
// under qk_output=2); general_finish.cu writes the rest of the row (zeros) and, under qk_output=2,
// turns scores into probabilities.
#pragma once
#include "common.cuh"
#include "paged.cuh"
#include "softmax.cuh"

// attention_bias of shape (batch, heads, q_cap, kv_cap), batch 1 or B and heads 1 or H (broadcast).
template <typename T> struct BiasView {
  const T* ptr;  // null: no bias
  int batch, heads, q_cap, kv_cap;

  // The kv_cap entries of (sequence b, query head h, sequence-local query index j < q_cap).
  CUPA_DEVICE const T* row(int b, int h, int j) const {
    const long long bb = batch > 1 ? b : 0, hh = heads > 1 ? h : 0;
    return ptr + ((bb * heads + hh) * q_cap + j) * (long long)kv_cap;
  }
  // contract §4.3: a (j, k) outside the capacities is masked and never read. A query index j >= q_cap
  // admits no key, and the keys k >= kv_cap are masked, so a row's range ends there.
  CUPA_DEVICE void clamp(int j, int& lo, int& hi) const {
    if (ptr == nullptr) return;
    if (j >= q_cap) hi = lo;
    else hi = min(hi, kv_cap);
  }
};

// Admitted key range [lo, hi) of a token before block masking (contract §4.2, 4.3); empty: lo = hi = 0.
// Every kernel of the backend derives a row's keys from this, so they agree on which output_qk
// entries are whose and which splits hold a row's partial states.
template <typename T>
CUPA_DEVICE void admitted_range(const TokenInfo& info, int is_causal, int window, const BiasView<T>& bias, int& lo,
                                int& hi) {
  lo = hi = 0;
  if (!info.valid) return;
  key_range(info, is_causal, window, lo, hi);
  bias.clamp(info.j, lo, hi);
  if (hi <= lo) lo = hi = 0;
}

// Whether packed token t belongs to a sequence (find_owner's owner b with cum[b] <= t).
CUPA_DEVICE bool token_owned(const int* cum, int batch_size, int t) {
  const int b = find_owner(cum, batch_size, t);
  return b < batch_size && __ldg(cum + b) <= t;
}

// The share of the keys in a row's softmax denominator when head_sink adds exp(sink): 1 / (1 + exp(sink - lse)),
// so that a key of score s has probability exp(s - lse) * share (contract §4.3: the sink counts in the denominator only).
CUPA_DEVICE float keys_share(float lse, bool has_sink, float sink) {
  return has_sink ? 1.0f / (1.0f + __expf(sink - lse)) : 1.0f;
}

// The output_qk value an attention kernel writes for an admitted-range key: its score, or for a masked
// (unmapped) key 0 (qk_output=1) or -inf, which general_finish.cu turns into probability 0 (qk_output=2).
CUPA_DEVICE float qk_entry(bool mapped, float score, int qk_mode) {
  return mapped ? score : (qk_mode == 1 ? 0.0f : CUPA_NEG_INF);
}

// Two adjacent T values packed in a 32-bit word, as floats.
template <typename T> CUPA_DEVICE float2 unpack2(unsigned bits) {
  T v[2];
  *reinterpret_cast<unsigned*>(v) = bits;
  return make_float2(Act<T>::to_float(v[0]), Act<T>::to_float(v[1]));
}

// The 16-bit T values of bias entries k and k + 1 of `row` (row + k 4-byte aligned when `pairs`), each read
// only when admitted (a0, a1), else 0: packed as in unpack2.
template <typename T>
CUPA_DEVICE unsigned load_bias_pair(const T* row, int k, bool a0, bool a1, bool pairs) {
  static_assert(sizeof(T) == 2, "16-bit activations");
  if (pairs && a0 && a1) return __ldg(reinterpret_cast<const unsigned*>(row + k));
  const unsigned short* r = reinterpret_cast<const unsigned short*>(row);
  const unsigned lo = a0 ? __ldg(r + k) : 0u, hi = a1 ? __ldg(r + k + 1) : 0u;
  return lo | (hi << 16);
}
