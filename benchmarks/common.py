"""Timing helpers shared by the benchmarks: CUDA events, median of many runs, L2 cold.

Every benchmark times the whole call as a user makes it, with the L2 cache (60 MB on the H200) cold,
and reports a read roofline measured in the same run. contract §7 allows two ways to make L2 cold:
rotate inputs larger than it, or flush it. The flush here writes, then reads a 2 GiB scratch buffer,
so the call starts with no line of its inputs in L2 and no dirty line either: the state input
rotation leaves.
A memset flush (``Timer(cp, flush="memset")``, the method of sessions 1-9) leaves L2 full of dirty
lines, which the timed call's own reads evict: their write-back to DRAM lands inside the call and adds
8-9 us to every call on the H200, the read probe's and torch SDPA's alike (about 40 MB at the read
bandwidth; benchmarks/l2_flush_methods.py measures the three ways).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time

import numpy as np

FLUSH_BYTES = 2 << 30  # also gives the host time (~0.5 ms) to enqueue the call before the timed region
FLUSH_MODES = ("read", "memset")

_READ_PROBE = r"""
extern "C" __global__ void read_probe(const uint4* __restrict__ x, long long n, unsigned int* out) {
  unsigned int acc = 0;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
    uint4 v = __ldg(x + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x12345678u) out[0] = acc;  // keeps the loads alive
}
"""


class ReadProbe:
    """A read-only 16-byte-load reduction over a device buffer (8 CTAs of 512 threads per SM)."""

    def __init__(self, cp):
        self.cp = cp
        self.kernel = cp.RawKernel(_READ_PROBE, "read_probe")
        self.sink = cp.zeros(1, dtype=cp.uint32)
        self.blocks = cp.cuda.Device().attributes["MultiProcessorCount"] * 8

    def __call__(self, x) -> None:
        self.kernel((self.blocks,), (512,), (x, np.int64(x.nbytes // 16), self.sink))


class Timer:
    """CUDA-event timing with L2 flushed before each run: ``flush`` "read" (L2 cold and clean, the
    default) or "memset" (L2 cold, full of dirty lines the call then writes back)."""

    def __init__(self, cp, flush: str = "read"):
        if flush not in FLUSH_MODES:
            raise ValueError(f"flush must be one of {FLUSH_MODES}, got {flush!r}")
        self.cp = cp
        self.mode = flush
        self.scratch = cp.ones(FLUSH_BYTES, dtype=cp.uint8)
        self.probe = ReadProbe(cp)
        self.start = cp.cuda.Event()
        self.end = cp.cuda.Event()

    def flush(self, mode: str | None = None):
        # "read" writes the scratch first too: a read alone sometimes left the next timed call as slow
        # as after a memset (in a process that had timed another case with memset flushes just before;
        # not understood), the memset-then-read flush never did in session 10's checks.
        self.scratch.fill(1)
        if (mode or self.mode) != "memset":
            self.probe(self.scratch)

    def time_us(self, fn, reps: int = 30, warmup: int = 3, flush: bool = True, mode: str | None = None) -> dict:
        """Median / min / max of ``reps`` runs of ``fn()`` in microseconds (CUDA events); ``mode``
        overrides the timer's flush method for this measurement."""
        cp = self.cp
        for _ in range(warmup):
            fn()
        cp.cuda.get_current_stream().synchronize()
        times = []
        for _ in range(reps):
            if flush:
                self.flush(mode)
            self.start.record()
            fn()
            self.end.record()
            self.end.synchronize()
            times.append(cp.cuda.get_elapsed_time(self.start, self.end) * 1000.0)
        return {"median_us": statistics.median(times), "min_us": min(times), "max_us": max(times), "reps": reps}



def read_roofline(cp, timer: Timer, nbytes: int = 2 << 30, mode: str | None = None) -> dict:
    """Bandwidth of a read-only 16-byte-load reduction over ``nbytes`` (TB/s), timed with ``mode``'s flush."""
    x = cp.random.randint(0, 255, size=nbytes, dtype=cp.uint8)
    t = timer.time_us(lambda: timer.probe(x), reps=20, mode=mode)
    del x
    return {"bytes": nbytes, "median_us": t["median_us"], "tb_per_s": nbytes / t["median_us"] / 1e6,
            "flush": mode or timer.mode}


def environment(cp) -> dict:
    info = {"time": time.strftime("%Y-%m-%d %H:%M:%S"), "python": platform.python_version(),
            "numpy": np.__version__, "cupy": cp.__version__}
    dev = cp.cuda.Device()
    props = cp.cuda.runtime.getDeviceProperties(dev.id)
    info["device"] = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    info["sm_count"] = dev.attributes["MultiProcessorCount"]
    info["cuda_runtime"] = cp.cuda.runtime.runtimeGetVersion()
    try:
        import torch

        info["torch"] = torch.__version__
    except ImportError:
        info["torch"] = None
    return info


def write_json(path: str, payload: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
