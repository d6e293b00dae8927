"""One benchmark case: a PagedAttention call described by its shapes, and the inputs built from it.

A :class:`Case` holds what decides a call's cost -- per-sequence new and cached token counts, heads,
head size, block size, T, the cache type and its quantization, window, sinks, whether
attention_metadata is given, the layout -- plus the case's sweep tags (what a plot groups it by).
:func:`build` turns it into the operator's inputs on NumPy or CuPy: random data (never zeros), each
sequence's blocks scattered over a shuffled pool, block tables twice as wide as the longest sequence
needs (a server sizes them for its maximum length). Every peer adapter receives the same
:class:`Built` inputs.

``kv_bytes`` counts the cache bytes a call must read (each admitted key's K and V row once; the
latent row once in LATENT); ``flops`` counts 2 multiply-adds per admitted (query, key) pair and
channel of Q.K and P.V: ``4*H*D`` per pair, ``2*H*(D + v_head_size)`` in LATENT.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Optional

import ml_dtypes
import numpy as np

__all__ = ["Case", "Built", "build", "decode", "ragged_decode", "prefill", "ragged_prefill", "chunked", "mixed",
           "mla", "admitted_pairs", "dense_kv", "raw_bits", "page_indices", "cache_positions", "DEFAULTS", "replace"]

#: Field values a case name leaves out (GQA 32/8, D=128, block 16, fp16, T cache, metadata given).
DEFAULTS = dict(num_heads=32, kv_num_heads=8, head_size=128, block_size=16, dtype="float16", cache="T",
                quant="PER_CHANNEL", window=-1, sinks=False, metadata=True, layout="SEPARATE", v_head_size=0,
                scale=0.0, is_causal=1)
_T_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
_CACHE_KINDS = ("T", "int8", "fp8", "int4", "float4e2m1")
_SHORT_DTYPE = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}


@dataclass(frozen=True)
class Case:
    """One call's shapes and options (hashable; ``tags`` group it in plots and tables).

    Attributes
    ----------
    suite, name : str
        ``suite/name`` identifies the case across runs (``--compare`` matches on it).
    q_lens, past : tuple of int
        New tokens and cached tokens per sequence (B entries each).
    num_heads, kv_num_heads, head_size, block_size : int
    dtype : {"float16", "bfloat16", "float32"}
        T.
    cache : {"T", "int8", "fp8", "int4", "float4e2m1"}
        The cache element type ("fp8": e4m3 bytes in a uint8 array; the sub-byte kinds packed two per byte).
    quant : {"PER_CHANNEL", "PER_TENSOR"}
        Scale granularity of a quantized cache.
    window : int
        local_window_size (-1: none).
    sinks : bool
        A head_sink input.
    metadata : bool
        Pass attention_metadata ([max q_len, max kv_len]).
    layout : {"SEPARATE", "LATENT"}
    v_head_size : int
        LATENT only.
    scale : float
        0: 1/sqrt(head_size).
    is_causal : int
    tags : tuple of (key, value) pairs
        ``sweep`` (the sweep the case belongs to), ``x`` (its value on that sweep's axis), ``series``
        (the line it belongs to in a plot).
    """

    suite: str
    name: str
    q_lens: tuple
    past: tuple
    num_heads: int = 32
    kv_num_heads: int = 8
    head_size: int = 128
    block_size: int = 16
    dtype: str = "float16"
    cache: str = "T"
    quant: str = "PER_CHANNEL"
    window: int = -1
    sinks: bool = False
    metadata: bool = True
    layout: str = "SEPARATE"
    v_head_size: int = 0
    scale: float = 0.0
    is_causal: int = 1
    tags: tuple = field(default=(), compare=False)

    def __post_init__(self):
        if len(self.q_lens) != len(self.past) or not self.q_lens:
            raise ValueError(f"{self.name}: q_lens and past need one entry per sequence")
        if self.cache not in _CACHE_KINDS:
            raise ValueError(f"{self.name}: cache {self.cache!r} is not one of {_CACHE_KINDS}")

    # -- derived sizes -----------------------------------------------------------------------------
    @property
    def id(self) -> str:
        return f"{self.suite}/{self.name}"

    @property
    def tag(self) -> dict:
        return dict(self.tags)

    @property
    def batch_size(self) -> int:
        return len(self.q_lens)

    @property
    def token_count(self) -> int:
        return int(sum(self.q_lens))

    @property
    def kv_lens(self) -> np.ndarray:
        return np.asarray(self.past, dtype=np.int64) + np.asarray(self.q_lens, dtype=np.int64)

    @property
    def uniform(self) -> bool:
        """Every sequence has the same q_len and the same past."""
        return len(set(self.q_lens)) == 1 and len(set(self.past)) == 1

    @property
    def latent(self) -> bool:
        return self.layout == "LATENT"

    @property
    def out_head_size(self) -> int:
        return self.v_head_size if self.latent and self.v_head_size else self.head_size

    @property
    def quantized(self) -> bool:
        return self.cache != "T"

    @property
    def cache_element_bytes(self) -> float:
        if self.cache == "T":
            return _T_BYTES[self.dtype]
        return 0.5 if self.cache in ("int4", "float4e2m1") else 1

    @property
    def softmax_scale(self) -> float:
        return self.scale if self.scale else 1.0 / math.sqrt(self.head_size)

    def attributes(self) -> dict:
        """The operator's attributes (ONNX names) for this case; defaults left out."""
        a = {"num_heads": self.num_heads, "kv_num_heads": self.kv_num_heads}
        if self.window > 0:
            a["local_window_size"] = self.window
        if self.is_causal != 1:
            a["is_causal"] = self.is_causal
        if self.scale:
            a["scale"] = self.scale
        if self.latent:
            a["kv_cache_layout"] = "LATENT"
            if self.v_head_size:
                a["v_head_size"] = self.v_head_size
        if self.quantized:
            a["k_quant_type"] = a["v_quant_type"] = self.quant
            if self.cache in ("fp8", "int4", "float4e2m1"):
                a["k_cache_dtype"] = "float8e4m3fn" if self.cache == "fp8" else self.cache
                if not self.latent:
                    a["v_cache_dtype"] = a["k_cache_dtype"]
        if self.latent:
            a.pop("v_quant_type", None)
        return a

    def kv_bytes(self) -> int:
        """Cache bytes the call must read: each key any of a sequence's tokens admits, K and V rows once."""
        keys = 0
        for q, p in zip(self.q_lens, self.past):
            kv = p + q
            first = 0 if self.window <= 0 else max(0, p - self.window + 1)   # the first token's window
            keys += kv - first
        rows = 1 if self.latent else 2
        return int(keys * rows * self.kv_num_heads * self.head_size * self.cache_element_bytes)

    def flops(self) -> float:
        per_pair = (2.0 * self.num_heads * (self.head_size + self.out_head_size) if self.latent
                    else 4.0 * self.num_heads * self.head_size)
        return per_pair * admitted_pairs(self.q_lens, self.past, self.window, self.is_causal)

    def params(self) -> dict:
        """The case's parameters for the JSON record (per-sequence lists summarized when ragged)."""
        d = {"B": self.batch_size, "tokens": self.token_count}
        for key, values in (("q_len", self.q_lens), ("past", self.past)):
            if len(set(values)) == 1:
                d[key] = int(values[0])
            else:
                d[key] = {"min": int(min(values)), "mean": float(np.mean(values)), "max": int(max(values))}
        for f in ("num_heads", "kv_num_heads", "head_size", "block_size", "dtype", "cache", "window", "sinks",
                  "metadata", "layout"):
            d[f] = getattr(self, f)
        if self.quantized:
            d["quant"] = self.quant
        if self.latent:
            d["v_head_size"] = self.out_head_size
            d["scale"] = self.softmax_scale
        return d


def admitted_pairs(q_lens, past, window: int = -1, is_causal: int = 1) -> int:
    """Number of (query token, key) pairs the causal / window mask admits, summed over sequences."""
    total = 0
    for q, p in zip(q_lens, past):
        if q == 0:
            continue
        pos = p + np.arange(q, dtype=np.int64)          # each token's position
        hi = pos + 1 if is_causal else np.full(q, p + q, dtype=np.int64)
        lo = np.zeros(q, dtype=np.int64) if window <= 0 else np.maximum(0, pos - window + 1)
        total += int(np.maximum(hi - lo, 0).sum())
    return total


# -- constructors ----------------------------------------------------------------------------------

def _suffix(**kw) -> str:
    """The parts of a case name for fields that differ from :data:`DEFAULTS`."""
    parts = []
    H, Hk = kw.get("num_heads", 32), kw.get("kv_num_heads", 8)
    if (H, Hk) != (32, 8):
        parts.append(f"H/Hk={H}/{Hk}")
    if kw.get("head_size", 128) != 128:
        parts.append(f"D={kw['head_size']}")
    if kw.get("block_size", 16) != 16:
        parts.append(f"bs={kw['block_size']}")
    if kw.get("dtype", "float16") != "float16":
        parts.append(_SHORT_DTYPE[kw["dtype"]])
    if kw.get("cache", "T") != "T":
        parts.append(f"{kw['cache']}/{kw.get('quant', 'PER_CHANNEL').lower().replace('_', '-')}")
    if kw.get("window", -1) > 0:
        parts.append(f"window={kw['window']}")
    if kw.get("sinks"):
        parts.append("sinks")
    if not kw.get("metadata", True):
        parts.append("no-metadata")
    return (" " + " ".join(parts)) if parts else ""


def _tags(tags) -> tuple:
    return tuple(sorted((tags or {}).items()))


def decode(B: int, L: int, suite: str = "decode", tags: Optional[dict] = None, **kw) -> Case:
    """B sequences, each with one new token after L-1 cached ones (kv_len L)."""
    return Case(suite, f"B={B} L={L}{_suffix(**kw)}", (1,) * B, (L - 1,) * B, tags=_tags(tags), **kw)


def ragged_decode(kv_lens, label: str, suite: str = "decode", tags: Optional[dict] = None, **kw) -> Case:
    """One new token per sequence with the given (ragged) kv lengths."""
    kv_lens = [int(x) for x in kv_lens]
    return Case(suite, f"B={len(kv_lens)} L~{label}{_suffix(**kw)}", (1,) * len(kv_lens),
                tuple(x - 1 for x in kv_lens), tags=_tags(tags), **kw)


def prefill(B: int, L: int, suite: str = "prefill", tags: Optional[dict] = None, **kw) -> Case:
    """B sequences of L new tokens each, nothing cached (causal prefill)."""
    return Case(suite, f"B={B} q={L}{_suffix(**kw)}", (L,) * B, (0,) * B, tags=_tags(tags), **kw)


def ragged_prefill(q_lens, label: str, suite: str = "prefill", tags: Optional[dict] = None, **kw) -> Case:
    q_lens = tuple(int(x) for x in q_lens)
    return Case(suite, f"B={len(q_lens)} q~{label}{_suffix(**kw)}", q_lens, (0,) * len(q_lens), tags=_tags(tags),
                **kw)


def chunked(B: int, past: int, chunk: int, suite: str = "chunked", tags: Optional[dict] = None, **kw) -> Case:
    """B sequences each adding a chunk of new tokens after ``past`` cached ones."""
    return Case(suite, f"B={B} past={past} q={chunk}{_suffix(**kw)}", (chunk,) * B, (past,) * B,
                tags=_tags(tags), **kw)


def mixed(decodes: int, decode_len: int, prefills, suite: str = "mixed", tags: Optional[dict] = None,
          **kw) -> Case:
    """One batch of ``decodes`` decode sequences at kv_len ``decode_len`` followed by prefill chunks
    ``prefills`` = [(q_len, past), ...] (what a continuous-batching step sends)."""
    q_lens = (1,) * decodes + tuple(q for q, _ in prefills)
    past = (decode_len - 1,) * decodes + tuple(p for _, p in prefills)
    chunks = "+".join(f"{q}@{p}" for q, p in prefills)
    return Case(suite, f"decode {decodes}x{decode_len} + prefill {chunks}{_suffix(**kw)}", q_lens, past,
                tags=_tags(tags), **kw)


def mla(B: int, L: int, num_heads: int = 128, q_len: int = 1, block_size: int = 64, suite: str = "mla",
        tags: Optional[dict] = None, **kw) -> Case:
    """Absorbed MLA (DeepSeek-V3 shapes): one latent cache row of 576 channels (512 latent + 64 RoPE),
    V = its leading 512 channels, scale 1/sqrt(192) (the pre-absorption head width)."""
    kw.setdefault("head_size", 576)
    kw.setdefault("v_head_size", 512)
    kw.setdefault("scale", 1.0 / math.sqrt(192))
    name = f"B={B} L={L} H={num_heads}" + ("" if q_len == 1 else f" q={q_len}") + (
        "" if block_size == 64 else f" bs={block_size}")
    extra = _suffix(**{k: v for k, v in kw.items() if k not in ("head_size", "v_head_size", "scale")})
    return Case(suite, name + extra, (q_len,) * B, (L - q_len,) * B, num_heads=num_heads, kv_num_heads=1,
                block_size=block_size, layout="LATENT", tags=_tags(tags), **kw)


# -- inputs ----------------------------------------------------------------------------------------

@dataclass
class Built:
    """A case's operator inputs, on NumPy or CuPy.

    Attributes
    ----------
    case : Case
    inputs : dict
        ONNX input name -> array or None (attention_metadata: a host int32 array or None).
    attributes : dict
        The operator's attributes (:meth:`Case.attributes`).
    block_table : np.ndarray
        Host copy of the block table (B, max_blocks) int32.
    kv_lens, q_lens, past : np.ndarray
        Host int64 arrays, per sequence.
    """

    case: Case
    inputs: dict
    attributes: dict
    block_table: np.ndarray
    kv_lens: np.ndarray
    q_lens: np.ndarray
    past: np.ndarray

    def call_inputs(self) -> dict:
        """The inputs that are present, as keyword arguments for the operator."""
        return {k: v for k, v in self.inputs.items() if v is not None}

    @property
    def cu_seqlens(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.q_lens)]).astype(np.int32)


def _host_normal(rng: np.random.Generator, shape, dtype: str) -> np.ndarray:
    x = rng.standard_normal(shape, dtype=np.float32)
    return x.astype(ml_dtypes.bfloat16) if dtype == "bfloat16" else x.astype(np.dtype(dtype))


def _normal(xp, rng: np.random.Generator, shape, dtype: str):
    """Random normal values of T on ``xp``: on the device by CuPy's generator (bfloat16 from host data)."""
    if xp is np or dtype == "bfloat16":
        return xp.asarray(_host_normal(rng, shape, dtype))
    rs = xp.random.RandomState(int(rng.integers(1 << 31)))
    return rs.standard_normal(shape, dtype=np.float32).astype(dtype)


def _codes(xp, rng: np.random.Generator, shape, cache: str):
    """Random cache codes: int8 in [-127, 127]; e4m3 bytes without the NaN codes 0x7F / 0xFF; packed
    sub-byte bytes (every nibble is a valid int4 / e2m1 code)."""
    if xp is np:
        if cache == "int8":
            return rng.integers(-127, 128, size=shape, dtype=np.int8)
        if cache == "fp8":
            return (rng.integers(0, 0x7F, size=shape, dtype=np.uint8)
                    | (rng.integers(0, 2, size=shape, dtype=np.uint8) << 7)).astype(np.uint8)
        return rng.integers(0, 256, size=shape, dtype=np.uint8)
    rs = xp.random.RandomState(int(rng.integers(1 << 31)))
    if cache == "int8":
        return rs.randint(-127, 128, size=shape, dtype=np.int32).astype(np.int8)
    if cache == "fp8":
        mag = rs.randint(0, 0x7F, size=shape, dtype=np.int32).astype(np.uint8)
        return mag | (rs.randint(0, 2, size=shape, dtype=np.int32).astype(np.uint8) << 7)
    return rs.randint(0, 256, size=shape, dtype=np.int32).astype(np.uint8)


def _code_max(cache: str) -> float:
    return {"int8": 127.0, "fp8": 448.0, "int4": 7.0, "float4e2m1": 6.0}[cache]


def build(case: Case, xp=np, seed: int = 0) -> Built:
    """The operator's inputs for ``case`` on ``xp`` (NumPy or CuPy), from a generator seeded by ``seed``."""
    rng = np.random.default_rng(seed)
    B, bs = case.batch_size, case.block_size
    H, Hk, D = case.num_heads, case.kv_num_heads, case.head_size
    q_lens = np.asarray(case.q_lens, dtype=np.int64)
    past = np.asarray(case.past, dtype=np.int64)
    kv_lens = q_lens + past
    blocks = -(-kv_lens // bs)
    num_blocks = int(blocks.sum())
    width = max(1, 2 * int(blocks.max()))
    perm = rng.permutation(num_blocks).astype(np.int32)
    block_table = np.full((B, width), -1, dtype=np.int32)
    starts = np.concatenate([[0], np.cumsum(blocks)])
    for b in range(B):
        block_table[b, :blocks[b]] = perm[starts[b]:starts[b + 1]]

    cache_d = D // 2 if case.cache in ("int4", "float4e2m1") else D
    cache_shape = (num_blocks, bs, Hk, cache_d)
    if case.quantized:
        key_cache = _codes(xp, rng, cache_shape, case.cache)
        value_cache = None if case.latent else _codes(xp, rng, cache_shape, case.cache)
    else:
        key_cache = _normal(xp, rng, cache_shape, case.dtype)
        value_cache = None if case.latent else _normal(xp, rng, cache_shape, case.dtype)
    N = int(q_lens.sum())
    inputs = dict.fromkeys(("query", "key", "value", "key_cache", "value_cache", "cumulative_sequence_length",
                            "past_seqlens", "block_table", "cos_cache", "sin_cache", "slot_mapping", "head_sink",
                            "q_norm_weight", "k_norm_weight", "k_scale", "v_scale", "attention_metadata"))
    inputs.update(
        query=_normal(xp, rng, (N, H * D), case.dtype),
        key=_normal(xp, rng, (N, Hk * D), case.dtype),
        value=None if case.latent else _normal(xp, rng, (N, Hk * D), case.dtype),
        key_cache=key_cache, value_cache=value_cache,
        cumulative_sequence_length=xp.asarray(np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)),
        past_seqlens=xp.asarray(past.astype(np.int32)), block_table=xp.asarray(block_table))
    if case.sinks:
        inputs["head_sink"] = _normal(xp, rng, (H,), case.dtype)
    if case.quantized:
        scale_shape = (Hk, 1, D) if case.quant == "PER_CHANNEL" else (1,)
        for name in ("k_scale",) if case.latent else ("k_scale", "v_scale"):
            s = rng.uniform(0.5, 1.5, size=scale_shape) * 3.0 / _code_max(case.cache)
            inputs[name] = xp.asarray(s.astype(np.float32))
    if case.metadata:
        inputs["attention_metadata"] = np.array([int(q_lens.max()), int(kv_lens.max())], dtype=np.int32)
    return Built(case, inputs, case.attributes(), block_table, kv_lens, q_lens, past)


# -- index helpers the peer adapters share ---------------------------------------------------------

def cache_positions(block_table: np.ndarray, kv_len: int, block_size: int, b: int) -> np.ndarray:
    """Flat cache rows (block * block_size + offset) of sequence ``b``'s positions [0, kv_len)."""
    pos = np.arange(kv_len, dtype=np.int64)
    return block_table[b, pos // block_size].astype(np.int64) * block_size + pos % block_size


def raw_bits(x):
    """A same-shape unsigned-integer view of ``x`` (gathers and transposes then copy bits, whatever T is)."""
    return x.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[np.dtype(x.dtype).itemsize])


def dense_kv(cache, block_table: np.ndarray, kv_len: int, block_size: int, xp=np):
    """(B, Hk, kv_len, D) dense copy of a paged cache's first ``kv_len`` positions of every sequence
    (what torch SDPA reads): the rows gathered through the block table, head-major."""
    nb, bs, hk, d = cache.shape
    flat = raw_bits(cache).reshape(nb * bs, hk, d)
    rows = np.stack([cache_positions(block_table, kv_len, block_size, b) for b in range(block_table.shape[0])])
    gathered = flat[xp.asarray(rows.reshape(-1))].reshape(block_table.shape[0], kv_len, hk, d)
    return xp.ascontiguousarray(gathered.transpose(0, 2, 1, 3)).view(cache.dtype)


def page_indices(block_table: np.ndarray, kv_lens, block_size: int):
    """FlashInfer's page table of the same cache: ``(indptr (B+1,), indices (sum pages,), last_page_len (B,))``
    int32 -- sequence b's pages are ``indices[indptr[b]:indptr[b+1]]``, the first ceil(kv_len/block_size)
    entries of its block-table row, and its last page holds ``last_page_len[b]`` rows (1..block_size)."""
    kv_lens = np.asarray(kv_lens, dtype=np.int64)
    pages = -(-kv_lens // block_size)
    indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    indices = np.concatenate([block_table[b, :pages[b]] for b in range(len(kv_lens))]).astype(np.int32)
    last = (kv_lens - (pages - 1) * block_size).astype(np.int32)
    return indptr, indices, last
