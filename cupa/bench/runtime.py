"""Where a benchmark run executes: a CUDA device (CuPy arrays, CUDA-event timing, L2 flushed) or the
CPU smoke mode (NumPy arrays, the NumPy reference backend, wall-clock timing).

A :class:`Runtime` owns the array module, the timer, the stream every measurement runs on (cupa,
PyTorch and ONNX Runtime all enqueue there) and the roofline probes: a read probe of any size and a
dense GEMM, measured in the same process as the cases, and a write probe (a fill) for the suites whose
floor includes bytes written.
"""

from __future__ import annotations

import contextlib
import platform
import sys
import time
from importlib import metadata

import numpy as np

from .timing import CpuTimer, Timer

__all__ = ["Runtime", "CudaRuntime", "NumpyRuntime", "environment", "cuda_environment", "package_version"]

#: GEMM probe size: M = N = K (bf16 in, fp32 accumulate): 1.1 TFLOP, ~1.5 ms on an H200.
GEMM_SIZE = 8192


def package_version(dist: str):
    """Installed version of distribution ``dist``, or None."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


class Runtime:
    """Common interface of :class:`CudaRuntime` and :class:`NumpyRuntime`."""

    name = "abstract"
    xp = np
    on_device = False

    def stream_context(self):
        return contextlib.nullcontext()

    def time_us(self, fn, reps: int) -> dict:
        return self.timer.time_us(fn, reps=reps)

    def free(self) -> None:
        """Return cached device memory between cases."""

    def timing(self, reps: int) -> str:
        """How this runtime times a measurement, in words (for the report)."""
        raise NotImplementedError

    def to_host(self, x) -> np.ndarray:
        return np.asarray(x)


class CudaRuntime(Runtime):
    """CuPy on the current device, every measurement on one non-blocking stream.

    ``flush``: the :class:`Timer`'s L2 flush ("read" or "memset").
    """

    name = "cuda"
    on_device = True

    def __init__(self, flush: str = "read"):
        import cupy as cp

        self.cp = self.xp = cp
        self.stream = cp.cuda.Stream(non_blocking=True)
        with self.stream:
            self.timer = Timer(cp, flush=flush)
        self._probe_buffer = None
        self._torch_stream = None

    @contextlib.contextmanager
    def stream_context(self):
        """CuPy's and (when it imports with CUDA) PyTorch's current stream set to the run's stream."""
        torch = _torch_cuda()
        with self.stream:
            if torch is None:
                yield
                return
            if self._torch_stream is None:
                self._torch_stream = torch.cuda.ExternalStream(self.stream.ptr)
            with torch.cuda.stream(self._torch_stream):
                yield

    def free(self) -> None:
        self.stream.synchronize()
        self.cp.get_default_memory_pool().free_all_blocks()
        torch = _torch_cuda()
        if torch is not None:
            torch.cuda.empty_cache()

    def to_host(self, x) -> np.ndarray:
        return self.cp.asnumpy(x)

    def timing(self, reps: int) -> str:
        how = ("a 2 GiB write then read (cold and clean)" if self.timer.mode == "read"
               else "a 2 GiB memset (cold, dirty lines)")
        return f"CUDA events around each call, median of {reps} runs, L2 flushed by {how} before each"

    def read_probe(self, nbytes: int, reps: int) -> dict:
        """Time of the read probe over ``nbytes`` (at least 1 MiB) of a random buffer, flushed like a case."""
        nbytes = max(int(nbytes), 1 << 20)
        buf = self._probe_buffer
        if buf is None or buf.nbytes < nbytes:
            self._probe_buffer = None
            self.free()
            buf = self._probe_buffer = self.cp.random.randint(0, 255, size=nbytes, dtype=self.cp.uint8)
        t = self.timer.time_us(lambda: self.timer.probe(buf, nbytes), reps=reps)
        t.update(bytes=nbytes, tb_per_s=nbytes / t["median_us"] / 1e6)
        return t

    def release_probe(self) -> None:
        self._probe_buffer = None

    def write_probe(self, nbytes: int, reps: int) -> dict:
        """Time of a cudaMemsetAsync of ``nbytes`` (the write bandwidth a kernel writing that much could
        reach; an elementwise fill of bytes runs far below it), flushed like a case."""
        buf = self.cp.empty(int(nbytes), dtype=self.cp.uint8)
        t = self.timer.time_us(lambda: buf.data.memset_async(7, buf.nbytes), reps=reps)
        del buf
        self.free()
        t.update(bytes=int(nbytes), what="cudaMemsetAsync", tb_per_s=nbytes / t["median_us"] / 1e6)
        return t

    def gemm_probe(self, reps: int) -> dict:
        """A dense bf16 GEMM (PyTorch when it has CUDA, else a CuPy fp16 GEMM: the same tensor-core rate)."""
        n = GEMM_SIZE
        torch = _torch_cuda()
        if torch is not None:
            a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
            b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
            c = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
            what = "torch.matmul bf16"
            fn = lambda: torch.matmul(a, b, out=c)  # noqa: E731
        else:
            cp = self.cp
            a = cp.random.standard_normal((n, n), dtype=cp.float32).astype(cp.float16)
            b = cp.random.standard_normal((n, n), dtype=cp.float32).astype(cp.float16)
            c = cp.empty((n, n), dtype=cp.float16)
            what = "cupy.matmul fp16"
            fn = lambda: cp.matmul(a, b, out=c)  # noqa: E731
        t = self.timer.time_us(fn, reps=reps)
        flops = 2.0 * n ** 3
        t.update(what=what, size=n, flops=flops, tflop_per_s=flops / t["median_us"] / 1e6)
        del a, b, c
        return t

    def environment(self) -> dict:
        return cuda_environment(self.cp)


class NumpyRuntime(Runtime):
    """The smoke mode: NumPy arrays (the NumPy reference backend), wall-clock timing, no flush."""

    name = "numpy"

    def __init__(self):
        self.timer = CpuTimer()

    def timing(self, reps: int) -> str:
        return f"wall clock (perf_counter) per call on the CPU, median of {reps} runs, no cache flush"

    def read_probe(self, nbytes: int, reps: int) -> dict:
        nbytes = max(int(nbytes), 1 << 16)
        buf = np.ones(nbytes // 8, dtype=np.uint64)
        t = self.timer.time_us(lambda: np.bitwise_xor.reduce(buf), reps=reps)
        t.update(bytes=buf.nbytes, tb_per_s=buf.nbytes / t["median_us"] / 1e6)
        return t

    def release_probe(self) -> None:
        pass

    def write_probe(self, nbytes: int, reps: int) -> dict:
        buf = np.empty(int(nbytes), dtype=np.uint8)
        t = self.timer.time_us(lambda: buf.fill(7), reps=reps)
        t.update(bytes=buf.nbytes, what="numpy fill", tb_per_s=buf.nbytes / t["median_us"] / 1e6)
        return t

    def gemm_probe(self, reps: int) -> dict:
        n = 256
        a = np.ones((n, n), dtype=np.float32)
        b = np.ones((n, n), dtype=np.float32)
        t = self.timer.time_us(lambda: a @ b, reps=reps)
        flops = 2.0 * n ** 3
        t.update(what="numpy.matmul fp32", size=n, flops=flops, tflop_per_s=flops / t["median_us"] / 1e6)
        return t

    def environment(self) -> dict:
        info = environment()
        info["machine"]["device"] = "CPU (NumPy reference backend; smoke mode)"
        return info


def _torch_cuda():
    """torch when it is importable with CUDA, else None (never imports it when it is not installed)."""
    if "torch" not in sys.modules and package_version("torch") is None:
        return None
    try:
        import torch
    except Exception:  # a broken install
        return None
    return torch if torch.cuda.is_available() else None


def cuda_environment(cp) -> dict:
    """:func:`environment` plus the current CUDA device and the CUDA runtime and driver versions."""
    dev = cp.cuda.Device()
    props = cp.cuda.runtime.getDeviceProperties(dev.id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    info = environment()
    info["machine"].update(device=name, compute_capability=f"{props['major']}.{props['minor']}",
                           sm_count=dev.attributes["MultiProcessorCount"],
                           memory_gib=round(props["totalGlobalMem"] / 2**30, 1),
                           l2_bytes=int(props.get("l2CacheSize", 0)))
    info["versions"].update(cuda_runtime=cp.cuda.runtime.runtimeGetVersion(),
                            cuda_driver=cp.cuda.runtime.driverGetVersion())
    return info


def environment() -> dict:
    """Machine and versions of everything a benchmark figure depends on."""
    import cupa

    versions = {"cupa": cupa.__version__, "python": platform.python_version(), "numpy": np.__version__}
    for dist in ("cupy-cuda13x", "cupy-cuda12x", "torch", "flashinfer-python", "onnxruntime-gpu", "onnxruntime",
                 "onnx", "flash-attn", "flash_attn_3", "tqdm", "matplotlib"):
        v = package_version(dist)
        if v is not None:
            versions[dist] = v
    return {"time": time.strftime("%Y-%m-%d %H:%M:%S"),
            "machine": {"host": platform.node(), "platform": platform.platform(), "cpu": platform.processor()},
            "versions": versions}
