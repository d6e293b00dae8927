// Cache element kinds and the quantization rule (SPEC 4.1), written once for every kernel.
// A quantized cache stores code = saturate(round_half_even(float32(x_T) * float32(1/scale)));
// it is read back as code * scale. Scales are float32, (1,) PER_TENSOR or (Hk, 1, D) PER_CHANNEL.
#pragma once
#include "common.cuh"

enum QuantMode { QUANT_NONE = 0, QUANT_PER_TENSOR = 1, QUANT_PER_CHANNEL = 2 };

// The cache holds T itself.
template <typename T> struct CacheSame {
  using storage = T;
  static constexpr bool quantized = false;
  static CUPA_DEVICE float decode(storage c) { return Act<T>::to_float(c); }
  static CUPA_DEVICE storage encode(float x_t, float /*inv_scale*/) { return Act<T>::from_float(x_t); }
};

// int8 codes, saturated to [-128, 127].
struct CacheInt8 {
  using storage = signed char;
  static constexpr bool quantized = true;
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
  static CUPA_DEVICE float decode(storage c) {
    __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(c), __NV_E4M3);
    return __half2float(__ushort_as_half(h.x));
  }
  static CUPA_DEVICE storage encode(float x_t, float inv_scale) {
    return static_cast<storage>(__nv_cvt_float_to_fp8(__fmul_rn(x_t, inv_scale), __NV_SATFINITE, __NV_E4M3));
  }
};

// Scale of channel c of KV head h (mode != NONE).
CUPA_DEVICE float quant_scale(const float* scale, int mode, int kv_head, int head_size, int c) {
  return mode == QUANT_PER_CHANNEL ? scale[kv_head * head_size + c] : scale[0];
}
