// Tensor-core and async-copy building blocks (sm_80+): cp.async with zero fill, ldmatrix,
// mma.sync m16n8k16 with fp32 accumulation, and the XOR swizzle of 16-byte chunks that
// keeps ldmatrix conflict-free on rows of 64 or more 16-bit elements.
#pragma once
#include "common.cuh"

CUPA_DEVICE unsigned smem_addr(const void* p) { return static_cast<unsigned>(__cvta_generic_to_shared(p)); }

// Copy 16 bytes global -> shared asynchronously, or write 16 zeros without reading the source
// (copy == 0: cp.async's ignore-src predicate). saddr: a shared-space address (smem_addr).
CUPA_DEVICE void cp_async_16_or_zero(unsigned saddr, const void* gmem, int copy) {
  asm volatile("{\n .reg .pred p;\n setp.eq.s32 p, %2, 0;\n cp.async.cg.shared.global [%0], [%1], 16, p;\n}\n"
               ::"r"(saddr), "l"(gmem), "r"(copy));
}
CUPA_DEVICE void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> CUPA_DEVICE void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

CUPA_DEVICE void ldmatrix_x4(unsigned (&r)[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(smem)));
}
CUPA_DEVICE void ldmatrix_x4_at(unsigned (&r)[4], unsigned saddr) {  // (a shared-space address)
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(saddr));
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
