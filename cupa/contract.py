"""The PagedAttention contract in one place: attributes, derived sizes, validation.

Everything here works from shapes, dtypes and attributes only (plus the host
values of ``attention_metadata``); nothing reads device memory. ``validate``
returns a :class:`Problem`, the single description of a call that the reference
backend, the dispatcher and the CUDA kernels draw their sizes from.

Every violation raises :class:`cupa.PagedAttentionError` naming the input or
attribute, what it got and what it expected (contract §4, seed section 15).
"""

from __future__ import annotations

import collections.abc as _abc
import functools
import math
from dataclasses import dataclass, fields
from typing import Mapping, Optional, Sequence

import numpy as np

from .errors import fail

#: ONNX input order (contract §1). Positional arguments follow it.
INPUT_NAMES = (
    "query", "key", "value", "key_cache", "value_cache", "cumulative_sequence_length",
    "past_seqlens", "block_table", "cos_cache", "sin_cache", "slot_mapping", "head_sink",
    "q_norm_weight", "k_norm_weight", "k_scale", "v_scale", "attention_metadata",
    "query_positions", "attention_bias",
)

#: Relative error ||out - ref|| / ||ref|| a CUDA backend stays below against the NumPy reference, per T
#: (contract §6).
TOLERANCE = {"float16": 2e-3, "bfloat16": 1e-2, "float32": 1e-5}

QUANT_TYPES = ("NONE", "PER_TENSOR", "PER_CHANNEL")
LAYOUTS = ("SEPARATE", "LATENT")
FLOAT_TYPES = ("float16", "bfloat16", "float32")
#: k/v_cache_dtype vocabulary -> canonical array dtype name it denotes ("" = the array's own).
CACHE_DTYPE_NAMES = {
    "": None, "float16": "float16", "bfloat16": "bfloat16", "float32": "float32",
    "int8": "int8", "float8e4m3fn": "float8_e4m3fn", "int4": "uint8", "float4e2m1": "uint8",
}
SUB_BYTE = ("int4", "float4e2m1")
#: k/v_cache_dtype of a uint8 cache array -> the cache kind it holds (Problem.cache_kind / v_cache_kind)
BYTE_CACHE_KINDS = {"float8e4m3fn": "fp8", "int4": "int4", "float4e2m1": "fp4"}
#: cache kinds whose codes are packed two a byte (contract §4.1): a cache row holds head_size / 2 bytes
PACKED_KINDS = ("int4", "fp4")
FP8_MAX = 448.0


@dataclass(frozen=True)
class ArrayInfo:
    """What validation needs to know about one array: its shape and canonical dtype name."""

    shape: tuple
    dtype: str

    @property
    def ndim(self) -> int:
        return len(self.shape)


@dataclass(frozen=True)
class Attributes:
    """The node attributes of contract §3, validated on construction.

    Every rule that depends on attributes alone lives here, so a bad node fails when it is
    built (``cupa.PagedAttention(...)``), before any input is seen. String attributes may be
    given as ``bytes`` (what ``onnx.helper.get_attribute_value`` returns); they are decoded.
    """

    num_heads: int
    kv_num_heads: int
    scale: float = 0.0
    softcap: float = 0.0
    local_window_size: int = -1
    is_causal: int = 1
    do_rotary: int = 0
    rotary_interleaved: int = 0
    rotary_offset: int = 0
    qk_norm_epsilon: float = 1e-6
    k_quant_type: str = "NONE"
    v_quant_type: str = "NONE"
    k_cache_dtype: str = ""
    v_cache_dtype: str = ""
    kv_cache_layout: str = "SEPARATE"
    v_head_size: int = 0
    qk_output: int = 0
    #: cupa extension (not an ONNX attribute): also return the softmax log-sum-exp of every (token, head)
    return_lse: bool = False

    def __post_init__(self):
        def integer(name, low=None):
            v = getattr(self, name)
            if v is None:
                raise fail(name, "None (absent)", "an integer" + ("" if low is None else f" >= {low}")
                           + (" (a required attribute)" if name in ("num_heads", "kv_num_heads") else ""))
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise fail(name, f"{v!r} ({type(v).__name__})", "an integer")
            v = int(v)
            object.__setattr__(self, name, v)
            if low is not None and v < low:
                raise fail(name, v, f"an integer >= {low}")

        def real(name):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
                raise fail(name, f"{v!r} ({type(v).__name__})", "a real number")
            v = float(v)
            if not math.isfinite(v):
                raise fail(name, v, "a finite number")
            object.__setattr__(self, name, v)

        def flag(name):
            integer(name)
            if getattr(self, name) not in (0, 1):
                raise fail(name, getattr(self, name), "0 or 1")

        def choice(name, allowed):
            v = getattr(self, name)
            if isinstance(v, (bytes, np.bytes_)):
                v = bytes(v).decode("utf-8", "replace")
                object.__setattr__(self, name, v)
            elif isinstance(v, np.str_):
                v = str(v)
                object.__setattr__(self, name, v)
            if not isinstance(v, str) or v not in allowed:
                raise fail(name, repr(v), "one of " + ", ".join(repr(a) for a in allowed))

        integer("num_heads", 1)
        integer("kv_num_heads", 1)
        if self.num_heads % self.kv_num_heads:
            raise fail("kv_num_heads", self.kv_num_heads,
                       f"a divisor of num_heads={self.num_heads} (num_heads % kv_num_heads == 0)")
        real("scale")
        if self.scale < 0:
            raise fail("scale", self.scale, "0 (meaning 1/sqrt(head_size)) or a positive number")
        real("softcap")
        if self.softcap < 0:
            raise fail("softcap", self.softcap, "0 (off) or a positive number")
        integer("local_window_size")
        if self.local_window_size == 0 or self.local_window_size < -1:
            raise fail("local_window_size", self.local_window_size, "-1 (no window) or a positive window W")
        flag("is_causal")
        flag("do_rotary")
        flag("rotary_interleaved")
        integer("rotary_offset", 0)
        if self.rotary_offset % 8:
            raise fail("rotary_offset", self.rotary_offset, "a multiple of 8")
        real("qk_norm_epsilon")
        if self.qk_norm_epsilon <= 0:
            raise fail("qk_norm_epsilon", self.qk_norm_epsilon, "a positive number")
        choice("k_quant_type", QUANT_TYPES)
        choice("v_quant_type", QUANT_TYPES)
        for name in ("k_cache_dtype", "v_cache_dtype"):
            v = getattr(self, name)
            if isinstance(v, str) and v.startswith("uint"):
                raise fail(name, repr(v), "a signed, zero-symmetric type ('', 'float16', 'bfloat16', 'float32', "
                           "'int8', 'float8e4m3fn', 'int4', 'float4e2m1'): quantization here has no zero point, "
                           "so unsigned logical types are not in the vocabulary")
            choice(name, tuple(CACHE_DTYPE_NAMES))
        choice("kv_cache_layout", LAYOUTS)
        integer("v_head_size", 0)
        integer("qk_output")
        if self.qk_output not in (0, 1, 2):
            raise fail("qk_output", self.qk_output, "0 (off), 1 (scores) or 2 (probabilities)")
        if self.return_lse not in (0, 1) or not isinstance(self.return_lse, (bool, int, np.integer)):
            raise fail("return_lse", repr(self.return_lse), "True or False")
        object.__setattr__(self, "return_lse", bool(self.return_lse))
        if self.kv_cache_layout == "LATENT":
            if self.kv_num_heads != 1:
                raise fail("kv_num_heads", self.kv_num_heads, "1 in LATENT layout (one shared latent head)")
            if self.v_quant_type != "NONE":
                raise fail("v_quant_type", repr(self.v_quant_type),
                           "'NONE' in LATENT layout (k_quant_type describes the one latent cache)")
            if self.v_cache_dtype != "":
                raise fail("v_cache_dtype", repr(self.v_cache_dtype), "'' in LATENT layout (V is a view of K)")

    @classmethod
    def names(cls) -> tuple:
        return tuple(f.name for f in fields(cls))

    def as_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.names()}


@dataclass(frozen=True)
class Problem:
    """Sizes and features of one call, derived from shapes, dtypes and attributes only.

    Every backend takes its launch extents, workspace sizes and specialization from here.
    """

    attrs: Attributes
    token_count: int            # N
    batch_size: int             # B
    num_heads: int              # H
    kv_num_heads: int           # Hk
    head_size: int              # D
    v_head_size: int            # effective: D except in LATENT
    group_size: int             # H // Hk
    packed_qkv: bool
    latent: bool
    dtype: str                  # T: "float16" | "bfloat16" | "float32"
    cache_array_dtype: str      # the cache arrays' own dtype name
    cache_kind: str             # key_cache's codes: "T" | "int8" | "fp8" | "int4" | "fp4" (PACKED_KINDS: two a byte)
    v_cache_kind: str           # value_cache's codes (= cache_kind in LATENT: V is a view of K)
    fp8_as_bytes: bool          # an fp8 cache held as uint8 bytes (CuPy)
    v_quant: str                # effective V quantization: k_quant_type in LATENT (V is a view of K)
    num_blocks: int
    block_size: int
    max_blocks_per_seq: int     # block_table.shape[1]
    scale: float                # effective softmax scale
    rotary_dim: int             # 0 when do_rotary == 0
    rotary_max_pos: int         # cos_cache.shape[0], 0 when no rotary
    has_slot_mapping: bool
    has_head_sink: bool
    has_qk_norm: bool
    has_query_positions: bool
    has_bias: bool
    bias_shape: tuple           # (Bb, Hb, q_capacity, kv_capacity_bias) or ()
    has_metadata: bool
    max_query_len_bound: int    # launch bound on new tokens of one sequence
    max_kv_len_bound: int       # launch bound on kv length of one sequence: contract §2's kv_capacity
    max_kv_len_lower_bound: int  # speed hint only

    @property
    def kv_capacity(self) -> int:
        """contract §2's kv_capacity (the width of output_qk): :attr:`max_kv_len_bound`."""
        return self.max_kv_len_bound

    @property
    def k_quant(self) -> str:
        return self.attrs.k_quant_type

    @property
    def static_kv_capacity(self) -> int:
        return self.max_blocks_per_seq * self.block_size

    @property
    def output_shape(self) -> tuple:
        return (self.token_count, self.num_heads * self.v_head_size)

    @property
    def output_qk_shape(self) -> tuple:
        return (self.num_heads, self.token_count, self.kv_capacity)

    @property
    def lse_shape(self) -> tuple:
        return (self.token_count, self.num_heads)

    @property
    def quantized(self) -> bool:
        return self.cache_kind != "T"

    @property
    def sub_byte(self) -> bool:
        """A cache holds packed 4-bit codes (int4 or float4 e2m1, two a byte)."""
        return self.cache_kind in PACKED_KINDS or self.v_cache_kind in PACKED_KINDS

    @property
    def packed(self) -> bool:
        """Both caches hold packed 4-bit codes: K and V rows of head_size / 2 bytes (the kernels' case)."""
        return self.cache_kind in PACKED_KINDS and self.v_cache_kind in PACKED_KINDS

    @property
    def cache_row_items(self) -> int:
        """Array elements of one (slot, kv head) row of key_cache: head_size, or head_size / 2 packed."""
        return self.head_size // (2 if self.cache_kind in PACKED_KINDS else 1)

    @property
    def v_cache_row_items(self) -> int:
        """Array elements of one (slot, kv head) row of value_cache (of key_cache in LATENT)."""
        return self.head_size // (2 if self.v_cache_kind in PACKED_KINDS else 1)

    @property
    def cache_block_bytes(self) -> int:
        """Bytes of one block of key_cache."""
        return self.block_size * self.kv_num_heads * self.cache_row_items * _ITEMSIZE.get(self.cache_array_dtype, 1)

    @functools.cached_property
    def input_nbytes(self) -> dict:
        """Bytes of every present tensor input (what a memory-overlap check needs), by input name."""
        t = _ITEMSIZE[self.dtype]
        c = _ITEMSIZE.get(self.cache_array_dtype, 1)
        N, B, H, Hk, D = self.token_count, self.batch_size, self.num_heads, self.kv_num_heads, self.head_size
        hidden = (H + 2 * Hk) * D if self.packed_qkv else H * D
        rows = self.num_blocks * self.block_size * Hk
        sizes = {"query": N * hidden * t, "key_cache": rows * self.cache_row_items * c,
                 "cumulative_sequence_length": (B + 1) * 4, "past_seqlens": B * 4,
                 "block_table": B * self.max_blocks_per_seq * 4}
        if not self.packed_qkv:
            sizes["key"] = N * (D if self.latent else Hk * D) * t
            if not self.latent:
                sizes["value"] = N * Hk * D * t
        if not self.latent:
            sizes["value_cache"] = rows * self.v_cache_row_items * c
        if self.rotary_dim:
            sizes["cos_cache"] = sizes["sin_cache"] = self.rotary_max_pos * (self.rotary_dim // 2) * t
        for name, present, n in (("slot_mapping", self.has_slot_mapping, N * 4),
                                 ("query_positions", self.has_query_positions, N * 4),
                                 ("head_sink", self.has_head_sink, H * t)):
            if present:
                sizes[name] = n
        if self.has_qk_norm:
            sizes["q_norm_weight"] = sizes["k_norm_weight"] = D * t
        if self.quantized:
            sizes["k_scale"] = 4 if self.k_quant == "PER_TENSOR" else Hk * D * 4
            if not self.latent:
                sizes["v_scale"] = 4 if self.v_quant == "PER_TENSOR" else Hk * D * 4
        if self.has_bias:
            sizes["attention_bias"] = math.prod(self.bias_shape) * t
        return sizes


_INT32_MAX = (1 << 31) - 1
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


def _dims(shape) -> str:
    return "(" + ", ".join(str(d) for d in shape) + (",)" if len(shape) == 1 else ")")


def _need(infos, name, what):
    info = infos.get(name)
    if info is None:
        raise fail(name, "None (absent)", what)
    return info


def _check_rank(info: ArrayInfo, name: str, rank: int, what: str):
    if len(info.shape) != rank:
        raise fail(name, f"shape {_dims(info.shape)} (rank {len(info.shape)})", f"rank {rank}: {what}")


def _check_dtype(info: ArrayInfo, name: str, expected: str, why: str = ""):
    if info.dtype != expected:
        raise fail(name, f"dtype {info.dtype}", f"dtype {expected}" + (f" ({why})" if why else ""))


def _check_shape(info: ArrayInfo, name: str, expected: tuple, what: str = ""):
    if tuple(info.shape) != expected:
        raise fail(name, f"shape {_dims(info.shape)}", f"shape {_dims(expected)}" + (f" {what}" if what else ""))


_INT32 = np.dtype(np.int32)
_MD_SHAPES = ((2,), (3,))
_MD_EXPECTED = "int32 host values: a list/tuple or NumPy int32 array"
_MD_SHAPE = "2 or 3 entries [max_query_len_bound, max_kv_len_bound(, max_kv_len_lower_bound)]"


def metadata_values(md) -> Optional[tuple]:
    """Read attention_metadata on the host and validate it; returns a tuple of 2 or 3 ints, or None.

    attention_metadata lives in host memory: a list/tuple of ints or a NumPy int32 array of
    shape (2,) or (3,), every entry >= 0 (0 = unknown). A device array is an error: the value
    is read on the host once, and reading device memory back would synchronize.
    """
    if md is None:
        return None
    if type(md) is np.ndarray and md.dtype is _INT32 and md.shape in _MD_SHAPES:   # the common case
        vals = tuple(md.tolist())
        if vals[0] < 0 or vals[1] < 0 or (len(vals) > 2 and vals[2] < 0):
            raise fail("attention_metadata", list(vals), "entries >= 0 (0 means unknown)")
        return vals
    if isinstance(md, np.ndarray):
        if md.dtype != np.int32:
            raise fail("attention_metadata", f"dtype {md.dtype}", "dtype int32 (no silent casts of index inputs)")
        if md.ndim != 1 or md.shape[0] not in (2, 3):
            raise fail("attention_metadata", f"shape {_dims(md.shape)}", f"shape (2,) or (3,): {_MD_SHAPE}")
        vals = tuple(md.tolist())
    elif isinstance(md, (list, tuple)) or (isinstance(md, _abc.Sequence) and not isinstance(md, (str, bytes))):
        if len(md) not in (2, 3):
            raise fail("attention_metadata", f"{len(md)} entries", _MD_SHAPE)
        vals = tuple(md)
        if all(type(v) is int and -1 < v <= _INT32_MAX for v in vals):   # the common case: Python ints
            return vals
        for v in md:
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
                raise fail("attention_metadata", f"an entry {v!r} ({type(v).__name__})", _MD_EXPECTED)
            if isinstance(v, np.integer) and v.dtype != np.int32:
                raise fail("attention_metadata", f"an entry of dtype {v.dtype}", _MD_EXPECTED)
        vals = tuple(int(v) for v in md)
        if any(v > _INT32_MAX for v in vals):
            raise fail("attention_metadata", list(vals), f"int32 entries (<= {_INT32_MAX})")
    else:
        mod = type(md).__module__.split(".")[0]
        device = (mod in ("cupy", "jax", "jaxlib") or hasattr(md, "__cuda_array_interface__")
                  or bool(getattr(md, "is_cuda", False)))
        got = f"a {mod} device array" if device else f"a {type(md).__module__}.{type(md).__qualname__}"
        raise fail("attention_metadata", got, "host memory (a list/tuple or NumPy array of int32): it is read "
                   "once on the host, never from device memory")
    if vals[0] < 0 or vals[1] < 0 or (len(vals) > 2 and vals[2] < 0):
        raise fail("attention_metadata", list(vals), "entries >= 0 (0 means unknown)")
    return vals


def validate(attrs: Attributes, infos: Mapping[str, Optional[ArrayInfo]],
             metadata: Optional[Sequence[int]] = None, *, output_qk_max_bytes: int = 1 << 34) -> Problem:
    """Check every shape/dtype/attribute rule and derive the :class:`Problem`.

    ``infos`` maps input names (``INPUT_NAMES`` minus attention_metadata) to an
    :class:`ArrayInfo` or None when absent; ``metadata`` is the already-read host
    values of attention_metadata (see :func:`metadata_values`) or None;
    ``output_qk_max_bytes`` is :attr:`cupa.Options.output_qk_max_bytes`.
    """
    a = attrs
    H, Hk = a.num_heads, a.kv_num_heads
    latent = a.kv_cache_layout == "LATENT"
    get = infos.get

    q = _need(infos, "query", "a (token_count, num_heads*head_size) array")
    _check_rank(q, "query", 2, "(token_count, num_heads*head_size) or packed "
                "(token_count, (num_heads+2*kv_num_heads)*head_size)")
    T = q.dtype
    if T not in FLOAT_TYPES:
        raise fail("query", f"dtype {T}", "dtype float16, bfloat16 or float32 (T)")
    N, hidden = q.shape
    key, value = get("key"), get("value")

    # Input-mode state machine (seed 4.6): layout first, then presence.
    if latent:
        if key is None:
            raise fail("key", "None (absent)", "present in LATENT layout: the (token_count, head_size) latent row")
        if value is not None:
            raise fail("value", f"an array of shape {_dims(value.shape)}",
                       "absent in LATENT layout (V is a view of the latent K row)")
        if get("value_cache") is not None:
            raise fail("value_cache", "an array",
                       "absent in LATENT layout (V is the leading v_head_size channels of key_cache)")
        if get("v_scale") is not None:
            raise fail("v_scale", "an array", "absent in LATENT layout (k_scale describes the one latent cache)")
        packed = False
    else:
        if (key is None) != (value is None):
            present, absent = ("key", "value") if value is None else ("value", "key")
            raise fail(absent, "None (absent)",
                       f"present because {present} is present (key and value are both present or both absent)")
        packed = key is None

    heads = H + 2 * Hk if packed else H
    if hidden % heads:
        raise fail("query", f"shape {_dims(q.shape)}", f"dim 1 divisible by {heads} "
                   + ("(num_heads+2*kv_num_heads: packed QKV because key and value are absent)"
                      if packed else "(num_heads)"))
    D = hidden // heads
    if D % 8 or D == 0:
        raise fail("query", f"head_size {D} (from shape {_dims(q.shape)})", "head_size a positive multiple of 8")
    if not latent and D > 256:
        raise fail("query", f"head_size {D} (from shape {_dims(q.shape)})",
                   "head_size <= 256 (larger heads only in LATENT layout)")

    if key is not None:
        if latent:
            _check_shape(key, "key", (N, D), "(token_count, head_size): the LATENT latent row")
        else:
            _check_shape(key, "key", (N, Hk * D), "(token_count, kv_num_heads*head_size)")
        _check_dtype(key, "key", T, "same as query")
    if value is not None:
        _check_shape(value, "value", (N, Hk * D), "(token_count, kv_num_heads*head_size)")
        _check_dtype(value, "value", T, "same as query")

    # v_head_size / scale (seed 12.6, 12.10)
    if a.v_head_size != 0 and a.v_head_size != D and not latent:
        raise fail("v_head_size", a.v_head_size,
                   f"0 or head_size={D} in SEPARATE layout (other widths only in LATENT)")
    if a.v_head_size > D:
        raise fail("v_head_size", a.v_head_size, f"0 or a width in [1, head_size={D}]")
    Dv = a.v_head_size if (latent and a.v_head_size) else D
    if Dv != D and a.scale == 0.0:
        raise fail("scale", "0 (the default 1/sqrt(head_size))",
                   f"an explicit scale when v_head_size ({Dv}) != head_size ({D}): "
                   f"the default would silently use 1/sqrt({D})")

    # Caches
    kc = _need(infos, "key_cache", "a (num_blocks, block_size, kv_num_heads, head_size) cache")
    _check_rank(kc, "key_cache", 4, "(num_blocks, block_size, kv_num_heads, head_size)")
    num_blocks, block_size, kc_heads, kc_d = kc.shape
    if block_size < 1:
        raise fail("key_cache", f"shape {_dims(kc.shape)}", "block_size (dim 1) >= 1")
    if kc_heads != Hk:
        raise fail("key_cache", f"shape {_dims(kc.shape)}", f"dim 2 == kv_num_heads ({Hk})")
    cdt = kc.dtype
    k_cache_dtype, v_cache_dtype = a.k_cache_dtype, a.v_cache_dtype
    dtype_names = (("k_cache_dtype", k_cache_dtype),) + (() if latent else (("v_cache_dtype", v_cache_dtype),))
    fp8_as_bytes = False
    if cdt == "uint8":
        # Each cache's own logical type (contract §1): K and V may differ, e.g. int4 K with e2m1 or fp8 V.
        for name, value in dtype_names:
            if value not in BYTE_CACHE_KINDS:
                raise fail(name, repr(value), "'float8e4m3fn' (raw e4m3 bytes), 'int4' or 'float4e2m1' (two codes "
                           "a byte) when the cache arrays are uint8")
        cache_kind = BYTE_CACHE_KINDS[k_cache_dtype]
        v_cache_kind = cache_kind if latent else BYTE_CACHE_KINDS[v_cache_dtype]
        fp8_as_bytes = "fp8" in (cache_kind, v_cache_kind)
    else:
        if cdt == T:
            cache_kind = "T"
        elif cdt == "int8":
            cache_kind = "int8"
        elif cdt == "float8_e4m3fn":
            cache_kind = "fp8"
        elif cdt in FLOAT_TYPES:
            raise fail("key_cache", f"dtype {cdt}", f"the query's dtype {T}, int8, float8_e4m3fn or uint8 "
                       f"(fp8 bytes or packed 4-bit codes): a {cdt} cache with a {T} query is not allowed")
        else:
            raise fail("key_cache", f"dtype {cdt}", f"{T} (same as query), int8, float8_e4m3fn or uint8 "
                       "(fp8 bytes or packed 4-bit codes)")
        for name, value in dtype_names:   # v_cache_dtype is always '' in LATENT (Attributes)
            if value in SUB_BYTE:
                raise fail(name, repr(value), f"'' or the cache tensor's own type ({cdt}): {value!r} packs two "
                           "codes a byte into a uint8 cache")
            if value and CACHE_DTYPE_NAMES[value] != cdt:
                raise fail(name, repr(value), f"'' or the cache tensor's own type ({cdt})")
        v_cache_kind = cache_kind

    def last_dim(kind, name, value):
        """Dim 3 of a cache holding ``kind`` codes, and what to say about it."""
        if kind in PACKED_KINDS:
            return D // 2, f"dim 3 == head_size / 2 ({D // 2}): {name}={value!r} packs two codes a byte"
        return D, f"dim 3 == head_size ({D})"

    kc_expect, kc_what = last_dim(cache_kind, "k_cache_dtype", k_cache_dtype)
    if kc_d != kc_expect:
        raise fail("key_cache", f"shape {_dims(kc.shape)}", kc_what)
    if not latent:
        vc = _need(infos, "value_cache", "present in SEPARATE layout, same shape as key_cache")
        vc_expect, vc_what = last_dim(v_cache_kind, "v_cache_dtype", v_cache_dtype)
        if vc_expect == kc_expect and v_cache_kind not in PACKED_KINDS:
            _check_shape(vc, "value_cache", tuple(kc.shape), "(same as key_cache)")
        else:
            _check_shape(vc, "value_cache", (num_blocks, block_size, Hk, vc_expect),
                         f"(key_cache's first three dims; {vc_what})")
        _check_dtype(vc, "value_cache", cdt, "key_cache and value_cache share one element type")

    quants = (("k_quant_type", a.k_quant_type, "k_scale"),) if latent else (
        ("k_quant_type", a.k_quant_type, "k_scale"), ("v_quant_type", a.v_quant_type, "v_scale"))
    for qname, qt, sname in quants:
        s = get(sname)
        if qt == "NONE":
            if cache_kind != "T":
                raise fail(qname, "'NONE'", f"'PER_TENSOR' or 'PER_CHANNEL' because the cache is {cdt} "
                           "(a quantized cache needs scales)")
            if s is not None:
                raise fail(sname, "an array", f"absent because {qname} is 'NONE'")
            continue
        if cache_kind == "T":
            raise fail(qname, repr(qt), f"'NONE' because the cache has the query's type {T} "
                       "(quantization needs an int8, fp8 or packed 4-bit cache)")
        if s is None:
            raise fail(sname, "None (absent)", f"a float32 scale because {qname} is {qt!r}")
        _check_dtype(s, sname, "float32")
        if qt == "PER_TENSOR":
            _check_shape(s, sname, (1,), "(PER_TENSOR scale)")
        else:
            _check_shape(s, sname, (Hk, 1, D), "(kv_num_heads, 1, head_size): PER_CHANNEL scale")

    # Sequence description
    cum = _need(infos, "cumulative_sequence_length", "an int32 (batch_size+1,) array")
    _check_rank(cum, "cumulative_sequence_length", 1, "(batch_size + 1,)")
    _check_dtype(cum, "cumulative_sequence_length", "int32", "no silent casts of index inputs")
    if cum.shape[0] < 2:
        raise fail("cumulative_sequence_length", f"shape {_dims(cum.shape)}",
                   "at least 2 entries (batch_size + 1 with batch_size >= 1)")
    B = cum.shape[0] - 1
    past = _need(infos, "past_seqlens", "an int32 (batch_size,) array")
    _check_shape(past, "past_seqlens", (B,), "(batch_size,) with batch_size = len(cumulative_sequence_length) - 1")
    _check_dtype(past, "past_seqlens", "int32", "no silent casts of index inputs")
    bt = _need(infos, "block_table", "an int32 (batch_size, max_blocks_per_sequence) array")
    _check_rank(bt, "block_table", 2, "(batch_size, max_blocks_per_sequence)")
    _check_dtype(bt, "block_table", "int32", "no silent casts of index inputs")
    if bt.shape[0] != B:
        raise fail("block_table", f"shape {_dims(bt.shape)}", f"dim 0 == batch_size ({B})")
    max_blocks = bt.shape[1]
    if max_blocks < 1:
        raise fail("block_table", f"shape {_dims(bt.shape)}", "at least one column (max_blocks_per_sequence >= 1)")

    # Rotary
    cos, sin = get("cos_cache"), get("sin_cache")
    if (cos is None) != (sin is None):
        present, absent = ("cos_cache", "sin_cache") if sin is None else ("sin_cache", "cos_cache")
        raise fail(absent, "None (absent)", f"present because {present} is present (both or neither)")
    rotary_dim = rotary_max_pos = 0
    if a.do_rotary:
        if cos is None:
            raise fail("cos_cache", "None (absent)", "cos_cache and sin_cache because do_rotary=1")
        _check_rank(cos, "cos_cache", 2, "(max_position, rotary_dim/2)")
        _check_dtype(cos, "cos_cache", T, "same as query")
        _check_shape(sin, "sin_cache", tuple(cos.shape), "(same as cos_cache)")
        _check_dtype(sin, "sin_cache", T, "same as query")
        rotary_max_pos, half = cos.shape
        rotary_dim = 2 * half
        if half < 1:
            raise fail("cos_cache", f"shape {_dims(cos.shape)}", "dim 1 >= 1 (rotary_dim = 2 * cos_cache.shape[1])")
        if a.rotary_offset + rotary_dim > D:
            raise fail("rotary_offset", a.rotary_offset,
                       f"rotary_offset + rotary_dim ({rotary_dim} = 2*cos_cache.shape[1]) <= head_size ({D})")
    elif cos is not None:
        raise fail("cos_cache", "an array", "absent because do_rotary=0 (an input is never silently ignored)")

    def vector(name, length, dtype, what):
        info = get(name)
        if info is None:
            return False
        _check_shape(info, name, (length,), what)
        _check_dtype(info, name, dtype, "same as query" if dtype == T else "no silent casts of index inputs")
        return True

    has_slot = vector("slot_mapping", N, "int32", "(token_count,)")
    has_qpos = vector("query_positions", N, "int32", "(token_count,)")
    has_sink = vector("head_sink", H, T, "(num_heads,)")
    qn, kn = get("q_norm_weight"), get("k_norm_weight")
    if (qn is None) != (kn is None):
        present, absent = ("q_norm_weight", "k_norm_weight") if kn is None else ("k_norm_weight", "q_norm_weight")
        raise fail(absent, "None (absent)", f"present because {present} is present (QK-norm weights come together)")
    has_norm = qn is not None
    if has_norm:
        vector("q_norm_weight", D, T, "(head_size,)")
        vector("k_norm_weight", D, T, "(head_size,)")
    if latent and has_sink:
        raise fail("head_sink", "an array", "absent in LATENT layout (MLA has no attention sinks)")
    if latent and has_norm:
        raise fail("q_norm_weight", "an array", "absent in LATENT layout (MLA + QK-norm is not defined)")

    bias = get("attention_bias")
    bias_shape = ()
    if bias is not None:
        _check_rank(bias, "attention_bias", 4, "(batch_size or 1, num_heads or 1, q_capacity, kv_capacity)")
        _check_dtype(bias, "attention_bias", T, "same as query")
        bias_shape = tuple(bias.shape)
        bb, bh, bq, bk = bias_shape
        if bb != 1 and bb != B:
            raise fail("attention_bias", f"shape {_dims(bias_shape)}", f"dim 0 of 1 or batch_size ({B})")
        if bh != 1 and bh != H:
            raise fail("attention_bias", f"shape {_dims(bias_shape)}", f"dim 1 of 1 or num_heads ({H})")
        if bq < 1 or bk < 1:
            raise fail("attention_bias", f"shape {_dims(bias_shape)}", "q_capacity >= 1 and kv_capacity >= 1")

    # Replay-wide bounds (contract §4.5): size launches only, clamped to the static capacities.
    static_cap = max_blocks * block_size
    md = tuple(metadata) if metadata is not None else None
    max_q = min(md[0], N) if md and md[0] else N
    max_kv = min(md[1], static_cap) if md and md[1] else static_cap
    min_kv = min(md[2], max_kv) if md and len(md) > 2 else 0

    if a.qk_output and N * H * max_kv * 4 > output_qk_max_bytes:
        raise fail("qk_output", a.qk_output,
                   f"an output_qk of at most {output_qk_max_bytes} bytes (num_heads*token_count*kv_capacity = "
                   f"{H}*{N}*{max_kv} float32 = {N * H * max_kv * 4} bytes); give a smaller attention_metadata "
                   "max_kv_len_bound or raise cupa.Options(output_qk_max_bytes=...)")

    return Problem(
        attrs=a, token_count=N, batch_size=B, num_heads=H, kv_num_heads=Hk, head_size=D, v_head_size=Dv,
        group_size=H // Hk, packed_qkv=packed, latent=latent, dtype=T, cache_array_dtype=cdt,
        cache_kind=cache_kind, v_cache_kind=v_cache_kind, fp8_as_bytes=fp8_as_bytes, v_quant=a.k_quant_type if latent else a.v_quant_type, num_blocks=num_blocks, block_size=block_size,
        max_blocks_per_seq=max_blocks, scale=a.scale if a.scale else 1.0 / math.sqrt(D),
        rotary_dim=rotary_dim, rotary_max_pos=rotary_max_pos, has_slot_mapping=has_slot,
        has_head_sink=has_sink, has_qk_norm=has_norm, has_query_positions=has_qpos,
        has_bias=bias is not None, bias_shape=bias_shape, has_metadata=md is not None,
        max_query_len_bound=max_q, max_kv_len_bound=max_kv, max_kv_len_lower_bound=min_kv,
    )


def _first_bad(name: str, values: np.ndarray, bad: np.ndarray, expected: str):
    """The PagedAttentionError for the first True entry of ``bad`` (an index of ``values``)."""
    index = tuple(int(i) for i in np.argwhere(bad)[0])
    where = str(index[0]) if len(index) == 1 else str(index)
    return fail(name, f"{values[index]} at index {where}", expected)


def validate_data(problem: Problem, arrays: Mapping[str, Optional[np.ndarray]]) -> None:
    """Check the values of the index inputs and scales on the host (``cupa.Options(validate_data=True)``).

    Each rule below is data a kernel handles with one defined, memory-safe outcome (contract §4.4:
    masked, skipped or zero output) but that a well-formed call never holds, so a check that costs one
    pass over small host arrays turns a silent wrong answer into an error. ``arrays`` maps input names
    to NumPy arrays (host copies of the inputs; absent inputs missing or None), shaped as ``problem``
    says (:func:`validate` has checked the shapes and dtypes).

    - cumulative_sequence_length: starts at 0, never decreases, ends at token_count;
    - past_seqlens: >= 0, and kv_len = past_seqlens[b] + new tokens within the block table's
      capacity (block_table.shape[1] * block_size);
    - block_table: -1 (unmapped) or a block id in [0, num_blocks);
    - slot_mapping: -1 (skip) or a slot in [0, num_blocks * block_size);
    - query_positions: >= 0, and < cos_cache.shape[0] with do_rotary=1 (so are derived positions);
    - k_scale, v_scale: positive and finite (:func:`cupa.helpers.check_scale`).

    Raises
    ------
    PagedAttentionError
        For the first rule broken, naming the input and the index of the first bad entry.
    """
    from .helpers import check_scale

    N, B, NB, bs = problem.token_count, problem.batch_size, problem.num_blocks, problem.block_size
    cum = np.asarray(arrays["cumulative_sequence_length"]).astype(np.int64)
    if cum[0] != 0:
        raise _first_bad("cumulative_sequence_length", cum, np.arange(B + 1) == 0, "cum[0] == 0")
    step = np.diff(cum)
    if (step < 0).any():
        raise _first_bad("cumulative_sequence_length", cum, np.append(False, step < 0),
                         "non-decreasing entries (cum[b+1] >= cum[b]: sequence b owns tokens [cum[b], cum[b+1]))")
    if cum[B] != N:
        raise _first_bad("cumulative_sequence_length", cum, np.arange(B + 1) == B,
                         f"cum[batch_size] == token_count ({N}): every token belongs to a sequence")
    past = np.asarray(arrays["past_seqlens"]).astype(np.int64)
    if (past < 0).any():
        raise _first_bad("past_seqlens", past, past < 0, "entries >= 0 (tokens already cached)")
    kv_len = past + step
    capacity = problem.static_kv_capacity
    if (kv_len > capacity).any():
        raise _first_bad("past_seqlens", past, kv_len > capacity,
                         f"past_seqlens[b] + new tokens (kv_len) <= the block table's capacity "
                         f"{problem.max_blocks_per_seq}*{bs} = {capacity}")
    block_table = np.asarray(arrays["block_table"])
    bad = (block_table < -1) | (block_table >= NB)
    if bad.any():
        raise _first_bad("block_table", block_table, bad, f"-1 (unmapped) or a block id in [0, {NB})")
    if problem.has_slot_mapping:
        slots = np.asarray(arrays["slot_mapping"])
        bad = (slots < -1) | (slots >= NB * bs)
        if bad.any():
            raise _first_bad("slot_mapping", slots, bad, f"-1 (no write) or a slot in [0, {NB * bs}) "
                             f"(num_blocks*block_size = {NB}*{bs})")
    if problem.has_query_positions:
        positions = np.asarray(arrays["query_positions"])
        if (positions < 0).any():
            raise _first_bad("query_positions", positions, positions < 0, "positions >= 0")
    if problem.attrs.do_rotary:
        rows = problem.rotary_max_pos
        expected = f"positions < cos_cache.shape[0] ({rows}) with do_rotary=1"
        if problem.has_query_positions:
            if (positions >= rows).any():
                raise _first_bad("query_positions", positions, positions >= rows, expected)
        else:                                   # the last new token of sequence b sits at kv_len - 1
            bad = (kv_len > rows) & (step > 0)
            if bad.any():
                raise _first_bad("past_seqlens", past, bad,
                                 expected + ": a sequence's new tokens sit at positions past_seqlens[b] + j")
    if problem.quantized:
        check_scale(arrays["k_scale"], "k_scale")
        if not problem.latent:
            check_scale(arrays["v_scale"], "v_scale")
