"""A two-warpgroup mbarrier ring, the handshake of the wgmma prefill's cp.async stages, for
compute-sanitizer synccheck.

128 producer threads copy 16 bytes each with cp.async into one of two shared buffers and arrive on its
"full" mbarrier; 128 consumer threads wait for it, copy the buffer out and arrive on its "empty"
mbarrier, which the producers wait for before reusing the buffer. Every phase of every barrier is
waited before the next arrival on it. The producers' arrival takes one of three forms (``--mode``):

- ``track``: ``cp.async.mbarrier.arrive`` (the barrier's pending count +1 now, -1 when the thread's
  copies land) and a plain arrival; full barriers count 128 arrivals (the kernel's form);
- ``wait``: ``cp.async.wait_all`` and a plain arrival; 128 arrivals;
- ``noinc``: ``cp.async.mbarrier.arrive.noinc`` (the landing copies count as one arrival) and a plain
  arrival; 256 arrivals.

All three are correct by the PTX ISA; the output must equal the input. Run each under the tool::

    compute-sanitizer --tool synccheck python tools/synccheck_probe.py --mode track

and compare what it reports: a report for one form and none for the others locates what the tool
objects to.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

SOURCE = r"""
template <int MODE>
__global__ void __launch_bounds__(256) ring(const int4* __restrict__ src, int4* __restrict__ dst, int phases) {
  __shared__ alignas(16) int4 buf[2][128];
  __shared__ alignas(8) unsigned long long full[2], empty[2];
  const int tid = threadIdx.x;
  auto addr = [](const void* p) { return (unsigned)__cvta_generic_to_shared(p); };
  auto arrive = [](unsigned bar) {
    asm volatile("{\n .reg .b64 st;\n mbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(bar) : "memory");
  };
  auto wait = [](unsigned bar, unsigned parity) {
    unsigned done = 0;
    while (!done) {
      asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                   " selp.u32 %0, 1, 0, p;\n}\n" : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    }
  };
  if (tid == 0) {
    for (int b = 0; b < 2; ++b) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(addr(&full[b])), "r"(MODE == 2 ? 256 : 128));
      asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(addr(&empty[b])), "r"(128));
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  if (tid < 128) {
    for (int n = 0; n < phases; ++n) {
      const int b = n & 1;
      if (n >= 2) wait(addr(&empty[b]), ((n >> 1) + 1) & 1);
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(addr(&buf[b][tid])),
                   "l"(src + (long long)n * 128 + tid) : "memory");
      if (MODE == 0) {
        asm volatile("cp.async.mbarrier.arrive.shared::cta.b64 [%0];\n" ::"r"(addr(&full[b])) : "memory");
      } else if (MODE == 1) {
        asm volatile("cp.async.wait_all;\n" ::: "memory");
      } else {
        asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(addr(&full[b])) : "memory");
      }
      arrive(addr(&full[b]));
    }
  } else {
    const int c = tid - 128;
    for (int n = 0; n < phases; ++n) {
      const int b = n & 1;
      wait(addr(&full[b]), (n >> 1) & 1);
      dst[(long long)n * 128 + c] = buf[b][c];
      arrive(addr(&empty[b]));
    }
  }
}
"""

MODES = {"track": 0, "wait": 1, "noinc": 2}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=sorted(MODES), required=True)
    ap.add_argument("--phases", type=int, default=64)
    args = ap.parse_args(argv)
    import cupy as cp

    module = cp.RawModule(code=SOURCE, options=("-std=c++17",), name_expressions=[f"ring<{m}>" for m in MODES.values()])
    kernel = module.get_function(f"ring<{MODES[args.mode]}>")
    words = args.phases * 128 * 4
    src = cp.arange(words, dtype=cp.int32)
    dst = cp.full(words, -1, dtype=cp.int32)
    kernel((1,), (256,), (src, dst, np.int32(args.phases)))
    cp.cuda.Device().synchronize()
    ok = bool(cp.array_equal(src, dst))
    print(f"mode={args.mode} phases={args.phases}: output {'equals' if ok else 'DIFFERS FROM'} the input")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
