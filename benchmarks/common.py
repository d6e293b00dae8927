"""Timing helpers shared by the benchmarks: CUDA events, median of many runs, L2 flushed.

Every benchmark times the whole call as a user makes it, with the L2 cache (60 MB on the H200)
flushed before each run by a memset of a large scratch buffer, and reports a read roofline
measured in the same run.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time

import numpy as np

FLUSH_BYTES = 2 << 30  # also gives the host time (~0.5 ms) to enqueue the call before the timed region


class Timer:
    def __init__(self, cp):
        self.cp = cp
        self.scratch = cp.empty(FLUSH_BYTES, dtype=cp.uint8)
        self.start = cp.cuda.Event()
        self.end = cp.cuda.Event()

    def flush(self):
        self.scratch.fill(1)

    def time_us(self, fn, reps: int = 30, warmup: int = 3, flush: bool = True) -> dict:
        """Median / min / max of ``reps`` runs of ``fn()`` in microseconds (CUDA events)."""
        cp = self.cp
        for _ in range(warmup):
            fn()
        cp.cuda.get_current_stream().synchronize()
        times = []
        for _ in range(reps):
            if flush:
                self.flush()
            self.start.record()
            fn()
            self.end.record()
            self.end.synchronize()
            times.append(cp.cuda.get_elapsed_time(self.start, self.end) * 1000.0)
        return {"median_us": statistics.median(times), "min_us": min(times), "max_us": max(times), "reps": reps}


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


def read_roofline(cp, timer: Timer, nbytes: int = 2 << 30) -> dict:
    """Bandwidth of a read-only 16-byte-load reduction over ``nbytes`` (TB/s)."""
    kernel = cp.RawKernel(_READ_PROBE, "read_probe")
    x = cp.random.randint(0, 255, size=nbytes, dtype=cp.uint8)
    out = cp.zeros(1, dtype=cp.uint32)
    n = nbytes // 16
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    t = timer.time_us(lambda: kernel((sms * 8,), (512,), (x, np.int64(n), out)), reps=20)
    del x
    return {"bytes": nbytes, "median_us": t["median_us"], "tb_per_s": nbytes / t["median_us"] / 1e6}


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
