// Cache element kinds and the quantization rule (contract §4.1), written once for every kernel.
// A quantized cache stores code = saturate(round_half_even(float32(x_T) * float32(1/scale)));
// it is read back as code * scale. Scales are float32, (1,) PER_TENSOR or (Hk, 1, D) PER_CHANNEL.
#pragma once
#include "common.cuh"

enum QuantMode { QUANT_NONE = 0, QUANT_PER_TENSOR = 1, QUANT_PER_CHANNEL = 2 };

// The cache holds T itself.
template <typename T> struct CacheSame {
  using storage = T;
  static constexpr bool quantized = false;
  static constexpr bool always_finite = false;  // any bits (Inf, NaN) may sit in a cache row
  static CUPA_DEVICE float decode(storage c) { return Act<T>::to_float(c); }
  static CUPA_DEVICE storage encode(float x_t, float /*inv_scale*/) { return Act<T>::from_float(x_t); }
};

// int8 codes, saturated to [-128, 127].
struct CacheInt8 {
  using storage = signed char;
  static constexpr bool quantized = true;
  static constexpr bool always_finite = true;
  static CUPA_DEVICE float decode(storage c) { return static_cast<float>(c); }
  static CUPA_DEVICE storage encode(float x_t, float inv_scale) {
    float q = rintf(__fmul_rn(x_t, inv_scale));  // rintf: round half to even
    q = fminf(fmaxf(q, -128.0f), 127.0f);
    return static_cast<storage>(static_cast<int>(q));
  }
};

// float8 e4m3fn codes held as bytes; round to nearest even, saturated to +-448.
struct CacheFp8 {
  using storage = unsigned char;
  static constexpr bool quantized = true;
  static constexpr bool always_finite = false;  // 0x7f and 0xff are NaN
  static CUPA_DEVICE float decode(storage c) {
    __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(c), __NV_E4M3);
    return __half2float(__ushort_as_half(h.x));
  }
  static CUPA_DEVICE storage encode(float x_t, float inv_scale) {
    return static_cast<storage>(__nv_cvt_float_to_fp8(__fmul_rn(x_t, inv_scale), __NV_SATFINITE, __NV_E4M3));
  }
  // Four codes (a 32-bit word) with each NaN replaced by 0: adding 1 to the low 7 bits carries into
  // bit 7 exactly when they are all ones, and that bit becomes a byte mask.
  static CUPA_DEVICE unsigned finite4(unsigned w) {
    const unsigned top = ((w & 0x7f7f7f7fu) + 0x01010101u) & 0x80808080u;
    return w & ~(top | (top - (top >> 7)));
  }
};

// Scale of channel c of KV head h (mode != NONE).
CUPA_DEVICE float quant_scale(const float* scale, int mode, int kv_head, int head_size, int c) {
  return mode == QUANT_PER_CHANNEL ? scale[kv_head * head_size + c] : scale[0];
}

// Widen 4 cache codes (one 32-bit word, code i in byte i) to 4 values of T, packed in pairs
// (lo = codes 0,1; hi = codes 2,3). Exact: int8 and e4m3 values are representable in fp16/bf16.
template <typename T, typename Cache> struct Widen4 {
  static CUPA_DEVICE void run(unsigned w, unsigned& lo, unsigned& hi) {
    T v[4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
      v[i] = Act<T>::from_float(Cache::decode(static_cast<typename Cache::storage>((w >> (8 * i)) & 0xffu)));
    lo = *reinterpret_cast<unsigned*>(&v[0]);
    hi = *reinterpret_cast<unsigned*>(&v[2]);
  }
};

CUPA_DEVICE unsigned half2_bits(__half2 h) { return *reinterpret_cast<unsigned*>(&h); }
CUPA_DEVICE __half2 bits_half2(unsigned u) { return *reinterpret_cast<__half2*>(&u); }
CUPA_DEVICE unsigned half2_to_bf162_bits(unsigned u) {
  __nv_bfloat162 b = __float22bfloat162_rn(__half22float2(bits_half2(u)));
  return *reinterpret_cast<unsigned*>(&b);
}

// int8 -> fp16 without conversions: 0x64XX is the half 1024 + XX; bias the code by 128 first.
CUPA_DEVICE void int8x4_to_half2x2(unsigned w, unsigned& lo, unsigned& hi) {
  const unsigned u = w ^ 0x80808080u;
  const __half2 bias = bits_half2(0x64806480u);  // 1152 = 1024 + 128
  lo = half2_bits(__hsub2(bits_half2(__byte_perm(u, 0x64646464u, 0x4140)), bias));
  hi = half2_bits(__hsub2(bits_half2(__byte_perm(u, 0x64646464u, 0x4342)), bias));
}
// e4m3 pairs -> fp16 pairs (one cvt per pair on sm_89+). sm_89+: both halves of the word go
// to cvt through a 16-bit register split, which ptxas turns into a .H1 operand (no shift).
CUPA_DEVICE void fp8x4_to_half2x2(unsigned w, unsigned& lo, unsigned& hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.rn.f16x2.e4m3x2 %0, l;\n cvt.rn.f16x2.e4m3x2 %1, h;\n}\n"
      : "=r"(lo), "=r"(hi) : "r"(w));
#else
  __half2_raw a = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w & 0xffffu), __NV_E4M3);
  __half2_raw b = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w >> 16), __NV_E4M3);
  lo = (unsigned)a.x | ((unsigned)a.y << 16);
  hi = (unsigned)b.x | ((unsigned)b.y << 16);
#endif
}
template <> struct Widen4<__half, CacheInt8> {
  static CUPA_DEVICE void run(unsigned w, unsigned& lo, unsigned& hi) { int8x4_to_half2x2(w, lo, hi); }
};
template <> struct Widen4<__half, CacheFp8> {
  static CUPA_DEVICE void run(unsigned w, unsigned& lo, unsigned& hi) { fp8x4_to_half2x2(w, lo, hi); }
};
template <> struct Widen4<__nv_bfloat16, CacheInt8> {
  static CUPA_DEVICE void run(unsigned w, unsigned& lo, unsigned& hi) {
    int8x4_to_half2x2(w, lo, hi);
    lo = half2_to_bf162_bits(lo);
    hi = half2_to_bf162_bits(hi);
  }
};
template <> struct Widen4<__nv_bfloat16, CacheFp8> {
  static CUPA_DEVICE void run(unsigned w, unsigned& lo, unsigned& hi) {
    fp8x4_to_half2x2(w, lo, hi);
    lo = half2_to_bf162_bits(lo);
    hi = half2_to_bf162_bits(hi);
  }
};

// Widen 16 cache codes (one 16-byte chunk) to 16 T values (two 16-byte chunks); FINITE: codes that
// decode to a non-finite value (Cache::finite4) are widened as 0.
template <typename T, typename Cache, bool FINITE = false>
CUPA_DEVICE void widen16(const typename Cache::storage* src, T* dst_lo, T* dst_hi) {
  uint4 w = *reinterpret_cast<const uint4*>(src);
  if constexpr (FINITE) {
    w.x = Cache::finite4(w.x);
    w.y = Cache::finite4(w.y);
    w.z = Cache::finite4(w.z);
    w.w = Cache::finite4(w.w);
  }
  uint4 a, b;
  Widen4<T, Cache>::run(w.x, a.x, a.y);
  Widen4<T, Cache>::run(w.y, a.z, a.w);
  Widen4<T, Cache>::run(w.z, b.x, b.y);
  Widen4<T, Cache>::run(w.w, b.z, b.w);
  *reinterpret_cast<uint4*>(dst_lo) = a;
  *reinterpret_cast<uint4*>(dst_hi) = b;
}
