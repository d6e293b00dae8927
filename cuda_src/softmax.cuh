// Online-softmax state, the merge of partial states, and the epilogue (sink, V scale).
// One definition used by the in-CTA combine, the split merge and the single-split epilogue,
// so a call with one non-empty split gives the same bits whichever path finishes it.
#pragma once
#include "common.cuh"

// A partial state over some keys: m = running max, l = sum exp(s - m), o = sum exp(s - m) v.
// l == 0 means "no admitted key" (m is then -inf and o is 0).

#ifndef CUPA_LOG2E
#define CUPA_LOG2E 1.4426950408889634f
#endif
#ifndef CUPA_LN2
#define CUPA_LN2 0.6931471805599453f
#endif

// 2^x in one MUFU.EX2 (ex2.approx.ftz: 2^-inf = 0).
CUPA_DEVICE float ex2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Scale factor that moves a state with max m onto max M (M >= m); 0 for an empty state.
CUPA_DEVICE float rescale(float m, float M) { return m == CUPA_NEG_INF ? 0.0f : __expf(m - M); }

CUPA_DEVICE float softcap_score(float s, float softcap) {
  return softcap > 0.0f ? softcap * tanhf(s / softcap) : s;
}

// Final output value of one channel from a merged (M, L, O) state.
// sink: the per-head sink logit (has_sink) adds exp(sink - M') to the denominator only.
CUPA_DEVICE float finalize(float M, float L, float O, bool has_sink, float sink, float v_scale) {
  if (L == 0.0f) return 0.0f;  // no admitted key: zeros, never NaN (even with a sink)
  if (has_sink) {
    const float Ms = fmaxf(M, sink);
    const float c = __expf(M - Ms);
    L = L * c + __expf(sink - Ms);
    O = O * c;
  }
  return O / L * v_scale;
}

// Natural-log log-sum-exp of a merged state (M natural units, L = sum exp(s - M)); -inf without an
// admitted key (the return_lse output; a sink is never part of it).
CUPA_DEVICE float state_lse(float M, float L) { return L > 0.0f ? M + logf(L) : CUPA_NEG_INF; }
