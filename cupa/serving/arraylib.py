"""Where the toolkit's arrays live: NumPy (the host), CuPy or PyTorch (CPU or CUDA).

One small adapter per library: allocate a cache or index array of a canonical dtype name, copy a
host (NumPy) array into a preallocated array on the caller's stream, copy blocks of a cache within
the device, and report the free memory of the device. CuPy and PyTorch are imported only when an
adapter for them is made.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from ..errors import fail

__all__ = ["Library", "resolve_library", "NUMPY_DTYPES"]

#: canonical dtype name -> NumPy (ml_dtypes) type
NUMPY_DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32,
                 "int8": np.int8, "uint8": np.uint8, "int32": np.int32, "int64": np.int64,
                 "float8_e4m3fn": ml_dtypes.float8_e4m3fn}


class Library:
    """Array operations of one library on one device.

    Attributes
    ----------
    name : {"numpy", "cupy", "torch"}
    device : None (NumPy), a CuPy device id, or a ``torch.device``
    on_gpu : bool
    """

    name = "numpy"

    def __init__(self, device=None):
        self.device = None
        self.on_gpu = False

    def has_dtype(self, dtype: str) -> bool:
        return dtype in NUMPY_DTYPES

    def full(self, shape: tuple, value, dtype: str):
        return np.full(shape, value, dtype=NUMPY_DTYPES[dtype])

    def zeros(self, shape: tuple, dtype: str):
        return np.zeros(shape, dtype=NUMPY_DTYPES[dtype])

    def from_host(self, host: np.ndarray):
        """A new array of this library holding a copy of ``host``."""
        return host.copy()

    def copy_from_host(self, dst, host: np.ndarray) -> None:
        """``dst[:len(host)] = host``, ordered on the caller's current stream (no host sync)."""
        dst[:len(host)] = host

    def copy_blocks(self, cache, src: list, dst: list) -> None:
        """``cache[dst[i]] = cache[src[i]]`` for every i: a copy inside the cache's own memory."""
        cache[np.asarray(dst)] = cache[np.asarray(src)]

    def free_bytes(self) -> int:
        raise fail("memory_fraction", "a NumPy cache", "a cache on a GPU (CuPy or CUDA PyTorch); give memory_bytes "
                   "or num_blocks for a host cache")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name}, device={self.device})"


class _CuPy(Library):
    name = "cupy"

    def __init__(self, device=None):
        import cupy

        self.cp = cupy
        self.device = int(cupy.cuda.Device().id if device is None else getattr(device, "id", device))
        self.on_gpu = True

    def has_dtype(self, dtype: str) -> bool:
        return dtype in NUMPY_DTYPES and dtype != "float8_e4m3fn"   # CuPy has no float8: held as uint8

    def full(self, shape, value, dtype):
        with self.cp.cuda.Device(self.device):
            return self.cp.full(shape, value, dtype=NUMPY_DTYPES[dtype])

    def zeros(self, shape, dtype):
        with self.cp.cuda.Device(self.device):
            return self.cp.zeros(shape, dtype=NUMPY_DTYPES[dtype])

    def from_host(self, host):
        with self.cp.cuda.Device(self.device):
            return self.cp.asarray(host)

    def copy_from_host(self, dst, host):
        n = host.nbytes
        if n:
            host = np.ascontiguousarray(host)
            dst.data.copy_from_host_async(host.ctypes.data, n, self.cp.cuda.get_current_stream())

    def copy_blocks(self, cache, src, dst):
        cp = self.cp
        with cp.cuda.Device(self.device):
            cache[cp.asarray(np.asarray(dst, dtype=np.int64))] = cache[cp.asarray(np.asarray(src, dtype=np.int64))]

    def free_bytes(self):
        with self.cp.cuda.Device(self.device):
            free, _total = self.cp.cuda.runtime.memGetInfo()
        return int(free)


class _Torch(Library):
    name = "torch"

    def __init__(self, device=None):
        import torch

        self.torch = torch
        self.device = torch.device("cpu" if device is None else device)
        self.on_gpu = self.device.type == "cuda"
        self._dtypes = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
                        "int8": torch.int8, "uint8": torch.uint8, "int32": torch.int32, "int64": torch.int64,
                        "float8_e4m3fn": getattr(torch, "float8_e4m3fn", None)}

    def has_dtype(self, dtype):
        return self._dtypes.get(dtype) is not None

    def full(self, shape, value, dtype):
        return self.torch.full(shape, value, dtype=self._dtypes[dtype], device=self.device)

    def zeros(self, shape, dtype):
        return self.torch.zeros(shape, dtype=self._dtypes[dtype], device=self.device)

    def from_host(self, host):
        t = self.torch.from_numpy(np.ascontiguousarray(host))
        return t.to(self.device, non_blocking=True) if self.on_gpu else t.clone()

    def copy_from_host(self, dst, host):
        if len(host):
            dst[:len(host)].copy_(self.torch.from_numpy(np.ascontiguousarray(host)), non_blocking=True)

    def copy_blocks(self, cache, src, dst):
        torch = self.torch
        # index_put on the bytes: every element type (float8 included) copies the same way
        raw = cache.view(torch.uint8)
        i_src = torch.as_tensor(src, dtype=torch.int64, device=self.device)
        i_dst = torch.as_tensor(dst, dtype=torch.int64, device=self.device)
        raw[i_dst] = raw[i_src]

    def free_bytes(self):
        if not self.on_gpu:
            return super().free_bytes()
        free, _total = self.torch.cuda.mem_get_info(self.device)
        return int(free)


def resolve_library(library: Any = "numpy", device=None) -> Library:
    """The adapter for ``library`` ("numpy", "cupy", "torch", or one of those modules) on ``device``.

    ``device``: a CuPy device id, or anything ``torch.device`` accepts ("cuda:0", "cpu"); None is
    CuPy's current device or PyTorch's CPU.
    """
    if isinstance(library, Library):
        return library
    name = library if isinstance(library, str) else getattr(library, "__name__", None)
    if name == "numpy":
        if device is not None:
            raise fail("device", repr(device), "None for a NumPy cache (host memory)")
        return Library()
    if name == "cupy":
        return _CuPy(device)
    if name == "torch":
        return _Torch(device)
    raise fail("library", repr(library), "'numpy', 'cupy' or 'torch' (or the module itself)")
