"""Tensor maps for the bulk tensor copy engine (TMA, compute capability 9.0+), encoded on the host.

A tensor map is 128 opaque bytes (``CUtensorMap``) describing a tensor in device memory and the box
a ``cp.async.bulk.tensor`` copies; kernels take it by value (``const __grid_constant__ TmaMap``,
cuda_src/wgmma.cuh). It is encoded by the driver's ``cuTensorMapEncodeTiled``
(:mod:`cupa.kernels.driver`), a host-only function, and names the tensor's device address, so a map is
encoded per tensor address; :func:`rows_map` keeps the recent ones (an encode costs ~10 us of host time, a kept
map ~0.3 us).

The maps here view a tensor of 16-bit rows, ``(rows, heads, head_size)`` C-contiguous (a cache
``(num_blocks, block_size, kv_num_heads, head_size)`` as ``num_blocks * block_size`` rows, or
``key``/``value`` as ``token_count`` rows), as the rank-3 tensor (head_size, heads, rows) with boxes
of 64 columns x 1 head x ``box_rows`` rows, 128-byte swizzled: the layout wgmma reads (two 64-column
slabs per tile; ``wg_off`` in wgmma.cuh). A cache of 8-bit codes (``elem_bytes=1``) is viewed the same
way with boxes of 128 columns: one 128-byte row per cache row, the layout of one slab, where the wgmma
prefill widens them. Elements outside the tensor are filled with zeros.
"""

from __future__ import annotations

import ctypes
import functools

from .driver import tensor_map_encode_tiled

#: cuda.h enums
_UINT8 = 0                # CU_TENSOR_MAP_DATA_TYPE_UINT8 (8-bit codes: int8 and fp8 alike)
_UINT16 = 1               # CU_TENSOR_MAP_DATA_TYPE_UINT16 (a copy: fp16 and bf16 alike)
_INTERLEAVE_NONE = 0
_SWIZZLE_128B = 3
_L2_PROMOTION_256B = 3
_OOB_FILL_ZEROS = 0       # CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE

MAP_BYTES = 128
#: Bytes of a box's rows: the 128-byte swizzle span (64 16-bit elements, or 128 8-bit codes).
SWIZZLE_BYTES = 128
#: Largest box extent along any dimension (cuTensorMapEncodeTiled).
MAX_BOX = 256
#: Coordinates are 32-bit signed in cp.async.bulk.tensor: the rows of a map stay below this.
MAX_ROWS = (1 << 31) - 1

ZERO_MAP = bytes(MAP_BYTES)


def available() -> bool:
    """Whether tensor maps can be encoded here (a CUDA driver with ``cuTensorMapEncodeTiled``)."""
    return tensor_map_encode_tiled() is not None


def map_args(rows: int, heads: int, head_size: int, box_rows: int, elem_bytes: int = 2) -> tuple:
    """The shape arguments of :func:`rows_map` as ``cuTensorMapEncodeTiled`` takes them:
    (globalDim, globalStrides, boxDim), innermost first; raises ValueError where they break its rules."""
    columns = SWIZZLE_BYTES // elem_bytes if elem_bytes in (1, 2) else 0
    if (not columns or head_size % columns or not 0 < heads or not 0 < rows <= MAX_ROWS
            or not 0 < box_rows <= MAX_BOX):
        raise ValueError(f"tensor map: rows={rows}, heads={heads}, head_size={head_size}, box_rows={box_rows}, "
                         f"elem_bytes={elem_bytes}")
    dims = (head_size, heads, rows)
    # bytes, of dimensions 1 and 2 (multiples of 16)
    strides = (head_size * elem_bytes, heads * head_size * elem_bytes)
    box = (columns, 1, box_rows)
    return dims, strides, box


#: Maps kept (about 200 bytes each): a server's key/value tensors cycle through a pool's addresses,
#: and an encode costs ~10 us of host time (measured on the H200 host) against ~0.3 us for a kept map.
MAPS_KEPT = 1024


@functools.lru_cache(maxsize=MAPS_KEPT)
def rows_map(ptr: int, rows: int, heads: int, head_size: int, box_rows: int, elem_bytes: int = 2) -> bytes:
    """The 128-byte tensor map of the tensor ``(rows, heads, head_size)`` of 16-bit elements (or 8-bit codes:
    ``elem_bytes=1``) at device address ``ptr`` (16-byte aligned) with boxes of 128 bytes x 1 x ``box_rows``
    (see the module docstring)."""
    fn = tensor_map_encode_tiled()
    if fn is None:
        raise RuntimeError("tensor maps: the CUDA driver has no cuTensorMapEncodeTiled (check available() first)")
    if ptr % 16:
        raise ValueError(f"tensor map: device address {ptr:#x} is not 16-byte aligned")
    dims, strides, box = map_args(rows, heads, head_size, box_rows, elem_bytes)
    buf = ctypes.create_string_buffer(MAP_BYTES + 64)  # the driver writes a 64-byte aligned map
    offset = -ctypes.addressof(buf) % 64
    status = fn(ctypes.c_void_p(ctypes.addressof(buf) + offset), _UINT8 if elem_bytes == 1 else _UINT16, 3,
                ctypes.c_void_p(ptr),
                (ctypes.c_uint64 * 3)(*dims), (ctypes.c_uint64 * 2)(*strides), (ctypes.c_uint32 * 3)(*box),
                (ctypes.c_uint32 * 3)(1, 1, 1), _INTERLEAVE_NONE, _SWIZZLE_128B, _L2_PROMOTION_256B, _OOB_FILL_ZEROS)
    if status:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed with CUresult {status} (rows={rows}, heads={heads}, "
                           f"head_size={head_size}, box_rows={box_rows}, elem_bytes={elem_bytes}, address {ptr:#x})")
    return buf.raw[offset:offset + MAP_BYTES]
