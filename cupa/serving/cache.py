"""The paged KV cache of a whole model: cache tensors per layer group slot, scales per layer.

:data:`CACHE_DTYPES` is the one table of cache element types: adding a cache type is one
:class:`CacheDType` entry, as the packed 4-bit ones are::

    "int4": CacheDType("int4", storage="uint8", quantized=True, elements_per_item=2, attribute="int4",
                       zero_byte=0x88)

Every other size (bytes per block, the last dimension of the arrays, the op attributes) is derived
from the entry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import numpy as np

from ..contract import FLOAT_TYPES, QUANT_TYPES
from ..errors import fail
from .arraylib import NUMPY_DTYPES, Library, resolve_library
from .layers import LayerKind, group_layers

__all__ = ["CacheDType", "CACHE_DTYPES", "KVCache"]

@dataclass(frozen=True)
class CacheDType:
    """One cache element type.

    Attributes
    ----------
    name : str
        The logical element type in the contract's spelling ("float16", "int8", "float8e4m3fn").
    storage : str
        NumPy dtype name of the cache array elements.
    quantized : bool
        Codes with a k_scale / v_scale (the quant types are not NONE).
    elements_per_item : int
        Logical elements per storage element (2 for a packed 4-bit type): the arrays' last
        dimension is ``head_size // elements_per_item``.
    attribute : str
        The ``k_cache_dtype`` / ``v_cache_dtype`` to pass ("" when the array dtype says it).
    bytes_attribute : str
        The attribute to pass when the array library lacks ``storage`` and the cache is held as
        ``uint8`` bytes instead (float8 on CuPy); "" when that is not allowed.
    zero_byte : int
        The storage value new caches are filled with: the code of 0.0 in every element (0, except
        int4's two codes q + 8 = 8 a byte, 0x88), so a row never written reads as zeros.
    """

    name: str
    storage: str
    quantized: bool
    elements_per_item: int = 1
    attribute: str = ""
    bytes_attribute: str = ""
    zero_byte: int = 0


CACHE_DTYPES = {
    "float16": CacheDType("float16", "float16", quantized=False),
    "bfloat16": CacheDType("bfloat16", "bfloat16", quantized=False),
    "float32": CacheDType("float32", "float32", quantized=False),
    "int8": CacheDType("int8", "int8", quantized=True),
    "float8e4m3fn": CacheDType("float8e4m3fn", "float8_e4m3fn", quantized=True, bytes_attribute="float8e4m3fn"),
    # packed two codes a byte (contract §1): element 2i in the low nibble; int4 stored as q + 8
    "int4": CacheDType("int4", "uint8", quantized=True, elements_per_item=2, attribute="int4", zero_byte=0x88),
    "float4e2m1": CacheDType("float4e2m1", "uint8", quantized=True, elements_per_item=2, attribute="float4e2m1"),
}
_ALIASES = {"float8_e4m3fn": "float8e4m3fn", "float4_e2m1fn": "float4e2m1"}


def _dtype_name(x) -> str:
    if isinstance(x, str):
        name = x
    else:
        try:
            name = np.dtype(x).name
        except TypeError:
            name = str(x).replace("torch.", "")
    return _ALIASES.get(name, name)


class KVCache:
    """Key/value caches of every layer of a model, in blocks of ``block_size`` slots.

    Layers are grouped by kind (:func:`cupa.serving.group_layers`); group ``g`` of ``G`` layers
    uses cache tensors ``0 .. G-1``, so a physical block id belongs to one group at a time and
    full-attention and window layers share one pool of ``num_blocks`` blocks.

    Parameters
    ----------
    layers : int or sequence of LayerKind
        A layer count (all full attention) or one :class:`LayerKind` per layer.
    kv_num_heads, head_size : int
        Hk and D of every layer (LATENT: Hk = 1 and D is the latent row width).
    dtype : str or dtype, default "float16"
        T, the query / key / value type (float16, bfloat16, float32).
    cache_dtype : str or dtype, optional
        An entry of :data:`CACHE_DTYPES` (default: T itself). Quantized types get per-layer
        ``k_scale`` / ``v_scale`` (float32, ones) that the caller may overwrite in place.
    k_quant_type, v_quant_type : {"PER_TENSOR", "PER_CHANNEL"}, default "PER_TENSOR"
        Granularity of the scales of a quantized cache.
    kv_cache_layout : {"SEPARATE", "LATENT"}, default "SEPARATE"
        LATENT keeps the key cache alone (absorbed MLA, no value_cache): ``kv_num_heads`` must be 1.
    v_head_size : int, default 0
        LATENT only: width of V inside the latent row (0 = head_size).
    block_size : int, default 16
    num_blocks, memory_bytes, memory_fraction : exactly one
        The block count itself; or the bytes to fill; or the fraction of the device's free memory
        to fill (CuPy or CUDA PyTorch only, e.g. 0.8).
    library : "numpy", "cupy", "torch" (or the module), default "numpy"
    device : optional
        CuPy device id or ``torch.device`` spelling ("cuda:0"); default CuPy's current device or
        PyTorch's CPU.
    group_size : int, optional
        Layers per group (default: the smallest count of layers of one kind).

    Attributes
    ----------
    groups : tuple of LayerGroup
    key_caches, value_caches : lists of arrays, one per cache tensor
        ``(num_blocks, block_size, kv_num_heads, head_size // elements_per_item)``; value_caches
        holds None in LATENT.
    k_scales, v_scales : lists of float32 arrays per layer, or None per layer when not quantized
        ``(1,)`` PER_TENSOR or ``(kv_num_heads, 1, head_size)`` PER_CHANNEL.
    """

    def __init__(self, layers: Union[int, Sequence[Optional[LayerKind]]], *, kv_num_heads: int, head_size: int,
                 dtype: Any = "float16", cache_dtype: Any = None, k_quant_type: str = "PER_TENSOR",
                 v_quant_type: str = "PER_TENSOR", kv_cache_layout: str = "SEPARATE", v_head_size: int = 0,
                 block_size: int = 16, num_blocks: Optional[int] = None, memory_bytes: Optional[int] = None,
                 memory_fraction: Optional[float] = None, library: Any = "numpy", device: Any = None,
                 group_size: Optional[int] = None):
        self.groups, self.layer_slots = group_layers(layers, group_size)
        self.num_layers = len(self.layer_slots)
        for name, v in (("kv_num_heads", kv_num_heads), ("head_size", head_size), ("block_size", block_size)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise fail(name, repr(v), "a positive int")
        self.kv_num_heads, self.head_size, self.block_size = int(kv_num_heads), int(head_size), int(block_size)
        self.dtype = _dtype_name(dtype)
        if self.dtype not in FLOAT_TYPES:
            raise fail("dtype", repr(dtype), f"one of {FLOAT_TYPES} (T)")
        cname = self.dtype if cache_dtype is None else _dtype_name(cache_dtype)
        if cname not in CACHE_DTYPES:
            raise fail("cache_dtype", repr(cache_dtype), f"one of {sorted(CACHE_DTYPES)}")
        self.cache_dtype = CACHE_DTYPES[cname]
        if not self.cache_dtype.quantized and cname != self.dtype:
            raise fail("cache_dtype", repr(cname), f"{self.dtype} (the query's dtype T) or a quantized type")
        if kv_cache_layout not in ("SEPARATE", "LATENT"):
            raise fail("kv_cache_layout", repr(kv_cache_layout), "'SEPARATE' or 'LATENT'")
        self.latent = kv_cache_layout == "LATENT"
        if self.latent and self.kv_num_heads != 1:
            raise fail("kv_num_heads", self.kv_num_heads, "1 in LATENT layout")
        if not self.latent and v_head_size not in (0, self.head_size):
            raise fail("v_head_size", v_head_size, "0 outside LATENT layout")
        self.v_head_size = int(v_head_size)
        per_item = self.cache_dtype.elements_per_item
        if self.head_size % per_item:
            raise fail("head_size", self.head_size, f"a multiple of {per_item} for cache_dtype {cname}")
        quant = self.cache_dtype.quantized
        for name, qt in (("k_quant_type", k_quant_type), ("v_quant_type", v_quant_type)):
            if qt not in QUANT_TYPES[1:]:
                raise fail(name, repr(qt), "'PER_TENSOR' or 'PER_CHANNEL' (used only by a quantized cache)")
        self.k_quant_type = k_quant_type if quant else "NONE"
        self.v_quant_type = "NONE" if (not quant or self.latent) else v_quant_type

        self.lib: Library = resolve_library(library, device)
        storage, attribute = self.cache_dtype.storage, self.cache_dtype.attribute
        if not self.lib.has_dtype(storage):
            if not self.cache_dtype.bytes_attribute:
                raise fail("cache_dtype", cname, f"a type {self.lib.name} can hold")
            storage, attribute = "uint8", self.cache_dtype.bytes_attribute
        self.storage, self.cache_dtype_attribute = storage, attribute
        self.num_tensors = max(len(g.layers) for g in self.groups)
        self.row_shape = (self.kv_num_heads, self.head_size // per_item)

        self.num_blocks = self._block_count(num_blocks, memory_bytes, memory_fraction)
        shape = (self.num_blocks, self.block_size) + self.row_shape
        fill = self.cache_dtype.zero_byte
        new = (lambda: self.lib.full(shape, fill, storage)) if fill else (lambda: self.lib.zeros(shape, storage))
        self.key_caches = [new() for _ in range(self.num_tensors)]
        self.value_caches = [None if self.latent else new() for _ in range(self.num_tensors)]
        self.k_scales = [self._scale(self.k_quant_type) for _ in range(self.num_layers)]
        self.v_scales = [self._scale(self.v_quant_type) for _ in range(self.num_layers)]

    # -- sizes ---------------------------------------------------------------------------------------
    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block id over every cache tensor (keys and values)."""
        row = int(np.prod(self.row_shape)) * np.dtype(NUMPY_DTYPES[self.storage]).itemsize
        return row * self.block_size * self.num_tensors * (1 if self.latent else 2)

    @property
    def nbytes(self) -> int:
        return self.bytes_per_block * self.num_blocks

    def _block_count(self, num_blocks, memory_bytes, memory_fraction) -> int:
        given = [n for n, v in (("num_blocks", num_blocks), ("memory_bytes", memory_bytes),
                                ("memory_fraction", memory_fraction)) if v is not None]
        if len(given) != 1:
            raise fail("num_blocks/memory_bytes/memory_fraction", f"{given or 'none'}", "exactly one of them")
        if num_blocks is not None:
            if isinstance(num_blocks, bool) or not isinstance(num_blocks, (int, np.integer)) or num_blocks < 0:
                raise fail("num_blocks", repr(num_blocks), "an int >= 0")
            return int(num_blocks)
        if memory_fraction is not None:
            if not 0.0 < float(memory_fraction) <= 1.0:
                raise fail("memory_fraction", repr(memory_fraction), "a fraction in (0, 1]")
            memory_bytes = int(self.lib.free_bytes() * float(memory_fraction))
        if isinstance(memory_bytes, bool) or not isinstance(memory_bytes, (int, np.integer)) or memory_bytes < 0:
            raise fail("memory_bytes", repr(memory_bytes), "an int >= 0")
        return int(memory_bytes) // self.bytes_per_block

    def _scale(self, quant_type: str):
        if quant_type == "NONE":
            return None
        shape = (1,) if quant_type == "PER_TENSOR" else (self.kv_num_heads, 1, self.head_size)
        return self.lib.full(shape, 1.0, "float32")

    # -- per layer -----------------------------------------------------------------------------------
    def _check_layer(self, layer: int) -> tuple:
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or not 0 <= layer < self.num_layers:
            raise fail("layer", repr(layer), f"a layer index in [0, {self.num_layers})")
        return self.layer_slots[layer]

    def group_of(self, layer: int) -> int:
        """Index of the group (and of its block table in a Step) of ``layer``."""
        return self._check_layer(layer)[0]

    def layer_arrays(self, layer: int) -> tuple:
        """``(key_cache, value_cache)`` of ``layer`` (value_cache None in LATENT)."""
        j = self._check_layer(layer)[1]
        return self.key_caches[j], self.value_caches[j]

    def attributes(self, layer: int) -> dict:
        """The op attributes the cache fixes for ``layer`` (add ``num_heads`` and the model's own).

        ``kv_num_heads``, ``local_window_size`` (window layers), the quantization and cache-dtype
        attributes, and the LATENT layout attributes.
        """
        g, _ = self._check_layer(layer)
        attrs = {"kv_num_heads": self.kv_num_heads, **self.groups[g].kind.attention_attributes()}
        if self.cache_dtype.quantized:
            attrs["k_quant_type"] = self.k_quant_type
            if self.cache_dtype_attribute:
                attrs["k_cache_dtype"] = self.cache_dtype_attribute
            if not self.latent:
                attrs["v_quant_type"] = self.v_quant_type
                if self.cache_dtype_attribute:
                    attrs["v_cache_dtype"] = self.cache_dtype_attribute
        if self.latent:
            attrs["kv_cache_layout"] = "LATENT"
            if self.v_head_size:
                attrs["v_head_size"] = self.v_head_size
        return attrs

    def layer_inputs(self, layer: int) -> dict:
        """The cache inputs of ``layer``: key_cache, value_cache, and k_scale / v_scale when quantized."""
        kc, vc = self.layer_arrays(layer)
        inputs = {"key_cache": kc, "value_cache": vc}
        if self.k_scales[layer] is not None:
            inputs["k_scale"] = self.k_scales[layer]
        if self.v_scales[layer] is not None:
            inputs["v_scale"] = self.v_scales[layer]
        return inputs

    # -- device work -----------------------------------------------------------------------------------
    def copy_blocks(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy blocks ``src[i]`` to ``dst[i]`` in every cache tensor, inside the cache's memory.

        On a GPU this is device work queued on the current stream (no host round trip, no sync).
        """
        if len(src) != len(dst):
            raise fail("dst", f"{len(dst)} blocks", f"as many blocks as src ({len(src)})")
        if not len(src):
            return
        for caches in (self.key_caches, self.value_caches):
            for c in caches:
                if c is not None:
                    self.lib.copy_blocks(c, list(src), list(dst))

    def __repr__(self) -> str:
        kinds = ", ".join(f"{len(g.layers)} x {g.kind}" for g in self.groups)
        return (f"KVCache({self.num_layers} layers in {len(self.groups)} groups [{kinds}], {self.num_blocks} blocks "
                f"of {self.block_size}, {self.cache_dtype.name} on {self.lib.name}, {self.nbytes / 2**20:.1f} MiB)")
