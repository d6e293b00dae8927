// Shared device code: element types of activations (T) and caches, vector loads, conversions.
// Every piece of dtype math used by more than one kernel lives here, once.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#define CUPA_DEVICE __device__ __forceinline__
#define CUPA_NEG_INF __int_as_float(0xff800000)

// ---- programmatic dependent launch (compute capability 9.0+; no-ops before) ---------------------
// The prologue lets the attention kernel that follows it be scheduled at once; that kernel runs
// its preamble (token lookup, block-table reads) and then waits before it reads what the prologue
// writes (Q workspace, cache rows, split counters). The decode kernels wait in every CTA, also
// before exiting; the prefill kernels reading new K/V from the inputs (NewKeys, prefill_tiles.cuh)
// wait only in the CTAs that read cache rows, and in CTA 0: a grid one of whose CTAs waited
// cannot complete ahead of the prologue, so the stream order after the pair stays that of two plain
// launches. Without a programmatic launch the wait returns at once.
CUPA_DEVICE void grid_dependency_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
CUPA_DEVICE void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// ---- activations ----------------------------------------------------------------------
template <typename T> struct Act;
template <> struct Act<float> {
  static CUPA_DEVICE float to_float(float x) { return x; }
  static CUPA_DEVICE float from_float(float x) { return x; }
};
template <> struct Act<__half> {
  static CUPA_DEVICE float to_float(__half x) { return __half2float(x); }
  static CUPA_DEVICE __half from_float(float x) { return __float2half_rn(x); }
};
template <> struct Act<__nv_bfloat16> {
  static CUPA_DEVICE float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
  static CUPA_DEVICE __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
};

// Round a float to T and back: the value a T tensor would hold.
template <typename T> CUPA_DEVICE float round_to(float x) { return Act<T>::to_float(Act<T>::from_float(x)); }

// ---- 8-element vectors ----------------------------------------------------------------
// Kernels move 8 consecutive elements at a time: 16 bytes for 16-bit types, two 16-byte
// loads for float, 8 bytes for 1-byte cache codes. head_size % 8 == 0 keeps them aligned.
template <int BYTES> struct VecBytes;
template <> struct VecBytes<8> { using type = uint2; };
template <> struct VecBytes<16> { using type = uint4; };
template <> struct VecBytes<32> { struct type { uint4 a, b; }; };

template <typename E> struct Vec8 {
  using raw = typename VecBytes<8 * sizeof(E)>::type;
  raw v;
  CUPA_DEVICE void load(const E* p) { v = *reinterpret_cast<const raw*>(p); }
  CUPA_DEVICE void load_nc(const E* p) {
    // Read-only path: caches are not written by the kernel that reads them.
    v = __ldg(reinterpret_cast<const raw*>(p));
  }
  CUPA_DEVICE void store(E* p) const { *reinterpret_cast<raw*>(p) = v; }
  CUPA_DEVICE const E* elems() const { return reinterpret_cast<const E*>(&v); }
  CUPA_DEVICE E* elems() { return reinterpret_cast<E*>(&v); }
};
template <> CUPA_DEVICE void Vec8<float>::load_nc(const float* p) {
  const uint4* q = reinterpret_cast<const uint4*>(p);
  v.a = __ldg(q);
  v.b = __ldg(q + 1);
}

// Load 8 activations as floats.
template <typename T> CUPA_DEVICE void load8(const T* p, float (&out)[8]) {
  Vec8<T> v;
  v.load(p);
#pragma unroll
  for (int i = 0; i < 8; ++i) out[i] = Act<T>::to_float(v.elems()[i]);
}

// Store 8 floats as T (round to nearest even).
template <typename T> CUPA_DEVICE void store8(T* p, const float (&in)[8]) {
  Vec8<T> v;
#pragma unroll
  for (int i = 0; i < 8; ++i) v.elems()[i] = Act<T>::from_float(in[i]);
  v.store(p);
}

// Two 16-bit T values (one register, as mma fragments hold them) with each Inf or NaN replaced by
// +0: adding the exponent field's lowest bit carries into the sign bit exactly when the field is
// all ones, and that bit becomes a 16-bit mask.
template <typename T> struct Bits16;
template <> struct Bits16<__half> { static constexpr unsigned exponent = 0x7c007c00u, exponent_lsb = 0x04000400u; };
template <> struct Bits16<__nv_bfloat16> {
  static constexpr unsigned exponent = 0x7f807f80u, exponent_lsb = 0x00800080u;
};
template <typename T> CUPA_DEVICE unsigned finite_or_zero2(unsigned x) {
  const unsigned top = ((x & Bits16<T>::exponent) + Bits16<T>::exponent_lsb) & 0x80008000u;
  return x & ~(top | (top - (top >> 15)));
}

CUPA_DEVICE float warp_sum(float x, int width = 32) {
  for (int off = width / 2; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off, width);
  return x;
}
