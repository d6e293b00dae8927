"""How every figure of ``python -m cupa.bench`` is measured: CUDA events, median of many runs, L2 cold.

Every case times the whole call as a user makes it, with the L2 cache (60 MB on the H200) cold, and
reports rooflines measured in the same run. There are two ways to make L2 cold: rotate inputs larger
than it, or flush it. :class:`Timer` flushes: it writes, then reads a 2 GiB scratch buffer before each
run, so the call starts with no line of its inputs in L2 and no dirty line either -- the state input
rotation leaves. A memset flush alone (``flush="memset"``) leaves L2 full of dirty lines, which the
timed call's own reads evict: their write-back to DRAM lands inside the call and adds 8-9 us to every
call on the H200, the read probe's and every peer's alike (``benchmarks/l2_flush_methods.py`` measures
the ways). The flush also gives the host about 1 ms to enqueue the call before the timed region
starts, so host overhead below that is not timed.

:class:`CpuTimer` is the smoke mode's stand-in (``perf_counter``, no flush), and :class:`Spinner`,
:func:`host_time_us` and :func:`loop_time_us` time host-side costs with the GPU held busy.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import numpy as np

__all__ = ["Timer", "CpuTimer", "ReadProbe", "Spinner", "FLUSH_BYTES", "FLUSH_MODES", "summarize_us",
           "host_time_us", "loop_time_us", "interleaved_host_times"]

#: Bytes the flush writes and reads before each timed run (larger than any L2 by far).
FLUSH_BYTES = 2 << 30
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

_SPIN = r"""
extern "C" __global__ void spin(long long cycles) {
  long long start = clock64();
  while (clock64() - start < cycles) { }
}
"""


def summarize_us(times: list, reps: int) -> dict:
    """Median / min / max of a list of microsecond figures."""
    return {"median_us": statistics.median(times), "min_us": min(times), "max_us": max(times), "reps": reps}


class ReadProbe:
    """A read-only 16-byte-load reduction over a device buffer (8 CTAs of 512 threads per SM): the
    bandwidth roofline a kernel reading the same bytes could reach."""

    def __init__(self, cp):
        self.cp = cp
        self.kernel = cp.RawKernel(_READ_PROBE, "read_probe")
        self.sink = cp.zeros(1, dtype=cp.uint32)
        self.blocks = cp.cuda.Device().attributes["MultiProcessorCount"] * 8

    def __call__(self, x, nbytes: int | None = None) -> None:
        n = (x.nbytes if nbytes is None else min(int(nbytes), x.nbytes)) // 16
        self.kernel((self.blocks,), (512,), (x, np.int64(n), self.sink))


class Timer:
    """CUDA-event timing on the current CuPy stream with L2 flushed before each run.

    Parameters
    ----------
    cp : module
        CuPy.
    flush : {"read", "memset"}
        "read" (default): a 2 GiB write, then read -- L2 cold and clean. "memset": a 2 GiB memset --
        L2 cold and full of dirty lines the timed call then writes back.
    """

    def __init__(self, cp, flush: str = "read"):
        if flush not in FLUSH_MODES:
            raise ValueError(f"flush: got {flush!r}; expected one of {FLUSH_MODES}")
        self.cp = cp
        self.mode = flush
        self.scratch = cp.ones(FLUSH_BYTES, dtype=cp.uint8)
        self.probe = ReadProbe(cp)
        self.start = cp.cuda.Event()
        self.end = cp.cuda.Event()

    def flush(self, mode: str | None = None) -> None:
        # "read" writes the scratch first too: a read alone sometimes left the next timed call as slow
        # as after a memset (in a process that had just timed memset-flushed calls); the write-then-read
        # flush never did.
        self.scratch.fill(1)
        if (mode or self.mode) != "memset":
            self.probe(self.scratch)

    def synchronize(self) -> None:
        self.cp.cuda.get_current_stream().synchronize()

    def time_us(self, fn: Callable[[], object], reps: int = 30, warmup: int = 3, flush: bool = True,
                mode: str | None = None) -> dict:
        """Median / min / max of ``reps`` runs of ``fn()`` in microseconds (CUDA events on the current
        stream); ``mode`` overrides the timer's flush method for this measurement."""
        cp = self.cp
        for _ in range(warmup):
            fn()
        self.synchronize()
        times = []
        for _ in range(reps):
            if flush:
                self.flush(mode)
            self.start.record()
            fn()
            self.end.record()
            self.end.synchronize()
            times.append(cp.cuda.get_elapsed_time(self.start, self.end) * 1000.0)
        return summarize_us(times, reps)


class CpuTimer:
    """The smoke mode's timer: wall clock (``perf_counter``) per run, no cache flush."""

    mode = "none"

    def flush(self, mode: str | None = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def time_us(self, fn: Callable[[], object], reps: int = 3, warmup: int = 1, flush: bool = True,
                mode: str | None = None) -> dict:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
        return summarize_us(times, reps)


class Spinner:
    """Holds the GPU busy so that host-side enqueue time can be measured without queue back-pressure."""

    def __init__(self, cp):
        self.cp = cp
        self.kernel = cp.RawKernel(_SPIN, "spin")
        clock_khz = cp.cuda.Device().attributes.get("ClockRate", 1_800_000)
        self.cycles_per_ms = int(clock_khz)  # kHz = cycles per ms

    def hold(self, ms: float, stream=None) -> None:
        with (stream if stream is not None else self.cp.cuda.get_current_stream()):
            self.kernel((1,), (1,), (np.int64(self.cycles_per_ms * ms),))


def host_time_us(cp, spinner: Spinner, fn: Callable[[], object], calls: int, repeats: int = 9,
                 spin_ms: float = 50.0, stream=None) -> dict:
    """Median over ``repeats`` of the per-call host time of ``calls`` back-to-back ``fn()`` behind a spin kernel.

    The spin kernel runs on ``stream`` (the stream the calls use), so nothing completes while the calls
    are enqueued; keep ``calls`` x kernels per call well under the ~1000 launches CUDA queues per stream
    before the host blocks, and the spin longer than the enqueue time.
    """
    fn()
    cp.cuda.Device().synchronize()
    per_call = []
    for _ in range(repeats):
        spinner.hold(spin_ms, stream)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        cp.cuda.Device().synchronize()
        per_call.append((t1 - t0) / calls * 1e6)
    return {"median_us": statistics.median(per_call), "min_us": min(per_call), "max_us": max(per_call),
            "calls": calls, "repeats": repeats}


def interleaved_host_times(cp, spinner: Spinner, fns: dict, calls: int, rounds: int = 7) -> dict:
    """Per-call host time of each ``fns`` entry (``name: (fn, stream or None)``), the entries measured in
    turn, ``rounds`` times over (the host's speed drifts: this way each entry sees the same drift);
    median, min and max over the rounds' medians."""
    seen = {name: [] for name in fns}
    for _ in range(rounds):
        for name, (fn, stream) in fns.items():
            seen[name].append(host_time_us(cp, spinner, fn, calls, repeats=5, stream=stream)["median_us"])
    return {name: {"median_us": statistics.median(v), "min_us": min(v), "max_us": max(v), "calls": calls,
                   "rounds": rounds} for name, v in seen.items()}


def loop_time_us(synchronize: Callable[[], None], fn: Callable[[], object], steps: int) -> float:
    """Wall clock per step over ``steps`` back-to-back steps, synchronized once at the end."""
    for _ in range(3):
        fn()
    synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    synchronize()
    return (time.perf_counter() - t0) / steps * 1e6
