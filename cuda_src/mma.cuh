// Tensor-core and async-copy building blocks (sm_80+): cp.async with zero fill, ldmatrix,
// mma.sync m16n8k16 with fp32 accumulation, and the XOR swizzle of 16-byte chunks that
// keeps ldmatrix conflict-free on rows of 64 or more 16-bit elements.
#pragma once
#include "common.cuh"

CUPA_DEVICE unsigned smem_addr(const void* p) { return static_cast<unsigned>(__cvta_generic_to_shared(p)); }

// Copy 16 bytes global -> shared asynchronously; src_bytes == 0 writes zeros (masked rows).
CUPA_DEVICE void cp_async_16(void* smem, const void* gmem, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem), "r"(src_bytes));
}
CUPA_DEVICE void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> CUPA_DEVICE void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

CUPA_DEVICE void ldmatrix_x4(unsigned (&r)[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(smem)));
}
CUPA_DEVICE void ldmatrix_x4_trans(unsigned (&r)[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(smem)));
}

template <typename T> struct Mma;
template <> struct Mma<__half> {
  static CUPA_DEVICE void run(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  static CUPA_DEVICE unsigned pack(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&h);
  }
};
template <> struct Mma<__nv_bfloat16> {
  static CUPA_DEVICE void run(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  static CUPA_DEVICE unsigned pack(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&h);
  }
};

// Element offset of (row, col) in a [rows][ROW_ELEMS] tile of 16-bit values whose 16-byte
// chunks are XOR-swizzled by row % 8 (ROW_ELEMS >= 64).
template <int ROW_ELEMS> CUPA_DEVICE int swz(int row, int col) {
  return row * ROW_ELEMS + ((((col >> 3) ^ (row & 7))) << 3) + (col & 7);
}

// Issue the cp.async copies of one K/V tile of KEYS rows gathered through precomputed element
// offsets (rows[key] < 0: masked, zero-filled), THREADS threads taking 16-byte chunks in turn.
// Tiles of 16-bit values are swizzled for ldmatrix; 1-byte code tiles are stored linearly and
// widened later.
template <typename C, bool LINEAR, int D, int KEYS, int THREADS>
CUPA_DEVICE void gather_kv_tile(C* sK, C* sV, const long long* rows, const C* key_cache, const C* value_cache,
                                int tid) {
  constexpr int ELEMS_PER_CHUNK = 16 / (int)sizeof(C);
  constexpr int CHUNKS_PER_ROW = D / ELEMS_PER_CHUNK;
  static_assert(KEYS * CHUNKS_PER_ROW % THREADS == 0, "whole copy rounds");
#pragma unroll
  for (int i = 0; i < KEYS * CHUNKS_PER_ROW / THREADS; ++i) {
    const int c = tid + i * THREADS;
    const int key = c / CHUNKS_PER_ROW, col = (c % CHUNKS_PER_ROW) * ELEMS_PER_CHUNK;
    const long long row = rows[key];
    const long long off = row >= 0 ? row + col : 0;
    const int bytes = row >= 0 ? 16 : 0;
    const int dst = LINEAR ? key * D + col : swz<D>(key, col);
    cp_async_16(sK + dst, key_cache + off, bytes);
    cp_async_16(sV + dst, value_cache + off, bytes);
  }
}
