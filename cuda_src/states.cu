// Attention states (docs/attention_states.md): the merge of partial states, and the index arrays of
// a cascade step.
//
// merge_states: S partial states over disjoint key sets, each a sink-free output row o_i and its
// log-sum-exp lse_i, merged into the state over their union: lse = ln sum_i exp(lse_i) and
// o = sum_i exp(lse_i - M) o_i / (sum_i exp(lse_i - M) [+ exp(sink - M)]), M = max_i lse_i, through
// the online-softmax pieces of softmax.cuh (rescale, finalize), so a merged row is the decode split
// merge's arithmetic. One warp owns one (token, head) row: lanes take states for the max and the sum
// (a fixed xor tree), then channel chunks, each lane group of the warp summing every (32 / span)-th
// state in index order and the groups' sums meeting in a fixed xor tree (the result does not depend
// on timing). A state whose lse is -inf adds nothing, whatever its output row holds. `out` may be one
// of the input outputs and `out_lse` one of the input lses: every lane has read the row's lse values
// and the channels it writes of every state before they are written, and lane 0 writes the lse after
// the warp has synchronized.
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
// units of one copy, S copies; 0 where the host stacks them); and, where their pointers are given, the
// prefix call's own inputs: its cumulative_sequence_length and past_seqlens (heads form: one token a
// split, past the split's keys less one; tokens form: runs of prefix_len tokens, past prefix_len less
// the run's), its slot_mapping (all -1: it stores nothing) and its zero key/value rows (the heads form),
// so that a step needs no constant uploaded from the host.
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
constexpr int MERGE_UNROLL = 4;  // states whose rows a lane loads before it adds them

// VEC: channels per lane access (8: 16-byte loads of 16-bit T, all rows 16-byte aligned; else 1).
// A row's channel chunks of VEC take `span` lanes (the power of two at or above their count, at most
// 32); the warp's 32 / span lane groups take every (32 / span)-th state each, MERGE_UNROLL rows in
// flight a lane, and their sums meet in a fixed xor tree. Every load of a row is issued before the
// row's weights are known, and the lse of state i sits in lane i (num_states <= 32), so a row costs
// about two memory round trips.
template <typename T, typename Sink, int VEC>
__global__ void __launch_bounds__(MERGE_WARPS * 32, 3) merge_states(
    const __grid_constant__ MergeInputs<T> states, int num_states, long long rows, int num_heads, int head_width,
    const Sink* __restrict__ head_sink, T* out, float* out_lse) {
  const int lane = threadIdx.x & 31;
  const long long row = (long long)blockIdx.x * MERGE_WARPS + (threadIdx.x >> 5);
  if (row >= rows) return;  // warp-uniform
  // (token, head) of the row, in 32-bit division where the rows allow it
  const long long token = rows <= 0x7fffffffLL ? (long long)((unsigned)row / (unsigned)num_heads) : row / num_heads;
  const int h = (int)(row - token * num_heads);
  const int major = states.heads_major;
  long long major_row = row;  // the row's index in the heads-major states
  const int* valid = nullptr;
  if (major > 0) {
    major_row = ((long long)(h / states.group) * states.tokens + token) * states.group + h % states.group;
    valid = states.valid;
  }
  const long long base = row * head_width, major_base = major_row * head_width;
  auto row_of = [&](int i) { return states.out_of(i) + (i < major ? major_base : base); };

  const int chunks = (head_width + VEC - 1) / VEC;
  int span = 1;
  while (span < chunks && span < 32) span <<= 1;
  const int groups = 32 / span, group = lane / span, sub = lane % span;
  const bool listed = num_states <= 32;  // state i's lse and weight in lane i

  // Issue the loads: the row's lse values, the valid flag, and this lane's first rows.
  float my_lse = CUPA_NEG_INF;
  if (listed && lane < num_states) my_lse = lane < major ? states.lse_of(lane)[major_row] : states.lse_of(lane)[row];
  const bool major_empty = valid != nullptr && __ldg(valid + token) < 0;
  int c = sub * VEC;
  Vec8<T> raw8[MERGE_UNROLL];
  T raw1[MERGE_UNROLL];
  auto load_rows = [&](int i0, int cc) {
#pragma unroll
    for (int u = 0; u < MERGE_UNROLL; ++u) {
      const int i = i0 + u * groups;
      if (i < num_states && cc < head_width) {
        if constexpr (VEC == 8) raw8[u].load(row_of(i) + cc);
        else raw1[u] = row_of(i)[cc];
      }
    }
  };
  load_rows(group, c);

  auto lse_at = [&](int i) -> float {
    if (i < major) return major_empty ? CUPA_NEG_INF : states.lse_of(i)[major_row];
    return states.lse_of(i)[row];
  };
  if (listed && lane < major && major_empty) my_lse = CUPA_NEG_INF;
  float M = my_lse;
  if (!listed)
    for (int i = lane; i < num_states; i += 32) M = fmaxf(M, lse_at(i));
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, off));
  const float my_w = rescale(my_lse, M);
  float L = my_w;
  if (!listed)
    for (int i = lane; i < num_states; i += 32) L += rescale(lse_at(i), M);
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) L += __shfl_xor_sync(0xffffffffu, L, off);
  const bool has_sink = head_sink != nullptr;
  const float sink = has_sink ? Act<Sink>::to_float(head_sink[h]) : 0.0f;

  for (; c - sub * VEC < head_width; c += span * VEC) {  // warp-uniform trip count
    float O[VEC];
#pragma unroll
    for (int k = 0; k < VEC; ++k) O[k] = 0.0f;
    for (int j0 = 0; j0 < num_states; j0 += groups * MERGE_UNROLL) {  // warp-uniform trip count
      const int i0 = j0 + group;
      if (j0 != 0) load_rows(i0, c);
#pragma unroll
      for (int u = 0; u < MERGE_UNROLL; ++u) {
        const int i = i0 + u * groups;
        // every lane of the warp takes part in the shuffle; lanes past the states get weight 0
        const float w = listed ? __shfl_sync(0xffffffffu, my_w, i & 31) : (i < num_states ? rescale(lse_at(i), M) : 0.0f);
        if (i >= num_states || w == 0.0f || c >= head_width) continue;  // an empty state adds nothing
        if constexpr (VEC == 8) {
#pragma unroll
          for (int k = 0; k < 8; ++k) O[k] += w * Act<T>::to_float(raw8[u].elems()[k]);
        } else {
          O[0] += w * Act<T>::to_float(raw1[u]);
        }
      }
    }
    for (int off = span; off < 32; off <<= 1)  // the lane groups' sums, in a fixed order
#pragma unroll
      for (int k = 0; k < VEC; ++k) O[k] += __shfl_xor_sync(0xffffffffu, O[k], off);
    if (group == 0 && c < head_width) {
#pragma unroll
      for (int k = 0; k < VEC; ++k) O[k] = finalize(M, L, O[k], has_sink, sink, 1.0f);
      if constexpr (VEC == 8) {
        store8(out + base + c, O);
      } else {
        out[base + c] = Act<T>::from_float(O[0]);
      }
    }
    if (c + span * VEC - sub * VEC < head_width) load_rows(group, c + span * VEC);
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
                               uint4* __restrict__ stacked, int* __restrict__ prefix_cum,
                               int* __restrict__ prefix_past, int* __restrict__ prefix_slots, int n_slots,
                               int block_size, unsigned short* __restrict__ prefix_kv, long long n_kv) {
  const int suffix_cols = max_blocks - prefix_blocks;
  const long long n_tokens = token_count, n_seqs = batch_size;
  const long long n_suffix = n_seqs * suffix_cols, n_prefix = (long long)prefix_rows * prefix_cols;
  // The stacked copies first, in 32-bit index arithmetic (the host keeps their units below 2^31).
  const unsigned n_stack = (unsigned)(stack_units * prefix_rows);
  const unsigned copy_units = (unsigned)stack_units;
  const unsigned units = (unsigned)head_units, heads = (unsigned)group, tokens = (unsigned)token_count;
  for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < n_stack; i += gridDim.x * blockDim.x) {
    unsigned r = i % copy_units;  // unit c of head g of KV head kv of token t, in copy i / stack_units
    const unsigned c = r % units;
    r /= units;
    const unsigned g = r % heads;
    r /= heads;
    const unsigned t = r % tokens, kv = r / tokens;
    stacked[i] = __ldg(query + t * q_row + (kv * heads + g) * units + c);
  }
  const long long n_cum = prefix_cum ? prefix_rows + 1 : 0, n_past = prefix_past ? prefix_rows : 0;
  const long long n_slot = prefix_slots ? n_slots : 0, n_zero = prefix_kv ? n_kv : 0;
  const long long total = n_tokens + n_seqs + n_suffix + n_prefix + n_cum + n_past + n_slot + n_zero;
  for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < total;
       e += (long long)gridDim.x * blockDim.x) {
    long long i = e;
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
    if (i < n_prefix) {
      const long long col = prefix_split ? i : i % prefix_blocks;  // entry i is row i / prefix_cols
      prefix_table[i] = batch_size > 0 && col < prefix_blocks ? __ldg(block_table + col) : -1;
      continue;
    }
    i -= n_prefix;
    if (i < n_cum) {  // row i's first token: the heads form's split i; the tokens form's run i
      prefix_cum[i] = prefix_split ? (int)i : (int)min(i * prefix_len, (long long)token_count);
      continue;
    }
    i -= n_cum;
    if (i < n_past) {
      const long long n = token_count;
      const long long run = min((i + 1) * prefix_len, n) - min(i * prefix_len, n);  // the tokens form's run i
      const long long keys = min((long long)prefix_blocks - i * prefix_cols, (long long)prefix_cols) * block_size;
      prefix_past[i] = prefix_split ? (int)keys - 1 : prefix_len - (int)run;
      continue;
    }
    i -= n_past;
    if (i < n_slot) {
      prefix_slots[i] = -1;
      continue;
    }
    prefix_kv[i - n_slot] = 0;
  }
}
