// The per-tile softmax and the epilogue of the wgmma prefill (prefill_wgmma_ws.cu), on the
// accumulator layout of wgmma.m64nNk16 (wgmma.cuh): lane l of warp w of a warpgroup holds rows
// 16w + l/4 and 16w + l/4 + 8, d[4j + e] = D[row (e/2 ? +8)][8j + 2(l%4) + e%2].
#pragma once
#include "common.cuh"
#include "mma.cuh"
#include "softmax.cuh"
#include "wgmma.cuh"
#include "prefill_ws_plan.cuh"  // ws_mask_rows

// How raw scores become log2-domain logits: folded into the exponent (mul = scale * log2 e) unless a
// softcap or a non-positive scale needs the general path.
struct WgScores {
  bool fold;
  float scale, softcap, inv_softcap, mul;
  CUPA_DEVICE WgScores(float scale_, float softcap_) {
    scale = scale_;
    softcap = softcap_;
    const float scale_log2 = scale_ * CUPA_LOG2E;
    fold = !(softcap_ > 0.0f) && scale_log2 > 0.0f;
    mul = fold ? scale_log2 : 1.0f;
    inv_softcap = softcap_ > 0.0f ? 1.0f / softcap_ : 0.0f;
  }
};

// Online softmax of one key tile (keys kt0 .. kt0 + KEYS - 1) of this thread's two rows, row0 and
// row0 + 8 of the CTA's rows: masks (unless `interior`: every key mapped and admitted by every row)
// from the mapped-key bits mw and the rows' ranges lo_row / hi_row, updates row_max / row_sum
// (row_sum: this lane's share), rescales o and writes P (T) as the A fragments of the KEYS / 16 k16
// steps of O += P V (step j2: keys 16 j2 .. 16 j2 + 15 = accumulator n8 blocks 2 j2 and 2 j2 + 1).
template <typename T, int KEYS, int D>
CUPA_DEVICE void wg_softmax_tile(float (&s)[KEYS / 2], float (&o)[D / 2], unsigned (&p)[KEYS / 16][4],
                                 float (&row_max)[2], float (&row_sum)[2], const unsigned (&mw)[KEYS / 32],
                                 bool interior, int kt0, const int* lo_row, const int* hi_row, int row0, int lane,
                                 const WgScores& sc) {
  // Rare transforms under one uniform branch: softcap, or a scale that cannot be folded.
  if (!sc.fold) {
#pragma unroll
    for (int i = 0; i < KEYS / 2; ++i) {
      float v = s[i] * sc.scale;
      if (sc.softcap > 0.0f) v = sc.softcap * tanhf(v * sc.inv_softcap);
      s[i] = v * CUPA_LOG2E;
    }
  }
  if (!interior) ws_mask_rows<KEYS>(s, lo_row, hi_row, row0, kt0, mw, lane, CUPA_NEG_INF);  // (ranges from shared memory)
  float c[2];
  {
    float mx[2] = {CUPA_NEG_INF, CUPA_NEG_INF};
#pragma unroll
    for (int j = 0; j < KEYS / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) mx[e >> 1] = fmaxf(mx[e >> 1], s[4 * j + e]);
    }
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      mx[hf] = fmaxf(mx[hf], __shfl_xor_sync(0xffffffffu, mx[hf], 1));
      mx[hf] = fmaxf(mx[hf], __shfl_xor_sync(0xffffffffu, mx[hf], 2));
      const float nm = fmaxf(row_max[hf], mx[hf] * sc.mul);
      // A row with no admitted key yet (max -inf before and after) has o == 0, sum == 0; its
      // exponent base is 0 so that masked scores (-inf) give exp2(-inf) = 0.
      c[hf] = row_max[hf] == nm ? 1.0f : ex2_approx(row_max[hf] - nm);
      row_max[hf] = nm;
    }
  }
  {
    float base[2], sum[2] = {0.0f, 0.0f};
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) base[hf] = row_max[hf] == CUPA_NEG_INF ? 0.0f : row_max[hf];
#pragma unroll
    for (int j = 0; j < KEYS / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[4 * j + e] = ex2_approx(fmaf(s[4 * j + e], sc.mul, -base[e >> 1]));
        sum[e >> 1] += s[4 * j + e];
      }
    }
    row_sum[0] = row_sum[0] * c[0] + sum[0];
    row_sum[1] = row_sum[1] * c[1] + sum[1];
  }
  if (__any_sync(0xffffffffu, c[0] != 1.0f || c[1] != 1.0f)) {
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      o[4 * n + 0] *= c[0];
      o[4 * n + 1] *= c[0];
      o[4 * n + 2] *= c[1];
      o[4 * n + 3] *= c[1];
    }
  }
#pragma unroll
  for (int j2 = 0; j2 < KEYS / 16; ++j2) {
    p[j2][0] = Mma<T>::pack(s[8 * j2 + 0], s[8 * j2 + 1]);
    p[j2][1] = Mma<T>::pack(s[8 * j2 + 2], s[8 * j2 + 3]);
    p[j2][2] = Mma<T>::pack(s[8 * j2 + 4], s[8 * j2 + 5]);
    p[j2][3] = Mma<T>::pack(s[8 * j2 + 6], s[8 * j2 + 7]);
  }
}

// Epilogue of one warp's 16 rows (row0 = 16 warp + lane / 4 and row0 + 8 for this thread): finalize
// them into their rows of the [ROWS][128] swizzled tile sO (as T; the caller has made sure no wgmma
// still reads those rows), then store the warp's whole rows of owned tokens (tok_row >= 0) to out, and
// their log-sum-exp to lse when it is asked for (non-null). VSCALE (8-bit caches): V's scale, v_all for
// every channel (in the rows' factor), or v_channel[d] per channel (non-null), applied in float before the
// one rounding to T.
template <typename T, int ROWS, int D, bool VSCALE = false>
CUPA_DEVICE void wg_store_rows(const float (&o)[D / 2], const float (&row_max)[2], float (&row_sum)[2], int warp_row,
                               int lane, unsigned char* sO, const int* lo_row, const int* hi_row, const int* head_row,
                               const int* tok_row, const T* __restrict__ head_sink, T* __restrict__ out,
                               float* __restrict__ lse, int H, const float* __restrict__ v_channel = nullptr,
                               float v_all = 1.0f) {
  const bool has_sink = head_sink != nullptr;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    row_sum[i] += __shfl_xor_sync(0xffffffffu, row_sum[i], 1);
    row_sum[i] += __shfl_xor_sync(0xffffffffu, row_sum[i], 2);
  }
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const int row = warp_row + (lane >> 2) + 8 * hf;
    const bool live = hi_row[row] > lo_row[row];
    const float sink = has_sink ? Act<T>::to_float(head_sink[head_row[row]]) : 0.0f;
    // finalize() of a unit O is the row's factor (sink and 1/L). A row without admitted keys writes
    // zeros, selected (its o may hold anything: interior tiles are not masked for it).
    float factor = live ? finalize(row_max[hf] * CUPA_LN2, row_sum[hf], 1.0f, has_sink, sink, 1.0f) : 0.0f;
    if constexpr (VSCALE) factor *= v_all;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      const int d = n * 8 + (lane & 3) * 2;
      float x0 = live ? o[4 * n + 2 * hf] * factor : 0.0f, x1 = live ? o[4 * n + 2 * hf + 1] * factor : 0.0f;
      if constexpr (VSCALE) {
        if (v_channel != nullptr) {  // (scalar loads: a scale tensor need not be 16-byte aligned)
          x0 *= __ldg(v_channel + d);
          x1 *= __ldg(v_channel + d + 1);
        }
      }
      *reinterpret_cast<unsigned*>(sO + wg_off<ROWS>(row, d)) = Mma<T>::pack(x0, x1);
    }
  }
  if (lse && (lane & 3) == 0) {  // the rows' log-sum-exp, when asked for: one lane of each quad
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int row = warp_row + (lane >> 2) + 8 * hf;
      if (tok_row[row] >= 0)
        lse[(long long)tok_row[row] * H + head_row[row]] =
            hi_row[row] > lo_row[row] ? state_lse(row_max[hf] * CUPA_LN2, row_sum[hf]) : CUPA_NEG_INF;
    }
  }
  __syncwarp();
  for (int c = lane; c < 16 * (D / 8); c += 32) {
    const int r = warp_row + c / (D / 8), col = (c % (D / 8)) * 8;
    const int tok = tok_row[r];
    if (tok < 0) continue;
    *reinterpret_cast<uint4*>(out + ((long long)tok * H + head_row[r]) * D + col) =
        *reinterpret_cast<const uint4*>(sO + wg_off<ROWS>(r, col));
  }
}
