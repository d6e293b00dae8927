// Host driver of the packed 4-bit code paths of cuda_src/quant.cuh (tests/test_subbyte.py).
// Reads little-endian binary from stdin and writes binary to stdout:
//   encode: float32 pairs (x, inv_scale) -> per pair uint8 [int4 nibble, e2m1 nibble, CUDA's e2m1 code]
//   decode: -> float32 [int4 value, e2m1 value] for each of the 16 nibbles
//   widen:  uint32 words -> per word 4 x 4 uint32: Widen8 of (fp16, int4), (fp16, e2m1), (bf16, int4), (bf16, e2m1)
//   natural: 8-byte groups -> per group 4 x 8 uint32: widen16_packed in the same four combinations
#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>
#include <cuda_fp4.h>
#include "quant.cuh"

template <typename T, typename Cache> void widen(unsigned w, std::vector<unsigned>& out) {
  unsigned r[4];
  Widen8<T, Cache>::run(w, r);
  out.insert(out.end(), r, r + 4);
}
template <typename T, typename Cache> void natural(const unsigned char* src, std::vector<unsigned>& out) {
  alignas(16) T lo[8], hi[8];
  widen16_packed<T, Cache>(src, lo, hi);
  unsigned u[8];
  memcpy(u, lo, 16);
  memcpy(u + 4, hi, 16);
  out.insert(out.end(), u, u + 8);
}

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  std::vector<unsigned char> in;
  unsigned char buf[1 << 16];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, stdin)) > 0) in.insert(in.end(), buf, buf + n);
  const char* mode = argv[1];
  if (!strcmp(mode, "encode")) {
    std::vector<unsigned char> out;
    for (size_t i = 0; i + 8 <= in.size(); i += 8) {
      float x, inv;
      memcpy(&x, &in[i], 4);
      memcpy(&inv, &in[i + 4], 4);
      out.push_back((unsigned char)CacheInt4::encode_nibble(x, inv));
      out.push_back((unsigned char)CacheFp4::encode_nibble(x, inv));
      out.push_back((unsigned char)__nv_cvt_float_to_fp4(mul_rn(x, inv), __NV_E2M1, cudaRoundNearest));
    }
    fwrite(out.data(), 1, out.size(), stdout);
  } else if (!strcmp(mode, "decode")) {
    float out[32];
    for (unsigned v = 0; v < 16; ++v) {
      out[2 * v] = CacheInt4::decode_nibble(v);
      out[2 * v + 1] = CacheFp4::decode_nibble(v);
    }
    fwrite(out, 4, 32, stdout);
  } else if (!strcmp(mode, "widen")) {
    std::vector<unsigned> out;
    for (size_t i = 0; i + 4 <= in.size(); i += 4) {
      unsigned w;
      memcpy(&w, &in[i], 4);
      widen<__half, CacheInt4>(w, out);
      widen<__half, CacheFp4>(w, out);
      widen<__nv_bfloat16, CacheInt4>(w, out);
      widen<__nv_bfloat16, CacheFp4>(w, out);
    }
    fwrite(out.data(), 4, out.size(), stdout);
  } else if (!strcmp(mode, "natural")) {
    std::vector<unsigned> out;
    for (size_t i = 0; i + 8 <= in.size(); i += 8) {
      alignas(8) unsigned char src[8];
      memcpy(src, &in[i], 8);
      natural<__half, CacheInt4>(src, out);
      natural<__half, CacheFp4>(src, out);
      natural<__nv_bfloat16, CacheInt4>(src, out);
      natural<__nv_bfloat16, CacheFp4>(src, out);
    }
    fwrite(out.data(), 4, out.size(), stdout);
  } else {
    return 2;
  }
  return 0;
}
