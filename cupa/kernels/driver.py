"""CUDA driver entry points CuPy has no binding for, through ctypes: launch with attributes, tensor maps.

- :func:`launch_kernel_ex` is ``cuLaunchKernelEx`` (programmatic dependent launch: a kernel's CTAs
  are scheduled while the previous kernel on the stream runs, and wait in ``griddepcontrol.wait``);
- :func:`tensor_map_encode_tiled` is ``cuTensorMapEncodeTiled`` (host-only: encodes the 128-byte
  descriptor the bulk tensor copy engine reads).

Both are None where the driver lacks them (no driver at all on a CPU-only machine).
"""

from __future__ import annotations

import ctypes
import functools

__all__ = ["LaunchAttribute", "LaunchConfig", "launch_kernel_ex", "tensor_map_encode_tiled",
           "PROGRAMMATIC_STREAM_SERIALIZATION", "programmatic_launcher"]

#: cuda.h, CUlaunchAttributeID
PROGRAMMATIC_STREAM_SERIALIZATION = 6


class LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: id, pad to 8 bytes, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


def _libcuda():
    return ctypes.CDLL("libcuda.so.1")


@functools.lru_cache(maxsize=None)
def launch_kernel_ex():
    """The driver's ``cuLaunchKernelEx``, or None where the driver has none."""
    try:
        fn = _libcuda().cuLaunchKernelEx
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


@functools.lru_cache(maxsize=None)
def tensor_map_encode_tiled():
    """The driver's ``cuTensorMapEncodeTiled``, or None where the driver has none."""
    try:
        fn = _libcuda().cuTensorMapEncodeTiled
    except (OSError, AttributeError):
        return None
    u32p, u64p = ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint64)
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p, u64p, u32p, u32p,
                   ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def programmatic_launcher(func_ptr: int, grid: tuple, block: tuple, shared_mem: int, table_ptr: int, check=None):
    """``launch(stream_ptr, table, extra)``: one programmatic launch of kernel ``func_ptr`` (a CUfunction)
    with the parameter table at ``table_ptr``; ``check(status)`` raises for a failed CUresult."""
    ex = launch_kernel_ex()
    attr = LaunchAttribute()
    attr.id = PROGRAMMATIC_STREAM_SERIALIZATION
    attr.value[0] = 1  # programmaticStreamSerializationAllowed
    cfg = LaunchConfig(*grid, *block, shared_mem, None, ctypes.pointer(attr), 1)
    cfg_ptr = ctypes.addressof(cfg)

    def launch(stream_ptr, table, extra, cfg=cfg, attr=attr):  # cfg/attr: kept alive with the closure
        cfg.hStream = stream_ptr
        status = ex(cfg_ptr, func_ptr, table, None)
        if status:
            if check is not None:
                check(status)
            raise RuntimeError(f"cuLaunchKernelEx failed with CUresult {status}")

    return launch
