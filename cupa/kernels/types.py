"""C++ names of the template arguments the kernels are specialized on."""

from __future__ import annotations

import numpy as np

from ..contract import PACKED_KINDS

#: T (activation) dtype name -> C++ type
ACT_CXX = {"float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float"}
#: cache kind -> C++ cache trait (``{T}`` is replaced by T's C++ type)
CACHE_CXX = {"T": "CacheSame<{T}>", "int8": "CacheInt8", "fp8": "CacheFp8", "int4": "CacheInt4", "fp4": "CacheFp4"}
#: the cache kinds every kernel reads, and the packed 4-bit ones only some do (their own V trait beside K's)
BYTE_KINDS = ("T", "int8", "fp8")
#: (K kind, V kind) pairs of the packed 4-bit caches the kernels read
PACKED_PAIRS = tuple((k, v) for k in PACKED_KINDS for v in PACKED_KINDS)
#: (K kind, V kind) of every cache pair the decode and prefill kernels read: one kind for both, or two
#: packed 4-bit kinds
KV_KINDS = tuple((k, k) for k in BYTE_KINDS) + PACKED_PAIRS
QUANT_CODE = {"NONE": 0, "PER_TENSOR": 1, "PER_CHANNEL": 2}
#: query heads one decode CTA holds in registers
HEAD_CHUNKS = (1, 2, 4, 8)

NULL = np.uint64(0)  # a null pointer kernel argument


def act(dtype: str) -> str:
    return ACT_CXX[dtype]


def cache(kind: str, dtype: str) -> str:
    return CACHE_CXX[kind].format(T=ACT_CXX[dtype])


def v_cache_arg(kind: str, v_kind: str, dtype: str) -> str:
    """The trailing V-trait template argument of a kernel reading K and V of different kinds ("" if the same)."""
    return "" if v_kind in (None, kind) else f", {cache(v_kind, dtype)}"


def head_chunk(group_size: int) -> int:
    """Query heads per decode CTA: the group rounded up to a power of two, at most 8."""
    for gt in HEAD_CHUNKS:
        if gt >= group_size:
            return gt
    return HEAD_CHUNKS[-1]


def i32(x) -> np.int32:
    return np.int32(x)


def f32(x) -> np.float32:
    return np.float32(x)


def ptr(a):
    """Kernel argument for an optional device array: the array itself, or a null pointer."""
    return NULL if a is None else a
