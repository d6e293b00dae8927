// Cache element kinds and the quantization rule (contract §4.1), written once for every kernel.
// A quantized cache stores code = saturate(round_half_even(float32(x_T) * float32(1/scale)));
// it is read back as code * scale. Scales are float32, (1,) PER_TENSOR or (Hk, 1, D) PER_CHANNEL.
// Each trait's PACK is the codes one storage element holds: 2 for the packed 4-bit kinds (code 2i
// in the low nibble of byte i, 2i+1 in the high nibble), so a cache row of D codes is D / PACK
// storage elements. The 4-bit encoders and widenings are also host functions: tests/test_subbyte.py
// compiles them for the host and checks them against the NumPy write and read rules.
#pragma once
#include "common.cuh"

#define CUPA_HOST_DEVICE __host__ __device__ __forceinline__

// a * b rounded to nearest even, never contracted into an FMA.
CUPA_HOST_DEVICE float mul_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

// __byte_perm (prmt without a mode) on the device; the same selection on the host.
CUPA_HOST_DEVICE unsigned byte_perm(unsigned a, unsigned b, unsigned selector) {
#ifdef __CUDA_ARCH__
  return __byte_perm(a, b, selector);
#else
  const unsigned long long bytes = ((unsigned long long)b << 32) | a;
  unsigned r = 0;
  for (int i = 0; i < 4; ++i) r |= (unsigned)((bytes >> (8 * ((selector >> (4 * i)) & 7u))) & 0xffu) << (8 * i);
  return r;
#endif
}

enum QuantMode { QUANT_NONE = 0, QUANT_PER_TENSOR = 1, QUANT_PER_CHANNEL = 2 };

// The cache holds T itself.
template <typename T> struct CacheSame {
  using storage = T;
  static constexpr int PACK = 1;
  static constexpr bool quantized = false;
  static constexpr bool always_finite = false;  // any bits (Inf, NaN) may sit in a cache row
  static CUPA_DEVICE float decode(storage c) { return Act<T>::to_float(c); }
  static CUPA_DEVICE storage encode(float x_t, float /*inv_scale*/) { return Act<T>::from_float(x_t); }
};

// int8 codes, saturated to [-128, 127].
struct CacheInt8 {
  using storage = signed char;
  static constexpr int PACK = 1;
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
  static constexpr int PACK = 1;
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

// int4 codes, round half to even saturated to [-8, 7] (NaN saturates to -8, as fmaxf picks the
// bound), stored as the nibble code + 8 and read as nibble - 8; two a byte.
struct CacheInt4 {
  using storage = unsigned char;
  static constexpr int PACK = 2;
  static constexpr bool quantized = true;
  static constexpr bool always_finite = true;
  static CUPA_HOST_DEVICE unsigned encode_nibble(float x_t, float inv_scale) {
    const float q = fminf(fmaxf(rintf(mul_rn(x_t, inv_scale)), -8.0f), 7.0f);
    return static_cast<unsigned>(static_cast<int>(q) + 8);
  }
  static CUPA_HOST_DEVICE float decode_nibble(unsigned n) { return static_cast<float>(static_cast<int>(n & 15u) - 8); }
};

// float4 e2m1 codes (sign, 2 exponent bits, 1 mantissa bit: +-{0, 0.5, 1, 1.5, 2, 3, 4, 6}), round to
// nearest even saturated to +-6; NaN becomes +6, as CUDA's __nv_cvt_float_to_fp4 and the satfinite
// cvt instruction give. Two a byte.
struct CacheFp4 {
  using storage = unsigned char;
  static constexpr int PACK = 2;
  static constexpr bool quantized = true;
  static constexpr bool always_finite = true;
  static CUPA_HOST_DEVICE unsigned encode_nibble(float x_t, float inv_scale) {
    const float y = mul_rn(x_t, inv_scale);
    if (y != y) return 7u;
    // Magnitude code = how many of the midpoints between neighbouring values |y| passes; a tie goes
    // to the even code (0.25 -> 0, 0.75 -> 1.0, 1.25 -> 1.0, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4).
    const float a = fabsf(y);
    const unsigned m = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) + (a > 5.0f);
    return m | (signbit(y) ? 8u : 0u);
  }
  static CUPA_HOST_DEVICE float decode_nibble(unsigned n) {
    const unsigned m = n & 7u;
    const float mag = m < 2u ? 0.5f * static_cast<float>(m) : 0.5f * static_cast<float>((2u + (m & 1u)) << ((m >> 1) - 1u));
    return (n & 8u) ? -mag : mag;
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

// ---- packed 4-bit codes -> T (fp16 / bf16) ---------------------------------------------------
// Widen8<T, Cache>::run(w, r): the 8 codes of a 32-bit word (code j in bits 4j..4j+3) as four pairs
// of T in mma-fragment registers, r[i] = (code i, code i + 4) (code i in the low half). Exact: every
// int4 and e2m1 value is representable in fp16 and bf16.
// int4: the nibble goes into the mantissa of 1024 (fp16) or 128 (bf16), then the bias and 8 are
// subtracted. e2m1: the nibble at the top of each 16-bit half becomes the sign, the two low exponent
// bits and the top mantissa bit of T, which is the value times 2^-14 (fp16) or 2^-126 (bf16; values
// 0 and 0.5 land on subnormals, which fp16 and bf16 multiplies keep); one multiply rescales it.
template <typename T> struct Bits4;
template <> struct Bits4<__half> {
  static constexpr unsigned int4_magic = 0x64006400u, int4_bias = 0x64086408u;  // 1024; 1024 + 8
  static constexpr int fp4_shift = 3;
  static constexpr unsigned fp4_scale = 0x74007400u;  // 2^14
};
template <> struct Bits4<__nv_bfloat16> {
  static constexpr unsigned int4_magic = 0x43004300u, int4_bias = 0x43084308u;  // 128; 128 + 8
  static constexpr int fp4_shift = 6;
  static constexpr unsigned fp4_scale = 0x7e807e80u;  // 2^126
};
template <typename T> struct Pair;
template <> struct Pair<__half> {
  static CUPA_HOST_DEVICE unsigned sub(unsigned a, unsigned b) { return bits_of(__hsub2(of_bits(a), of_bits(b))); }
  static CUPA_HOST_DEVICE unsigned mul(unsigned a, unsigned b) { return bits_of(__hmul2(of_bits(a), of_bits(b))); }
  static CUPA_HOST_DEVICE __half2 of_bits(unsigned u) { return *reinterpret_cast<const __half2*>(&u); }
  static CUPA_HOST_DEVICE unsigned bits_of(__half2 h) { return *reinterpret_cast<const unsigned*>(&h); }
};
template <> struct Pair<__nv_bfloat16> {
  static CUPA_HOST_DEVICE unsigned sub(unsigned a, unsigned b) { return bits_of(__hsub2(of_bits(a), of_bits(b))); }
  static CUPA_HOST_DEVICE unsigned mul(unsigned a, unsigned b) { return bits_of(__hmul2(of_bits(a), of_bits(b))); }
  static CUPA_HOST_DEVICE __nv_bfloat162 of_bits(unsigned u) { return *reinterpret_cast<const __nv_bfloat162*>(&u); }
  static CUPA_HOST_DEVICE unsigned bits_of(__nv_bfloat162 h) { return *reinterpret_cast<const unsigned*>(&h); }
};

template <typename T, typename Cache> struct Widen8;
template <typename T> struct Widen8<T, CacheInt4> {
  static CUPA_HOST_DEVICE void run(unsigned w, unsigned (&r)[4]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) r[i] = Pair<T>::sub(((w >> (4 * i)) & 0x000f000fu) | Bits4<T>::int4_magic, Bits4<T>::int4_bias);
  }
};
template <typename T> struct Widen8<T, CacheFp4> {
  static CUPA_HOST_DEVICE void run(unsigned w, unsigned (&r)[4]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const unsigned top = w << (12 - 4 * i);  // codes i and i + 4 at bits 12..15 and 28..31
      r[i] = Pair<T>::mul((top & 0x80008000u) | ((top & 0x70007000u) >> Bits4<T>::fp4_shift), Bits4<T>::fp4_scale);
    }
  }
};

// The 16 codes of 8 bytes (two words) in order, as 16 T values (two 16-byte chunks): codes 0..7 to
// dst_lo, 8..15 to dst_hi (the widened shared-memory tiles of the prefill kernel).
template <typename T, typename Cache> CUPA_HOST_DEVICE void widen16_packed(const unsigned char* src, T* dst_lo, T* dst_hi) {
  const uint2 w = *reinterpret_cast<const uint2*>(src);
  uint4 out[2];
  const unsigned words[2] = {w.x, w.y};
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    unsigned r[4];
    Widen8<T, Cache>::run(words[h], r);  // (0, 4), (1, 5), (2, 6), (3, 7)
    out[h].x = byte_perm(r[0], r[1], 0x5410);  // (0, 1)
    out[h].y = byte_perm(r[2], r[3], 0x5410);  // (2, 3)
    out[h].z = byte_perm(r[0], r[1], 0x7632);  // (4, 5)
    out[h].w = byte_perm(r[2], r[3], 0x7632);  // (6, 7)
  }
  *reinterpret_cast<uint4*>(dst_lo) = out[0];
  *reinterpret_cast<uint4*>(dst_hi) = out[1];
}

// One byte of two codes (channels c and c + 1 of a row) written by the prologue.
template <typename Cache> CUPA_DEVICE unsigned char encode_pair(float x0, float inv0, float x1, float inv1) {
  return static_cast<unsigned char>(Cache::encode_nibble(x0, inv0) | (Cache::encode_nibble(x1, inv1) << 4));
}
