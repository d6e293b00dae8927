// Hopper warpgroup MMA (wgmma, sm_90a only) building blocks: shared-memory matrix descriptors, the
// fences and group operations, the instruction shapes the wgmma prefill (cuda_src/prefill_wgmma_ws.cu)
// and the MLA kernel (cuda_src/mla_wgmma.cu) use; mbarriers, named barriers, setmaxnreg and TMA. Compile for sm_90a;
// plain sm_90 rejects every wgmma instruction.
//
// Matrix descriptor (64 bits; PTX ISA "Matrix Descriptor Format", CUTLASS GmmaDescriptor):
//   bits  0..13  start address >> 4 (a shared-space byte address; < 256 KB fits)
//   bits 16..29  leading dimension byte offset (LBO) >> 4
//   bits 32..45  stride dimension byte offset (SBO) >> 4
//   bits 49..51  base offset (0 here: every swizzle atom starts on a 1024-byte boundary)
//   bits 62..63  swizzle mode: 0 none, 1 128B, 2 64B, 3 32B
// Every operand here uses the 128B swizzle on 16-bit elements. Its atom is 8 rows of 128 bytes
// (64 elements) = 1024 bytes, 1024-aligned; within it the 16-byte chunk c of row r is stored at
// chunk c ^ r (address bits 4..6 XOR bits 7..9, which the hardware applies to the address it
// computes, so the start address may step by 32 bytes along K inside an atom).
// K-major operand (the reduction dimension contiguous: Q and K for S = Q K^T): element (row, k)
// of a [rows][64] slab sits at row*128 + (((k/8) ^ row%8) * 16) + (k%8)*2. SBO = 1024 (the next
// 8 rows); LBO is unused for swizzled K-major layouts (set to 1, as CUTLASS does); a k16 step
// inside the slab adds 32 bytes to the start address, the next 64 k's are the next slab.
// MN-major operand (B = V for O += P V: N = head dim contiguous, K = keys): CUTLASS's canonical
// SW128 MN-major layout ((8 elems, 8 chunks, m),(8 rows, k)) : ((1, 8, LBO),(64, SBO)) in elements:
// 64 N-values contiguous per 128-byte row, rows along K; LBO = the byte distance between
// consecutive 64-wide N slabs, SBO = the byte distance between consecutive 8-row K groups (1024).
#pragma once
#include "common.cuh"

template <typename T> struct WgIsHalf { static constexpr bool value = false; };
template <> struct WgIsHalf<__half> { static constexpr bool value = true; };

// A 128B-swizzle descriptor for the operand starting at shared-space byte address `saddr`.
CUPA_DEVICE unsigned long long wg_desc_sw128(unsigned saddr, unsigned lbo_bytes, unsigned sbo_bytes) {
  return (unsigned long long)((saddr & 0x3FFFFu) >> 4) |
         ((unsigned long long)((lbo_bytes >> 4) & 0x3FFFu) << 16) |
         ((unsigned long long)((sbo_bytes >> 4) & 0x3FFFu) << 32) | (1ull << 62);
}

// Order the accumulator / A-fragment registers written by ordinary instructions before the
// wgmma instructions that follow (required before the first wgmma of a sequence, and whenever
// those registers were touched since the previous wgmma).
CUPA_DEVICE void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
CUPA_DEVICE void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> CUPA_DEVICE void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
// Shared-memory writes of the generic proxy (st.shared, cp.async) become visible to the async
// proxy (wgmma operand reads) only after this fence (then a barrier publishes them to the CTA).
// PTX ISA, wgmma.fence: "An async proxy fence must be used to establish an ordering between prior
// writes to shared memory matrices and subsequent reads of the same matrices in a wgmma.mma_async
// instruction." (CUTLASS's cp.async GMMA mainloop, sm90_mma_multistage_gmma_ss_warpspecialized.hpp,
// publishes its cp.async stages with cp.async.mbarrier.arrive and no proxy fence, so for cp.async
// the fence may be redundant; it costs one instruction per thread per tile and is kept.)
// The reverse direction needs nothing: a wgmma's completion (wait_group) implies a generic-async
// proxy fence, so a stage or sQ may be rewritten once every warpgroup has waited and synced.
CUPA_DEVICE void fence_proxy_async_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// Keep the compiler from moving reads or writes of an accumulator across the asynchronous MMA:
// the register is "modified" here, so nothing that uses it can be scheduled to the other side.
template <int N> CUPA_DEVICE void wg_fence_operands(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int N> CUPA_DEVICE void wg_fence_operands(unsigned (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i])::"memory");
}

// Accumulator layout of every m64nNk16 .f32 instruction below (the same as N/8 mma.sync m16n8
// C fragments side by side): warp w of the warpgroup owns rows 16w..16w+15; lane l holds
// d[4j + e] = D[16w + l/4 + 8*(e/2)][8j + 2*(l%4) + e%2].
// A-from-registers layout (16-bit): the m16n8k16 A fragment of the warp's 16 rows:
// a[0] = (row l/4, k 2(l%4)..+1), a[1] = (row l/4+8, same k), a[2] = (row l/4, k 8+2(l%4)..+1),
// a[3] = (row l/4+8, k 8+2(l%4)..+1), each register two elements, the lower k in the low half.
// D[64 x 64] (+)= A[64 x 16] * B[16 x 64]; A and B from shared memory, both K-major (no transpose).
template <typename T> CUPA_DEVICE void wgmma_ss_m64n64k16(float (&d)[32], unsigned long long desc_a, unsigned long long desc_b, int scale_d) {
  if constexpr (WgIsHalf<T>::value) {
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %34, 0;\n"
        " wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(desc_a), "l"(desc_b), "r"(scale_d));
  } else {
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %34, 0;\n"
        " wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(desc_a), "l"(desc_b), "r"(scale_d));
  }
}
// D[64 x 128] (+)= A[64 x 16] * B[16 x 128]; A from registers (the m16n8k16 A fragment of each warp's
// 16 rows), B from shared memory MN-major (imm-trans-b = 1).
template <typename T> CUPA_DEVICE void wgmma_rs_m64n128k16_tb(float (&d)[64], const unsigned (&a)[4], unsigned long long desc_b, int scale_d) {
  if constexpr (WgIsHalf<T>::value) {
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %69, 0;\n"
        " wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));
  } else {
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %69, 0;\n"
        " wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));
  }
}
// D[64 x 128] (+)= A[64 x 16] * B[16 x 128]; A and B from shared memory, both K-major (no transpose).
template <typename T> CUPA_DEVICE void wgmma_ss_m64n128k16(float (&d)[64], unsigned long long desc_a, unsigned long long desc_b, int scale_d) {
  if constexpr (WgIsHalf<T>::value) {
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %66, 0;\n"
        " wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(desc_a), "l"(desc_b), "r"(scale_d));
  } else {
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %66, 0;\n"
        " wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(desc_a), "l"(desc_b), "r"(scale_d));
  }
}

// Byte offset of element (r, c) of a [ROWS_][128] 16-bit tile in the two-slab 128B-swizzle layout:
// slab c/64 at byte (c/64)*ROWS_*128, inside it row r at r*128 with 16-byte chunk (c/8)%8 stored at
// chunk ((c/8)%8) ^ (r%8).
template <int ROWS_> CUPA_DEVICE unsigned wg_off(int r, int c) {
  return (unsigned)((c >> 6) * (ROWS_ * 128) + r * 128 + ((((c >> 3) & 7) ^ (r & 7)) << 4) + (c & 7) * 2);
}

// 16 bytes of shared memory at a shared-space byte address (16-byte aligned).
CUPA_DEVICE void lds128(unsigned addr, unsigned (&w)[4]) {
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n" : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3]) : "r"(addr) : "memory");
}
CUPA_DEVICE void sts128(unsigned addr, unsigned w0, unsigned w1, unsigned w2, unsigned w3) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(w0), "r"(w1), "r"(w2), "r"(w3) : "memory");
}

// ---- warp specialization: mbarriers, named barriers, register reallocation ---------------------
// mbarrier objects (8 bytes of shared memory each) at shared-space byte addresses. A phase
// completes when `count` arrivals have been made and every cp.async tracked by
// mbar_arrive_on_cp_async has landed; waiters name the parity of the phase they wait for.
CUPA_DEVICE void mbar_init(unsigned bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// Makes the initialized barriers visible to the other threads (before the CTA barrier that follows).
CUPA_DEVICE void mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
// One arrival (release semantics: this thread's earlier shared-memory writes are visible to a waiter).
CUPA_DEVICE void mbar_arrive(unsigned bar) {
  asm volatile("{\n .reg .b64 st;\n mbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(bar) : "memory");
}
// One arrival when every cp.async this thread issued so far has landed (.noinc: the barrier's count
// includes it; the thread also arrives itself, mbar_arrive, to publish its other writes). The
// pending-count form (no .noinc) works the same, but compute-sanitizer synccheck reports "Missing
// wait" for it even in a correct ring (tools/synccheck_probe.py) and none for this one.
CUPA_DEVICE void mbar_arrive_on_cp_async(unsigned bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
// Two arrivals at once (release semantics), for a thread whose copies are not cp.async ones.
CUPA_DEVICE void mbar_arrive2(unsigned bar) {
  asm volatile("{\n .reg .b64 st;\n mbarrier.arrive.shared::cta.b64 st, [%0], 2;\n}\n" ::"r"(bar) : "memory");
}
CUPA_DEVICE bool mbar_try_wait(unsigned bar, unsigned parity) {
  unsigned done;
  asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
               : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  return done != 0;
}
// Wait until the phase of parity `parity` has completed (acquire semantics).
CUPA_DEVICE void mbar_wait(unsigned bar, unsigned parity) {
  while (!mbar_try_wait(bar, parity)) {
  }
}
// Named barriers 1..15 (0 is __syncthreads): `threads` arrivals complete one; bar_sync waits, bar_arrive does not.
CUPA_DEVICE void bar_sync(int id, int threads) { asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory"); }
CUPA_DEVICE void bar_arrive(int id, int threads) { asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory"); }
// Register reallocation between warpgroups (every warp of a warpgroup executes the same one).
template <int N> CUPA_DEVICE void setmaxnreg_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N)); }
template <int N> CUPA_DEVICE void setmaxnreg_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N)); }

// ---- the bulk tensor copy engine (TMA) ---------------------------------------------------------
// A tensor map (CUtensorMap: 128 opaque bytes, encoded on the host by cuTensorMapEncodeTiled), passed
// by value as a `const __grid_constant__` kernel parameter and named by its address.
struct __align__(64) TmaMap {
  unsigned long long bytes[16];
};
// The tx bytes the current phase of `bar` also waits for (the copies that complete on it).
CUPA_DEVICE void mbar_expect_tx(unsigned bar, unsigned bytes) {
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// Box (c0, c1, c2) of a rank-3 tensor map into shared memory at `dst`, completing `bar`'s tx bytes
// (elements outside the tensor land as zeros).
CUPA_DEVICE void tma_load_3d(unsigned dst, const TmaMap* map, int c0, int c1, int c2, unsigned bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n"
      ::"r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(bar) : "memory");
}
CUPA_DEVICE void tma_prefetch_map(const TmaMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(map) : "memory");
}
