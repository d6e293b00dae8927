"""Public input builders: RoPE tables and the KV-cache quantization rule.

:func:`quantize` is *the* Python definition of the cache write rule of contract §4.1::

    code = saturate(round_half_even(float32(x) * float32(1 / scale)))

int8 saturates to [-128, 127]; float8 e4m3fn clips to +-448 in float32 and then rounds to nearest
even; int4 saturates to [-8, 7]; float4 e2m1 rounds to nearest even and saturates to +-6.
:func:`dequantize` is the read rule ``code * scale``. The reference backend calls these
functions, so the CUDA kernels and the tests have one definition to agree with.

The 4-bit types are packed two codes a byte in a uint8 cache (contract §4.1): code 2i in the low
nibble of byte i, code 2i+1 in the high nibble; an int4 code q is stored as the nibble q + 8, an
e2m1 code as its own 4 bits (sign, two exponent bits, one mantissa bit). On the NumPy side their
logical types are ml_dtypes' ``int4`` and ``float4_e2m1fn``; :func:`pack_codes` and
:func:`unpack_codes` convert between those and the packed bytes.

Scales are checked (:func:`check_scale`): a scale that is zero, negative, NaN, Inf, or so small that
its float32 reciprocal overflows raises :class:`cupa.PagedAttentionError` naming the entry.

NumPy is the tested path. Functions that take an array also accept CuPy arrays (they use the
array's own module); CuPy has no float8 dtype, so float8 codes on CuPy are always raw e4m3 bytes
(``uint8``). The checks of scales and of :func:`compute_scale`'s data read a CuPy array's verdict
back to the host (one synchronization per call).
"""

from __future__ import annotations

import numpy as np
import ml_dtypes

from .contract import PACKED_KINDS
from .errors import fail

__all__ = ["rope_cache", "compute_scale", "quantize", "dequantize", "check_scale", "pack_codes", "unpack_codes"]

_FP8_NAMES = ("float8e4m3fn", "float8_e4m3fn")
_INT8_NAMES = ("int8",)
_INT4_NAMES = ("int4",)
_FP4_NAMES = ("float4e2m1", "float4_e2m1fn")
FP8_MAX = 448.0
INT8_MAX = 127.0
INT4_MAX = 7.0
FP4_MAX = 6.0
_CACHE_DTYPES = "'int8', 'float8e4m3fn', 'int4' or 'float4e2m1'"
#: the smallest normal float32: the least scale compute_scale returns (its reciprocal is finite)
SCALE_MIN = float(np.finfo(np.float32).tiny)


def _xp(x):
    """The array module of ``x``: cupy for CuPy arrays, numpy otherwise."""
    if type(x).__module__.split(".")[0] == "cupy":
        import cupy

        return cupy
    return np


def _host(x) -> np.ndarray:
    """A NumPy view or copy of ``x`` (CuPy arrays are copied to the host)."""
    if type(x).__module__.split(".")[0] == "cupy":
        return x.get()
    return np.asarray(x)


def _first(bad: np.ndarray) -> str:
    """The index of the first True entry of ``bad``, as text."""
    index = np.argwhere(bad)[0].tolist()
    return str(index[0]) if len(index) == 1 else str(tuple(index))


def check_scale(scale, name: str = "scale") -> None:
    """Raise :class:`cupa.PagedAttentionError` unless every entry of ``scale`` is a usable scale.

    A usable scale is positive and finite as float32, with a finite float32 reciprocal (at least
    about 2.9e-39). Contract §4.4 calls a scale <= 0 or non-finite a contract violation; the write
    rule, which multiplies by ``float32(1/scale)``, cannot apply a smaller one either.

    Parameters
    ----------
    scale : array of float32, shape (1,) or (kv_num_heads, 1, head_size)
    name : str, default "scale"
        The input's name in the message (e.g. ``"k_scale"``).
    """
    s = _host(scale).astype(np.float32)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        ok = np.isfinite(s) & (s > 0) & np.isfinite(np.float32(1) / s)
    if not ok.all():
        bad = ~ok
        raise fail(name, f"{s[bad].flat[0]} at index {_first(bad)}",
                   "positive, finite float32 scales whose reciprocal is finite (>= ~2.9e-39)")


def _cache_kind(cache_dtype) -> str:
    """'int8', 'fp8', 'int4' or 'fp4' from a cache dtype spelling (string, NumPy dtype or ml_dtypes type)."""
    if isinstance(cache_dtype, str):
        name = cache_dtype
    else:
        try:
            name = np.dtype(cache_dtype).name
        except TypeError as exc:
            raise ValueError(f"cache_dtype: got {cache_dtype!r}; expected {_CACHE_DTYPES}") from exc
    for kind, names in (("int8", _INT8_NAMES), ("fp8", _FP8_NAMES), ("int4", _INT4_NAMES), ("fp4", _FP4_NAMES)):
        if name in names:
            return kind
    raise ValueError(f"cache_dtype: got {cache_dtype!r}; expected {_CACHE_DTYPES}")


def _qmax(kind: str) -> float:
    return {"int8": INT8_MAX, "fp8": FP8_MAX, "int4": INT4_MAX, "fp4": FP4_MAX}[kind]


def rope_cache(max_position: int, rotary_dim: int, base: float = 10000.0, dtype=np.float16):
    """Cosine and sine tables for rotary position embedding (RoPE).

    ``cos[p, i] = cos(p * base ** (-2 i / rotary_dim))`` (likewise ``sin``), computed in float64 and
    then cast to ``dtype``. Partial rotary (rotary_dim < head_size) is simply a smaller rotary_dim;
    ``rotary_offset`` picks where in the head it applies.

    Parameters
    ----------
    max_position : int
        Number of positions (rows); positions ``0 .. max_position-1`` are covered.
    rotary_dim : int
        Even number of rotated channels.
    base : float, default 10000.0
        RoPE base (theta).
    dtype : NumPy dtype, default float16
        Element type of the tables; use the query's type T (float16, ml_dtypes.bfloat16, float32).

    Returns
    -------
    cos, sin : ndarray, shape (max_position, rotary_dim // 2), dtype ``dtype``
    """
    if int(rotary_dim) != rotary_dim or rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rotary_dim: got {rotary_dim!r}; expected a positive even integer")
    if int(max_position) != max_position or max_position < 0:
        raise ValueError(f"max_position: got {max_position!r}; expected an integer >= 0")
    half = int(rotary_dim) // 2
    inv_freq = float(base) ** (-2.0 * np.arange(half, dtype=np.float64) / float(rotary_dim))
    angles = np.arange(int(max_position), dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.cos(angles).astype(dtype), np.sin(angles).astype(dtype)


def compute_scale(x, quant_type: str, cache_dtype="int8"):
    """Symmetric quantization scale that maps ``max|x|`` to the largest code.

    Parameters
    ----------
    x : array, shape (..., kv_num_heads, head_size)
        K or V values (any float dtype; e.g. the keys of a prompt).
    quant_type : {"PER_TENSOR", "PER_CHANNEL"}
        PER_TENSOR: one scale; PER_CHANNEL: one scale per (kv head, channel), reduced over every
        leading dimension of ``x``.
    cache_dtype : {"int8", "float8e4m3fn", "int4", "float4e2m1"} or a dtype, default "int8"
        The code type: qmax = 127 for int8, 448 for float8 e4m3fn, 7 for int4, 6 for float4 e2m1.

    Returns
    -------
    scale : float32 array, shape (1,) for PER_TENSOR or (kv_num_heads, 1, head_size) for PER_CHANNEL
        ``max|x| / qmax``, always a scale :func:`check_scale` accepts: where every value it covers is
        zero (all-zero or empty data) the scale is 1.0, and a positive ``max|x| / qmax`` below the
        smallest normal float32 is raised to it (:data:`SCALE_MIN`, ~1.2e-38).

    Raises
    ------
    PagedAttentionError
        If ``x`` holds a NaN or an Inf (no scale maps it to a code); the message names its index.
    """
    xp = _xp(x)
    kind = _cache_kind(cache_dtype)
    qmax = _qmax(kind)
    a = xp.abs(xp.asarray(x).astype(xp.float64))
    if a.size and not bool(xp.isfinite(a.max())):
        raise fail("x", f"a non-finite value at index {_first(~np.isfinite(_host(a)))}", "finite K or V values")
    if quant_type == "PER_TENSOR":
        m = a.max().reshape(1) if a.size else xp.zeros(1, dtype=xp.float64)
    elif quant_type == "PER_CHANNEL":
        if a.ndim < 2:
            raise ValueError(f"x: got shape {tuple(a.shape)}; expected (..., kv_num_heads, head_size) for PER_CHANNEL")
        hk, d = a.shape[-2], a.shape[-1]
        a2 = a.reshape(-1, hk, d)
        m = a2.max(axis=0) if a2.shape[0] else xp.zeros((hk, d), dtype=xp.float64)
        m = m.reshape(hk, 1, d)
    else:
        raise ValueError(f"quant_type: got {quant_type!r}; expected 'PER_TENSOR' or 'PER_CHANNEL'")
    s = xp.where(m > 0, xp.maximum(m / qmax, SCALE_MIN), 1.0)
    return s.astype(xp.float32)


def _broadcast_scale(scale, x_shape, xp):
    """Scale as float32, shaped to broadcast against (..., Hk, D)."""
    s = xp.asarray(scale, dtype=xp.float32)
    if s.ndim == 3:  # PER_CHANNEL (Hk, 1, D) -> (Hk, D)
        if len(x_shape) < 2 or s.shape[0] != x_shape[-2] or s.shape[2] != x_shape[-1] or s.shape[1] != 1:
            raise ValueError(f"scale: got shape {tuple(s.shape)}; expected (kv_num_heads, 1, head_size) matching "
                             f"x of shape {tuple(x_shape)}")
        s = s.reshape(s.shape[0], s.shape[2])
    elif s.ndim == 1 and s.shape[0] != 1:
        raise ValueError(f"scale: got shape {tuple(s.shape)}; expected (1,) or (kv_num_heads, 1, head_size)")
    elif s.ndim not in (0, 1):
        raise ValueError(f"scale: got shape {tuple(s.shape)}; expected (1,) or (kv_num_heads, 1, head_size)")
    return s


def _fp8_bytes_from_f32(y, xp):
    """Encode float32 values already clipped to +-448 as e4m3fn bytes, round to nearest even.

    Pure arithmetic (works on NumPy and CuPy); NaN encodes as 0x7F/0xFF.
    """
    y = y.astype(xp.float32)
    neg = xp.signbit(y)
    a = xp.abs(y).astype(xp.float64)
    nan = xp.isnan(a)
    a = xp.where(nan, 0.0, xp.minimum(a, FP8_MAX))
    # binade exponent: a = mant * 2**ex, mant in [0.5, 1) -> floor(log2 a) = ex - 1
    _, ex = xp.frexp(a)
    e = xp.maximum(ex.astype(xp.int64) - 1, -6)          # subnormals share the step of binade -6
    step = xp.ldexp(xp.ones_like(a), (e - 3).astype(xp.int32))  # 3 mantissa bits
    r = xp.rint(a / step) * step                          # exact division by a power of two; RNE
    r = xp.minimum(r, FP8_MAX)
    # encode r: code = e_field * 8 + m; continuous across the subnormal/normal boundary
    _, ex2 = xp.frexp(r)
    e2 = xp.maximum(ex2.astype(xp.int64) - 1, -6)
    sub = r < 2.0 ** -6
    m_sub = xp.rint(r / 2.0 ** -9)
    frac = r / xp.ldexp(xp.ones_like(r), e2.astype(xp.int32))   # in [1, 2)
    code_norm = (e2 + 7) * 8 + xp.rint((frac - 1.0) * 8.0).astype(xp.int64)
    code = xp.where(sub, m_sub.astype(xp.int64), code_norm)
    code = xp.where(nan, 0x7F, code)
    code = code + xp.where(neg, 0x80, 0)
    return code.astype(xp.uint8)


_FP8_TABLE = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
#: value of each 4-bit code: int4 nibble n is n - 8, an e2m1 nibble is its float4_e2m1fn value
_NIBBLE_VALUES = {"int4": np.arange(16, dtype=np.float32) - 8.0,
                  "fp4": np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)}
#: the two values of every byte of a packed cache: [byte, 0] the low nibble (code 2i), [byte, 1] the high one
_BYTE_VALUES = {kind: np.stack([v[np.arange(256) & 15], v[np.arange(256) >> 4]], axis=1)
                for kind, v in _NIBBLE_VALUES.items()}
_LOGICAL = {"int4": np.dtype(ml_dtypes.int4), "fp4": np.dtype(ml_dtypes.float4_e2m1fn)}
#: e2m1 midpoints: |y| above each (at or above, where the even code is the upper one) adds one to the code
_FP4_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def _int4_nibbles(y, xp):
    """int4 write rule on float32 ``y``: round half to even, saturate to [-8, 7] (NaN to -8, as ``fmax``
    picks the bound), stored as q + 8."""
    q = xp.fmin(xp.fmax(xp.rint(y), -8.0), 7.0)
    return (q + 8.0).astype(xp.uint8)


def _fp4_nibbles(y, xp):
    """e2m1 write rule on float32 ``y``: round to nearest even, saturate to +-6; NaN becomes +6 (code 7),
    as CUDA's conversion gives. The code is sign << 3 | the number of midpoints |y| passes."""
    a = xp.abs(y)
    m = xp.zeros(y.shape, dtype=xp.uint8)
    for point, inclusive in _FP4_MIDPOINTS:
        m += (a >= point) if inclusive else (a > point)
    code = m | (xp.signbit(y).astype(xp.uint8) << 3)
    return xp.where(xp.isnan(y), xp.uint8(7), code).astype(xp.uint8)


def _pack_nibbles(nibbles, xp):
    """uint8 nibbles (..., 2n) -> packed bytes (..., n): element 2i in the low nibble of byte i."""
    if nibbles.shape[-1] % 2:
        raise fail("codes", f"shape {tuple(nibbles.shape)}", "an even last dimension: two codes a byte")
    return (nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)).astype(xp.uint8)


def _unpack_nibbles(packed, xp):
    """Packed bytes (..., n) -> uint8 nibbles (..., 2n)."""
    return xp.stack([packed & 15, packed >> 4], axis=-1).reshape(packed.shape[:-1] + (2 * packed.shape[-1],))


def pack_codes(codes) -> np.ndarray:
    """Pack 4-bit codes two a byte, the layout of a packed cache (contract §4.1).

    Parameters
    ----------
    codes : ndarray of ml_dtypes.int4 or ml_dtypes.float4_e2m1fn, shape (..., n), n even
        Logical codes (e.g. ``cupa.quantize(x, scale, "int4")``).

    Returns
    -------
    packed : uint8 ndarray, shape (..., n // 2)
        Byte i holds code 2i in its low nibble and code 2i+1 in its high nibble; an int4 code q is
        the nibble q + 8, an e2m1 code its own 4 bits.
    """
    codes = np.asarray(codes)
    name = codes.dtype.name
    if name not in ("int4", "float4_e2m1fn"):
        raise fail("codes", f"dtype {name}", "ml_dtypes.int4 or ml_dtypes.float4_e2m1fn (4-bit codes)")
    nibbles = codes.view(np.uint8) & 15
    if name == "int4":
        nibbles = nibbles ^ 8                     # two's complement nibble -> q + 8
    return _pack_nibbles(nibbles, np)


def unpack_codes(packed, cache_dtype) -> np.ndarray:
    """The logical 4-bit codes of packed bytes (the inverse of :func:`pack_codes`).

    Parameters
    ----------
    packed : uint8 ndarray, shape (..., m)
        Bytes of a packed cache (or any part of one).
    cache_dtype : {"int4", "float4e2m1"} or ml_dtypes.int4 / ml_dtypes.float4_e2m1fn

    Returns
    -------
    codes : ndarray of ml_dtypes.int4 or ml_dtypes.float4_e2m1fn, shape (..., 2 * m)
    """
    kind = _cache_kind(cache_dtype)
    if kind not in PACKED_KINDS:
        raise ValueError(f"cache_dtype: got {cache_dtype!r}; expected 'int4' or 'float4e2m1'")
    packed = np.asarray(packed)
    if packed.dtype != np.uint8:
        raise fail("packed", f"dtype {packed.dtype}", "uint8 bytes of a packed cache")
    nibbles = _unpack_nibbles(packed, np)
    if kind == "int4":
        nibbles = nibbles ^ 8                     # q + 8 -> two's complement nibble
    return nibbles.astype(np.uint8).view(_LOGICAL[kind])


def quantize(x, scale, cache_dtype="int8", as_bytes: bool = False):
    """Quantize K or V values with the cache write rule (contract §4.1).

    ``code = saturate(round_half_even(float32(x) * float32(1/scale)))`` where ``float32(1/scale)`` is
    ``np.float32(1) / scale`` evaluated in float32 and the product is float32. int8 saturates to
    [-128, 127]; float8 e4m3fn clips to +-448 in float32 and then rounds to nearest even; int4
    saturates to [-8, 7]; float4 e2m1 rounds to nearest even and saturates to +-6. A value of +-Inf
    saturates; NaN becomes the int8 code -128 and the int4 code -8 (saturation by ``fmax``/``fmin``,
    as the CUDA kernels do), the float8 NaN code, and the e2m1 code +6 (as CUDA's e2m1 conversion
    gives; a plain ml_dtypes cast gives -0 there).

    Parameters
    ----------
    x : array, shape (..., kv_num_heads, head_size)
        Values to store (float16, bfloat16 or float32; typically already rounded to T).
    scale : float32 array, shape (1,) or (kv_num_heads, 1, head_size)
        PER_TENSOR or PER_CHANNEL scale; broadcasts over the leading dimensions of ``x``.
    cache_dtype : {"int8", "float8e4m3fn", "int4", "float4e2m1"} or a dtype, default "int8"
        Code type.
    as_bytes : bool, default False
        float8: return the raw e4m3 bytes as uint8; int4 / float4 e2m1: return the codes packed two
        a byte (:func:`pack_codes`), shape (..., head_size // 2). The layout a CuPy cache holds:
        always the case for CuPy inputs.

    Returns
    -------
    codes : array shaped like ``x`` (int8, ml_dtypes.float8_e4m3fn, ml_dtypes.int4 or
        ml_dtypes.float4_e2m1fn), or uint8 bytes (``as_bytes``; packed 4-bit codes: last dimension halved)

    Raises
    ------
    PagedAttentionError
        If a scale is zero, negative, NaN, Inf or too small for a finite reciprocal (:func:`check_scale`),
        or if packed codes are asked of an odd last dimension.
    """
    xp = _xp(x)
    kind = _cache_kind(cache_dtype)
    x = xp.asarray(x)
    check_scale(scale)
    s = _broadcast_scale(scale, x.shape, xp)
    inv = (xp.float32(1) / s).astype(xp.float32)
    y = (x.astype(xp.float32) * inv).astype(xp.float32)
    if kind == "int8":
        return xp.fmin(xp.fmax(xp.rint(y), -128), 127).astype(xp.int8)
    if kind in PACKED_KINDS:
        nibbles = _int4_nibbles(y, xp) if kind == "int4" else _fp4_nibbles(y, xp)
        if as_bytes or xp is not np:
            return _pack_nibbles(nibbles, xp)
        return (nibbles ^ 8 if kind == "int4" else nibbles).view(_LOGICAL[kind])
    y = xp.clip(y, -FP8_MAX, FP8_MAX).astype(xp.float32)
    if xp is np:
        codes = y.astype(ml_dtypes.float8_e4m3fn)
        return codes.view(np.uint8) if as_bytes else codes
    return _fp8_bytes_from_f32(y, xp)


def packed_values(packed, kind: str, xp=np):
    """float32 values (..., 2m) of the codes in packed bytes (..., m) of ``kind`` ("int4" or "fp4"): the
    read rule's code values before the scale."""
    table = _BYTE_VALUES[kind] if xp is np else xp.asarray(_BYTE_VALUES[kind])
    vals = table[packed.astype(xp.intp) if xp is not np else packed]
    return vals.reshape(packed.shape[:-1] + (2 * packed.shape[-1],))


def dequantize(codes, scale, cache_dtype=None):
    """Dequantize cache codes with the read rule ``code * scale`` (float32).

    Parameters
    ----------
    codes : array, shape (..., kv_num_heads, head_size), or packed (..., kv_num_heads, head_size // 2)
        int8 codes, ml_dtypes.float8_e4m3fn / int4 / float4_e2m1fn codes, or uint8 bytes: raw e4m3
        bytes (``cache_dtype="float8e4m3fn"``) or 4-bit codes packed two a byte
        (``cache_dtype="int4"`` or ``"float4e2m1"``).
    scale : float32 array, shape (1,) or (kv_num_heads, 1, head_size)
    cache_dtype : {None, "int8", "float8e4m3fn", "int4", "float4e2m1"}
        Needed only for uint8 bytes; otherwise taken from ``codes.dtype``.

    Returns
    -------
    values : float32 array, shape (..., kv_num_heads, head_size)

    Raises
    ------
    PagedAttentionError
        If a scale is zero, negative, NaN, Inf or too small for a finite reciprocal (:func:`check_scale`).
    """
    xp = _xp(codes)
    codes = xp.asarray(codes)
    name = np.dtype(codes.dtype).name if xp is np else str(codes.dtype)
    if name == "uint8":
        kind = None if cache_dtype is None else _cache_kind(cache_dtype)
        if kind == "fp8":
            vals = xp.asarray(_FP8_TABLE)[codes.astype(xp.int64)] if xp is not np else _FP8_TABLE[codes]
        elif kind in PACKED_KINDS:
            vals = packed_values(codes, kind, xp)
        else:
            raise ValueError(f"cache_dtype: got {cache_dtype!r} for uint8 codes; expected 'float8e4m3fn' (raw e4m3 "
                             "bytes), 'int4' or 'float4e2m1' (4-bit codes packed two a byte)")
    elif name in ("int8", "float8_e4m3fn", "int4", "float4_e2m1fn"):
        if cache_dtype is not None and _cache_kind(cache_dtype) != _cache_kind(name):
            raise ValueError(f"cache_dtype: got {cache_dtype!r} for {name} codes; expected None or {name!r}")
        vals = codes.astype(np.float32) if xp is np else codes.astype(xp.float32)
    else:
        raise ValueError(f"codes: got dtype {name}; expected int8, float8_e4m3fn, int4, float4_e2m1fn or uint8 "
                         "(e4m3 bytes or packed 4-bit codes)")
    check_scale(scale)
    s = _broadcast_scale(scale, vals.shape, xp)
    return (vals.astype(xp.float32) * s).astype(xp.float32)
