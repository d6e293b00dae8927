// Attention states (docs/attention_states.md): the merge of partial states, and the index arrays of
// a cascade step.
//
// merge_states: S partial states over disjoint key sets, each a sink-free output row o_i and its
// log-sum-exp lse_i, merged into the state over their union: lse = ln sum_i exp(lse_i) and
// o = sum_i exp(lse_i - M) o_i / (sum_i exp(lse_i - M) [+ exp(sink - M)]), M = max_i lse_i, through
// the online-softmax pieces of softmax.cuh (rescale, finalize), so a merged row is the decode split
// merge's arithmetic. One warp owns one (token, head) row: lanes take states for the max and the sum
// (a fixed xor tree), then channel chunks, summing the states in index order. A state whose lse is
// -inf adds nothing, whatever its output row holds. `out` may be one of the input outputs and
// `out_lse` one of the input lses: every lane has read the row's lse values and its own channels of
// every state before it writes them, and lane 0 writes the lse after the warp has synchronized.
// The first `heads_major` states may hold their rows KV-head major -- row (KV head, token, group
// head) of a heads-form cascade prefix, whose query heads are those of every token -- and then a
// token whose `valid` entry is negative takes nothing from them.
// Reads: the S output rows and lse values of each row, head_sink, valid. Writes: out, out_lse
// (optional).
// Host values that size the launch: rows (token_count * num_heads), the head width, S.
//
// cascade_inputs: the index arrays of a cascade step (cupa/cascade.py) in one launch, one element
// per thread of a grid-stride loop: the position at which each packed token attends the shared
// prefix (locate_token's position for a token valid in the plain call, else -1), the suffix call's
// past_seqlens and query_positions (shifted down by the prefix length; -1 where the value was
// negative, and negative -- an invalid sequence or token of the suffix call -- where it was below the
// prefix length), its block table (the columns after the prefix blocks) and the prefix
// call's block table: row 0's prefix blocks repeated in every row (the tokens form), or split into
// consecutive runs of prefix_cols blocks, one a row, -1 past the last (the heads form's key splits);
// and, for the heads form, its stacked queries: query rows (N, Hk, G, D) of a row stride of q_row
// 16-byte units copied KV-head major, (S, Hk, N, G, D), one 16-byte unit per element (stack_units: the
// units of one copy, S copies; 0 where the host stacks them).
// Host values that size the launch: the element counts.
#include "common.cuh"
#include "paged.cuh"
#include "softmax.cuh"

constexpr int MERGE_LISTED = 16;  // states passed one pointer each; more come as one strided array

// The states of one merge: S pointers, or (strided: stride != 0) state i at out[0] + i * out_stride.
template <typename T> struct MergeInputs {
  const T* out[MERGE_LISTED];
  const float* lse[MERGE_LISTED];
  long long out_stride;  // elements from one state's output to the next (strided), else 0
  long long lse_stride;
  int heads_major;       // the first heads_major states hold rows (KV head, token, group head)
  int group;             // their group heads per KV head
  long long tokens;      // their tokens
  const int* valid;      // (tokens,) or null: a token whose entry is < 0 takes nothing from them

  CUPA_DEVICE const T* out_of(int i) const { return out_stride ? out[0] + i * out_stride : out[i]; }
  CUPA_DEVICE const float* lse_of(int i) const { return lse_stride ? lse[0] + i * lse_stride : lse[i]; }
};

constexpr int MERGE_WARPS = 8;

// VEC: channels per lane access (8: 16-byte loads of 16-bit T, all rows 16-byte aligned; else 1).
template <typename T, typename Sink, int VEC>
__global__ void __launch_bounds__(MERGE_WARPS * 32, 4) merge_states(
    const __grid_constant__ MergeInputs<T> states, int num_states, long long rows, int num_heads, int head_width,
    const Sink* __restrict__ head_sink, T* out, float* out_lse) {
  const int lane = threadIdx.x & 31;
  const long long row = (long long)blockIdx.x * MERGE_WARPS + (threadIdx.x >> 5);
  if (row >= rows) return;  // warp-uniform
  const int h = (int)(row % num_heads);
  const int major = states.heads_major;
  long long major_row = row;  // the row's index in the heads-major states
  bool major_empty = false;
  if (major > 0) {
    const long long t = row / num_heads;
    major_row = ((long long)(h / states.group) * states.tokens + t) * states.group + h % states.group;
    major_empty = states.valid != nullptr && __ldg(states.valid + t) < 0;
  }
  auto lse_at = [&](int i) -> float {
    if (i < major) return major_empty ? CUPA_NEG_INF : states.lse_of(i)[major_row];
    return states.lse_of(i)[row];
  };
  float M = CUPA_NEG_INF;
  for (int i = lane; i < num_states; i += 32) M = fmaxf(M, lse_at(i));
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, off));
  float L = 0.0f;
  for (int i = lane; i < num_states; i += 32) L += rescale(lse_at(i), M);
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) L += __shfl_xor_sync(0xffffffffu, L, off);
  const bool has_sink = head_sink != nullptr;
  const float sink = has_sink ? Act<Sink>::to_float(head_sink[h]) : 0.0f;
  const long long base = row * head_width, major_base = major_row * head_width;
  for (int c = lane * VEC; c < head_width; c += 32 * VEC) {
    float O[VEC];
#pragma unroll
    for (int k = 0; k < VEC; ++k) O[k] = 0.0f;
    for (int i = 0; i < num_states; ++i) {
      const float w = rescale(lse_at(i), M);
      if (w == 0.0f) continue;  // an empty state (or one far below the max) adds nothing
      const T* o = states.out_of(i) + (i < major ? major_base : base) + c;
      if constexpr (VEC == 8) {
        float v[8];
        load8(o, v);
#pragma unroll
        for (int k = 0; k < 8; ++k) O[k] += w * v[k];
      } else {
        O[0] += w * Act<T>::to_float(o[0]);
      }
    }
#pragma unroll
    for (int k = 0; k < VEC; ++k) O[k] = finalize(M, L, O[k], has_sink, sink, 1.0f);
    if constexpr (VEC == 8) {
      store8(out + base + c, O);
    } else {
      out[base + c] = Act<T>::from_float(O[0]);
    }
  }
  __syncwarp();  // every lane has read the row's lse values (out_lse may be one of them)
  if (out_lse && lane == 0) out_lse[row] = state_lse(M, L);
}

__global__ void cascade_inputs(const int* __restrict__ cum, const int* __restrict__ past,
                               const int* __restrict__ block_table, const int* __restrict__ query_positions,
                               int token_count, int batch_size, int max_blocks, long long kv_capacity,
                               int rotary_max_pos, int prefix_len, int prefix_blocks, int prefix_rows,
                               int prefix_cols, int prefix_split, int* __restrict__ prefix_positions,
                               int* __restrict__ suffix_past,
                               int* __restrict__ suffix_positions, int* __restrict__ suffix_table,
                               int* __restrict__ prefix_table, const uint4* __restrict__ query,
                               long long q_row, int group, int head_units, long long stack_units,
                               uint4* __restrict__ stacked) {
  const int suffix_cols = max_blocks - prefix_blocks;
  const long long n_tokens = token_count, n_seqs = batch_size;
  const long long n_suffix = n_seqs * suffix_cols, n_prefix = (long long)prefix_rows * prefix_cols;
  const long long n_stack = stack_units * prefix_rows;
  const long long total = n_stack + n_tokens + n_seqs + n_suffix + n_prefix;
  for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < total;
       e += (long long)gridDim.x * blockDim.x) {
    long long i = e;
    if (i < n_stack) {  // unit c of head g of KV head kv of token t, in copy i / stack_units
      long long r = i % stack_units;
      const long long c = r % head_units;
      r /= head_units;
      const long long g = r % group;
      r /= group;
      const long long t = r % n_tokens, kv = r / n_tokens;
      stacked[i] = __ldg(query + t * q_row + (kv * group + g) * head_units + c);
      continue;
    }
    i -= n_stack;
    if (i < n_tokens) {
      const int t = (int)i;
      const TokenInfo info = locate_token(t, cum, past, batch_size, query_positions, kv_capacity, rotary_max_pos);
      prefix_positions[t] = info.valid ? info.pos : -1;
      if (suffix_positions) {
        const int p = __ldg(query_positions + t);
        suffix_positions[t] = p >= 0 ? p - prefix_len : -1;
      }
      continue;
    }
    i -= n_tokens;
    if (i < n_seqs) {
      const int p = __ldg(past + i);
      suffix_past[i] = p >= 0 ? p - prefix_len : -1;
      continue;
    }
    i -= n_seqs;
    if (i < n_suffix) {
      const long long b = i / suffix_cols, col = i % suffix_cols;
      suffix_table[i] = __ldg(block_table + b * max_blocks + prefix_blocks + col);
      continue;
    }
    i -= n_suffix;
    const long long col = prefix_split ? i : i % prefix_blocks;  // entry i is row i / prefix_cols
    prefix_table[i] = batch_size > 0 && col < prefix_blocks ? __ldg(block_table + col) : -1;
  }
}
