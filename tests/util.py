"""Shared test utilities: random paged problems and an independent brute-force dense attention.

* :func:`make_case` builds a random paged PagedAttention call (:class:`Case`): fresh random data
  from the given ``np.random.Generator`` (never zeros), shuffled block tables, ragged query lengths
  (zero-token sequences allowed), garbage in every unused cache block, and options for every feature
  of contract §1-§4. GPU tests convert ``case.inputs`` with :meth:`Case.converted`.
* :func:`dense_attention` is a plain per-token float64 implementation of the contract written
  independently of ``cupa/reference.py`` (loops, small sizes only). It returns the expected output,
  output_qk, lse and the caches after the call, and which cache slots each token wrote and admitted.
* :func:`rel_err`, :func:`assert_rel`, :func:`assert_within_ulp`, :func:`assert_cache_close` compare
  results with the tolerances of contract §6.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Optional

import ml_dtypes
import numpy as np

import cupa
from cupa.contract import INPUT_NAMES

T_DTYPES = {"float16": np.dtype(np.float16), "bfloat16": np.dtype(ml_dtypes.bfloat16),
            "float32": np.dtype(np.float32)}
F8 = np.dtype(ml_dtypes.float8_e4m3fn)
#: contract §6: ||out - ref|| / ||ref|| for CUDA backends against the reference
from cupa.contract import TOLERANCE as REL_TOL  # noqa: E402  (the one tolerance table, contract §6)
#: mantissa bits and minimum normal exponent of each T (for ulp bounds)
_MANT = {"float16": (10, -14), "bfloat16": (7, -126), "float32": (23, -126)}
#: cache kinds accepted by make_case ("int4" / "fp4": packed two codes a byte in uint8 caches)
CACHE_KINDS = ("T", "int8", "fp8", "fp8_bytes", "int4", "fp4")
#: k/v_cache_dtype of the kinds held in uint8 arrays
BYTE_KINDS = {"fp8_bytes": "float8e4m3fn", "int4": "int4", "fp4": "float4e2m1"}
#: the largest code of each quantized kind (what make_case sizes its scales by)
QMAX = {"int8": 127, "fp8": 448, "fp8_bytes": 448, "int4": 7, "fp4": 6}


# ------------------------------------------------------------------------------------------------
# problem builder

@dataclass
class Case:
    """One PagedAttention call: ``inputs`` (every name of INPUT_NAMES, None when absent) + ``attrs``."""

    inputs: dict
    attrs: dict
    q_lens: np.ndarray = None
    past: np.ndarray = None
    info: dict = field(default_factory=dict)

    @property
    def dtype(self) -> str:
        return np.dtype(self.inputs["query"].dtype).name

    @property
    def token_count(self) -> int:
        return int(self.inputs["query"].shape[0])

    def kwargs(self) -> dict:
        kw = {n: v for n, v in self.inputs.items() if v is not None}
        kw.update(self.attrs)
        return kw

    def copy(self) -> "Case":
        return Case({n: (None if v is None else np.array(v, copy=True)) for n, v in self.inputs.items()},
                    dict(self.attrs), None if self.q_lens is None else self.q_lens.copy(),
                    None if self.past is None else self.past.copy(), copy.deepcopy(self.info))

    def run(self, **extra):
        """Run cupa.paged_attention on these inputs (the caches of this case are updated)."""
        kw = self.kwargs()
        kw.update(extra)
        return cupa.paged_attention(**kw)

    def converted(self, fn) -> dict:
        """``inputs`` with ``fn`` applied to every array (e.g. ``cupy.asarray``); metadata stays on the host."""
        return {n: (v if v is None or n == "attention_metadata" else fn(v)) for n, v in self.inputs.items()}


def random_lengths(rng, batch, max_q=6, max_past=40, zero_q=0.25):
    """Ragged (q_lens, past) with some zero-token sequences."""
    q = rng.integers(1, max_q + 1, size=batch)
    q[rng.random(batch) < zero_q] = 0
    past = rng.integers(0, max_past + 1, size=batch)
    return q.astype(np.int64), past.astype(np.int64)


def _rand_T(rng, shape, T, scale=1.0):
    x = rng.standard_normal(shape) * scale
    x[x == 0] = 0.5  # never zeros
    return x.astype(T)


def _random_cache(rng, shape, kind, T, qmax):
    """Garbage-filled cache of the requested kind (random values, never all zero; packed kinds: random
    bytes, last dimension halved, every nibble a valid code)."""
    if kind == "T":
        return _rand_T(rng, shape, T)
    if kind in ("int4", "fp4"):
        return rng.integers(1, 256, size=shape[:-1] + (shape[-1] // 2,)).astype(np.uint8)
    if kind == "int8":
        c = rng.integers(-qmax, qmax + 1, size=shape).astype(np.int8)
        c[c == 0] = 1
        return c
    vals = np.clip(rng.standard_normal(shape) * (qmax / 3.0), -448, 448).astype(np.float32)
    codes = vals.astype(F8)
    return codes.view(np.uint8).copy() if kind == "fp8_bytes" else codes


def make_case(rng, *, num_heads=4, kv_num_heads=2, head_size=64, block_size=16,
              q_lens=(3, 0, 5, 1), past=(7, 4, 0, 18), dtype="float16",
              cache="T", k_quant="PER_TENSOR", v_quant="PER_TENSOR",
              packed=False, rotary=None, rotary_dim=None, rotary_offset=0, max_position=None,
              positions=None, qk_norm=False, window=-1, softcap=0.0, sink=False, is_causal=1,
              scale=0.0, bias=None, bias_pad=(0, 0), qk_output=0, slot_mapping=None,
              metadata=None, shuffle=True, extra_blocks=3, extra_cols=1, unused_cols="garbage",
              latent=False, v_head_size=0, value_scale=1.0, v_cache=None):
    """Build a random paged call.

    Parameters (all keyword)
    ------------------------
    q_lens, past : per-sequence new-token counts and cached lengths (ragged; zeros allowed).
    dtype : T ("float16", "bfloat16", "float32").
    cache : "T", "int8", "fp8" (ml_dtypes float8_e4m3fn arrays), "fp8_bytes" (uint8 + k/v_cache_dtype), or
        "int4" / "fp4" (packed two codes a byte in uint8 arrays of last dimension head_size / 2).
    v_cache : value_cache's kind when it differs from ``cache`` (both of the uint8 kinds: "fp8_bytes",
        "int4", "fp4").
    k_quant, v_quant : "PER_TENSOR" or "PER_CHANNEL" (quantized caches only).
    packed : packed QKV in ``query``.
    rotary : None, "half" or "interleaved"; rotary_dim (default head_size - rotary_offset); rotary_offset.
    positions : None (default positions), "explicit" (query_positions equal to the default),
        "random" (random positions in [0, kv_len_b)), or an int array of length N.
    qk_norm, window, softcap, sink, is_causal, scale, qk_output : the features of contract §3.
    bias : None or (batch_broadcast, head_broadcast); bias_pad adds (q, kv) capacity beyond the maxima
        (negative values make an undersized bias whose out-of-capacity entries are masked).
    slot_mapping : None, "derived" (explicit and equal to the derived slots) or "skip" (derived with
        some -1 entries).
    metadata : None, "tight", "loose" or a tuple.
    shuffle : shuffle the physical blocks. extra_blocks: spare garbage blocks. extra_cols: extra
        block_table columns, filled with -1 ("neg") or other block ids ("garbage") like unused entries.
    latent, v_head_size : LATENT (MLA) layout: key is (N, head_size), one cache, kv_num_heads 1.
    """
    T = T_DTYPES[dtype]
    H, Hk, D, bs = num_heads, kv_num_heads, head_size, block_size
    if latent:
        Hk = 1
    q_lens = np.asarray(q_lens, dtype=np.int64)
    past = np.asarray(past, dtype=np.int64)
    B = q_lens.size
    N = int(q_lens.sum())
    kv_len = past + q_lens
    cum = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)

    # block allocation: ceil(kv_len/bs) blocks per sequence, shuffled physical ids
    need = [max(1, -(-int(L) // bs)) for L in kv_len]
    MB = max(need) + extra_cols
    NB = sum(need) + extra_blocks
    phys = rng.permutation(NB) if shuffle else np.arange(NB)
    bt = np.full((B, MB), -1, dtype=np.int32)
    used = 0
    for b in range(B):
        bt[b, :need[b]] = phys[used:used + need[b]]
        used += need[b]
        if unused_cols == "garbage":
            bt[b, need[b]:] = rng.integers(0, NB, size=MB - need[b])

    quant = cache != "T"
    v_cache = cache if v_cache is None or latent else v_cache
    cache_shape = (NB, bs, Hk, D)
    key_cache = _random_cache(rng, cache_shape, cache, T, QMAX.get(cache))
    value_cache = None if latent else _random_cache(rng, cache_shape, v_cache, T, QMAX.get(v_cache))

    attrs = dict(num_heads=H, kv_num_heads=Hk)
    inputs = dict.fromkeys(INPUT_NAMES)
    q = _rand_T(rng, (N, H * D), T)
    k = _rand_T(rng, (N, D) if latent else (N, Hk * D), T)
    v = None if latent else _rand_T(rng, (N, Hk * D), T, value_scale)
    if packed:
        inputs["query"] = np.ascontiguousarray(np.concatenate([q, k, v], axis=1))
    else:
        inputs["query"], inputs["key"], inputs["value"] = q, k, v
    inputs.update(key_cache=key_cache, value_cache=value_cache, cumulative_sequence_length=cum,
                  past_seqlens=past.astype(np.int32), block_table=bt)

    # positions
    default_pos = np.concatenate([past[b] + np.arange(q_lens[b]) for b in range(B)]).astype(np.int64) \
        if N else np.zeros(0, dtype=np.int64)
    if positions is None:
        pos = default_pos
    elif isinstance(positions, str) and positions == "explicit":
        pos = default_pos
        inputs["query_positions"] = pos.astype(np.int32)
    elif isinstance(positions, str) and positions == "random":
        owner = np.repeat(np.arange(B), q_lens)
        pos = np.array([rng.integers(0, max(1, kv_len[b])) for b in owner], dtype=np.int64)
        inputs["query_positions"] = pos.astype(np.int32)
    else:
        pos = np.asarray(positions, dtype=np.int64)
        inputs["query_positions"] = pos.astype(np.int32)

    if rotary is not None:
        rd = rotary_dim if rotary_dim is not None else D - rotary_offset
        mp = max_position if max_position is not None else int(max(kv_len.max(), pos.max() + 1 if N else 1)) + 5
        cos, sin = cupa.rope_cache(mp, rd, base=float(rng.choice([100.0, 10000.0])), dtype=T)
        inputs["cos_cache"], inputs["sin_cache"] = cos, sin
        attrs.update(do_rotary=1, rotary_interleaved=int(rotary == "interleaved"), rotary_offset=rotary_offset)
    if qk_norm:
        inputs["q_norm_weight"] = rng.uniform(0.5, 1.5, D).astype(T)
        inputs["k_norm_weight"] = rng.uniform(0.5, 1.5, D).astype(T)
        attrs["qk_norm_epsilon"] = float(rng.choice([1e-6, 1e-3]))
    if sink:
        inputs["head_sink"] = (rng.standard_normal(H) * 2.0).astype(T)
    if quant:
        def mkscale(qt, mag, kind):
            base = 3.0 * mag / QMAX[kind]
            if qt == "PER_TENSOR":
                return np.array([base * rng.uniform(0.8, 1.2)], dtype=np.float32)
            return (base * rng.uniform(0.5, 1.5, (Hk, 1, D))).astype(np.float32)
        inputs["k_scale"] = mkscale(k_quant, 1.0, cache)
        attrs["k_quant_type"] = k_quant
        if not latent:
            inputs["v_scale"] = mkscale(v_quant, value_scale, v_cache)
            attrs["v_quant_type"] = v_quant
        if cache in BYTE_KINDS:
            attrs["k_cache_dtype"] = BYTE_KINDS[cache]
            if not latent:
                attrs["v_cache_dtype"] = BYTE_KINDS[v_cache]
    if bias is not None:
        bb, hb = bias
        qcap = int(max(1, q_lens.max() + bias_pad[0]))
        kcap = int(max(1, kv_len.max() + bias_pad[1]))
        inputs["attention_bias"] = _rand_T(rng, (1 if bb else B, 1 if hb else H, qcap, kcap), T, 2.0)
    if slot_mapping is not None:
        slots = derived_slots(inputs["block_table"], pos, q_lens, bs)
        if slot_mapping == "skip" and N:
            slots[rng.random(N) < 0.3] = -1
        inputs["slot_mapping"] = slots.astype(np.int32)
    if metadata is not None:
        if metadata == "tight":
            md = (int(max(1, q_lens.max())), int(max(1, kv_len.max())))
        elif metadata == "loose":
            md = (int(q_lens.max()) * 3 + 7, MB * bs * 4 + 5, 1)
        else:
            md = tuple(metadata)
        inputs["attention_metadata"] = np.array(md, dtype=np.int32)
    for name, val in (("local_window_size", window), ("softcap", softcap), ("is_causal", is_causal),
                      ("scale", scale), ("qk_output", qk_output)):
        if val != dict(local_window_size=-1, softcap=0.0, is_causal=1, scale=0.0, qk_output=0)[name]:
            attrs[name] = val
    if latent:
        attrs["kv_cache_layout"] = "LATENT"
        if v_head_size:
            attrs["v_head_size"] = v_head_size
    return Case(inputs, attrs, q_lens, past, dict(positions=pos, cache=cache, v_cache=v_cache, block_size=bs))


def prefill_case(rng, batch=2, q_len=12, past=0, **kw):
    """A prefill-shaped case: ``batch`` sequences of ``q_len`` new tokens after ``past`` cached ones."""
    return make_case(rng, q_lens=(q_len,) * batch, past=(past,) * batch, **kw)


def decode_case(rng, batch=4, context=(10, 40), **kw):
    """A decode-shaped case: one new token per sequence, random cached lengths in ``context``."""
    past = rng.integers(context[0], context[1] + 1, size=batch)
    return make_case(rng, q_lens=(1,) * batch, past=past, **kw)


def derived_slots(block_table, positions, q_lens, block_size):
    """The slots the operator derives for well-formed tokens (-1 where unmapped or beyond the row)."""
    owner = np.repeat(np.arange(len(q_lens)), q_lens)
    out = np.full(len(positions), -1, dtype=np.int64)
    for t, (b, p) in enumerate(zip(owner, positions)):
        lb = p // block_size
        if p >= 0 and lb < block_table.shape[1] and block_table[b, lb] >= 0:
            out[t] = int(block_table[b, lb]) * block_size + p % block_size
    return out


# ------------------------------------------------------------------------------------------------
# independent brute-force dense attention

@dataclass
class DenseResult:
    output: np.ndarray             # (N, H*Dv) float64 (not rounded to T)
    output_qk: Optional[np.ndarray]  # (H, N, kv_capacity) float64 or None
    key_cache: np.ndarray          # expected caches after the call
    value_cache: Optional[np.ndarray]
    written: np.ndarray            # (N,) bool: the token wrote its K/V
    valid: np.ndarray              # (N,) bool: the token belongs to a valid sequence and is itself valid
    lse: np.ndarray = None         # (N, H) float64: log of sum(exp(score)) over admitted keys, sink left out
    slot: np.ndarray = None        # (N,) int64: the flat cache slot the token wrote, -1 if none
    admitted: list = None          # per token, the set of flat cache slots of the keys it admits


def _quantize_plain(x_T, scale, kind):
    """Plain restatement of the write rule: saturate(rne(float32(x) * float32(1/scale))); int4 and
    e2m1 codes packed two a byte (int4 nibble q + 8; NaN saturates to -8, and to +6 in e2m1)."""
    inv = np.float32(1.0) / np.asarray(scale, dtype=np.float32)
    y = np.asarray(x_T).astype(np.float32) * inv
    y = y.astype(np.float32)
    if kind == "int8":
        return np.clip(np.round(y), -128, 127).astype(np.int8)
    if kind == "int4":
        nibbles = np.where(np.isnan(y), 0, np.clip(np.round(y), -8, 7) + 8).astype(np.uint8)
    elif kind == "fp4":
        codes = np.where(np.isnan(y), np.float32(6), np.clip(y, -6.0, 6.0)).astype(np.float32)
        nibbles = codes.astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 15
    else:
        return np.clip(y, -448.0, 448.0).astype(np.float32).astype(F8)
    return (nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)).astype(np.uint8)


def unpack_plain(row, kind):
    """float64 code values of a packed row (..., n) of ``kind`` ("int4" / "fp4"): (..., 2n), code 2i from
    the low nibble of byte i."""
    row = np.asarray(row)
    nibbles = np.stack([row & 15, row >> 4], axis=-1).reshape(row.shape[:-1] + (2 * row.shape[-1],))
    if kind == "int4":
        return nibbles.astype(np.float64) - 8.0
    return nibbles.astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)


def dense_attention(case: Case) -> DenseResult:
    """Brute-force float64 PagedAttention, one token (and one head) at a time."""
    inp, at = case.inputs, case.attrs
    get = lambda n, d: at.get(n, d)
    H, Hk = get("num_heads", None), get("kv_num_heads", None)
    latent = get("kv_cache_layout", "SEPARATE") == "LATENT"
    query = inp["query"]
    T = query.dtype
    N = query.shape[0]
    packed = inp["key"] is None and not latent
    D = query.shape[1] // (H + 2 * Hk) if packed else query.shape[1] // H
    Dv = (get("v_head_size", 0) or D) if latent else D
    G = H // Hk
    kc = inp["key_cache"].copy()
    vc = None if latent else inp["value_cache"].copy()
    NB, bs = kc.shape[0], kc.shape[1]
    cum = [int(c) for c in inp["cumulative_sequence_length"]]
    past = [int(c) for c in inp["past_seqlens"]]
    bt = inp["block_table"]
    B = len(cum) - 1
    MB = bt.shape[1]
    scale = get("scale", 0.0) or 1.0 / math.sqrt(D)
    softcap = get("softcap", 0.0)
    W = get("local_window_size", -1)
    causal = get("is_causal", 1) == 1
    rotary = get("do_rotary", 0) == 1
    inter = get("rotary_interleaved", 0) == 1
    roff = get("rotary_offset", 0)
    eps = get("qk_norm_epsilon", 1e-6)
    qk_mode = get("qk_output", 0)
    if kc.dtype == T:
        k_kind = "T"
    elif kc.dtype == np.int8:
        k_kind = "int8"
    elif kc.dtype == np.uint8:
        k_kind = {"float8e4m3fn": "fp8", "int4": "int4", "float4e2m1": "fp4"}[get("k_cache_dtype", "")]
    else:
        k_kind = "fp8"
    v_kind = k_kind if latent else ({"float8e4m3fn": "fp8", "int4": "int4", "float4e2m1": "fp4"}[
        get("v_cache_dtype", "")] if kc.dtype == np.uint8 else k_kind)
    as_bytes = kc.dtype == np.uint8
    md = inp["attention_metadata"]
    kvcap = MB * bs
    if md is not None and int(md[1]) != 0:
        kvcap = min(int(md[1]), MB * bs)

    def f64(a):
        return np.asarray(a).astype(np.float64)

    def to_T(a):
        return np.asarray(a, dtype=np.float64).astype(T)

    def scale_for(name, kvh, width):
        s = inp[name]
        if s.shape == (1,):
            return np.full(width, float(s[0]))
        return f64(s[kvh, 0, :width])

    def encode(x_T, name, kvh, kind):
        if kind == "T":
            return x_T
        s = np.asarray(inp[name], dtype=np.float32)
        s = s if s.shape == (1,) else s[kvh, 0, :]
        codes = _quantize_plain(x_T, s, kind)
        return codes.view(np.uint8) if as_bytes else codes

    def decode(row, name, kvh, width, kind):
        if kind == "T":
            return f64(row[:width])
        if kind in ("int4", "fp4"):
            return unpack_plain(row, kind)[:width] * scale_for(name, kvh, width)
        row = row[:width]
        if as_bytes:
            row = row.view(F8)
        return f64(row) * scale_for(name, kvh, width)

    def rope(vec, p):
        out = vec.copy()
        half = inp["cos_cache"].shape[1]
        for i in range(half):
            c = float(inp["cos_cache"][p, i])
            s = float(inp["sin_cache"][p, i])
            if inter:
                i1, i2 = roff + 2 * i, roff + 2 * i + 1
            else:
                i1, i2 = roff + i, roff + i + half
            out[i1] = vec[i1] * c - vec[i2] * s
            out[i2] = vec[i2] * c + vec[i1] * s
        return out

    def rms(vec, w):
        return vec / math.sqrt(float(np.sum(vec * vec)) / D + eps) * f64(w)

    # --- per-token prologue ---
    toks = []
    for t in range(N):
        lo, hi = 0, B
        while lo < hi:
            mid = (lo + hi) // 2
            if cum[mid + 1] > t:
                hi = mid
            else:
                lo = mid + 1
        b = lo
        info = dict(valid=False, b=b)
        toks.append(info)
        if not (b < B and cum[b] <= t):
            continue
        ql = cum[b + 1] - cum[b]
        if past[b] < 0 or ql < 0 or past[b] + ql > MB * bs:
            continue
        j = t - cum[b]
        p = int(inp["query_positions"][t]) if inp["query_positions"] is not None else past[b] + j
        if p < 0 or (rotary and p >= inp["cos_cache"].shape[0]):
            continue
        row = f64(query[t])
        if packed:
            qrow = row[:H * D]
            krow = row[H * D:(H + Hk) * D]
            vrow = query[t, (H + Hk) * D:]
        else:
            qrow = row
            krow = f64(inp["key"][t])
            vrow = None if latent else inp["value"][t]
        qh, kh = [], []
        for h in range(H):
            x = qrow[h * D:(h + 1) * D]
            if inp["q_norm_weight"] is not None:
                x = rms(x, inp["q_norm_weight"])
            if rotary:
                x = rope(x, p)
            qh.append(f64(to_T(x)))
        for h in range(Hk):
            x = krow[h * D:(h + 1) * D]
            if inp["k_norm_weight"] is not None:
                x = rms(x, inp["k_norm_weight"])
            if rotary:
                x = rope(x, p)
            kh.append(to_T(x))
        vh = None if latent else [np.asarray(vrow[h * D:(h + 1) * D]).astype(T) for h in range(Hk)]
        info.update(valid=True, j=j, p=p, q=qh, k=kh, v=vh, kv_len=past[b] + ql)

    # --- writes (all before any read) ---
    written = np.zeros(N, dtype=bool)
    slot_of = np.full(N, -1, dtype=np.int64)
    for t, info in enumerate(toks):
        if not info["valid"]:
            continue
        if inp["slot_mapping"] is not None:
            slot = int(inp["slot_mapping"][t])
            if not (0 <= slot < NB * bs):
                continue
        else:
            lb = info["p"] // bs
            if lb >= MB:
                continue
            blk = int(bt[info["b"], lb])
            if not (0 <= blk < NB):
                continue
            slot = blk * bs + info["p"] % bs
        written[t] = True
        slot_of[t] = slot
        for h in range(Hk):
            kc[slot // bs, slot % bs, h] = encode(info["k"][h], "k_scale", h, k_kind)
            if not latent:
                vc[slot // bs, slot % bs, h] = encode(info["v"][h], "v_scale", h, v_kind)

    # --- reads ---
    out = np.zeros((N, H, Dv))
    qk = np.zeros((H, N, kvcap)) if qk_mode else None
    lse = np.full((N, H), -np.inf)
    admitted = [set() for _ in range(N)]
    bias = inp["attention_bias"]
    sink = inp["head_sink"]
    for t, info in enumerate(toks):
        if not info["valid"]:
            continue
        b, p, j = info["b"], info["p"], info["j"]
        keys, vals, kpos = [], [], []
        for k in range(info["kv_len"]):
            if causal and k > p:
                continue
            if W > 0 and not (p - W < k):
                continue
            blk = int(bt[b, k // bs])
            if not (0 <= blk < NB):
                continue
            if bias is not None and (j >= bias.shape[2] or k >= bias.shape[3]):
                continue
            kpos.append(k)
            admitted[t].add(blk * bs + k % bs)
            keys.append([decode(kc[blk, k % bs, h], "k_scale", h, D, k_kind) for h in range(Hk)])
            if latent:
                vals.append([decode(kc[blk, k % bs, 0], "k_scale", 0, Dv, k_kind)])
            else:
                vals.append([decode(vc[blk, k % bs, h], "v_scale", h, D, v_kind) for h in range(Hk)])
        if not kpos:
            continue
        for h in range(H):
            g = h // G
            s = np.array([scale * float(np.dot(info["q"][h], keys[i][g])) for i in range(len(kpos))])
            if bias is not None:
                bb = 0 if bias.shape[0] == 1 else b
                hb = 0 if bias.shape[1] == 1 else h
                s = s + np.array([float(bias[bb, hb, j, k]) for k in kpos])
            if softcap > 0:
                s = softcap * np.tanh(s / softcap)
            top = s.max()
            lse[t, h] = top + math.log(float(np.sum(np.exp(s - top)))) if np.isfinite(top) else top
            m = s.max()
            if sink is not None:
                m = max(m, float(sink[h]))
            e = np.exp(s - m)
            den = e.sum() + (math.exp(float(sink[h]) - m) if sink is not None else 0.0)
            prob = e / den
            out[t, h] = sum(prob[i] * vals[i][g] for i in range(len(kpos)))
            if qk is not None:
                for i, k in enumerate(kpos):
                    if k < kvcap:
                        qk[h, t, k] = s[i] if qk_mode == 1 else prob[i]
    valid = np.array([i["valid"] for i in toks], dtype=bool)
    return DenseResult(out.reshape(N, H * Dv), qk, kc, vc, written, valid, lse, slot_of, admitted)


# ------------------------------------------------------------------------------------------------
# comparisons

def rel_err(out, ref) -> float:
    """||out - ref|| / ||ref|| in float64 (||out|| when ref is all zeros)."""
    o = np.asarray(out).astype(np.float64)
    r = np.asarray(ref).astype(np.float64)
    den = np.linalg.norm(r)
    num = np.linalg.norm(o - r)
    return float(num / den) if den > 0 else float(num)


def assert_rel(out, ref, dtype, factor=1.0, what="output"):
    """contract §6 relative-error bound for T=dtype (times ``factor``)."""
    err = rel_err(out, ref)
    tol = REL_TOL[np.dtype(dtype).name if not isinstance(dtype, str) else dtype] * factor
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol:.3g}"


def ulp(x, dtype) -> np.ndarray:
    """One unit in the last place of T at |x| (float64)."""
    mant, emin = _MANT[dtype if isinstance(dtype, str) else np.dtype(dtype).name]
    a = np.abs(np.asarray(x, dtype=np.float64))
    e = np.floor(np.log2(np.where(a > 0, a, 1.0)))
    e = np.maximum(np.where(a > 0, e, emin), emin)
    return np.exp2(e - mant)


def assert_within_ulp(out, ref, dtype, n=1.0, what="output"):
    """|out - ref| <= n ulp(T) at ref, elementwise (out is T, ref float64)."""
    o = np.asarray(out).astype(np.float64)
    r = np.asarray(ref, dtype=np.float64)
    assert o.shape == r.shape, f"{what}: shape {o.shape} != {r.shape}"
    assert np.all(np.isfinite(o)), f"{what}: non-finite values"
    bad = np.abs(o - r) > n * ulp(r, dtype) + 1e-300
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.size} elements off by more than {n} ulp; "
                           f"first at {np.argwhere(bad)[0].tolist()}: got {o[bad][0]!r}, expected {r[bad][0]!r}")


def _code_ordinal(c, packed=None):
    """Signed ordinal of cache codes: consecutive representable values differ by 1 (``packed``: "int4" or
    "fp4", the ordinals of the two nibbles of each byte, last dimension doubled)."""
    c = np.asarray(c)
    if packed is not None:
        n = np.stack([c & 15, c >> 4], axis=-1).astype(np.int64).reshape(c.shape[:-1] + (2 * c.shape[-1],))
        return n if packed == "int4" else np.where(n & 8, -(n & 7), n & 7)
    if c.dtype == np.int8:
        return c.astype(np.int64)
    u = c.view(np.uint8).astype(np.int64)
    return np.where(u & 0x80, -(u & 0x7F), u & 0x7F)


def assert_cache_close(actual, expected, steps=0, what="cache", max_frac=1.0, packed=None):
    """Caches equal byte for byte (steps=0), or within ``steps`` ulp/code where they differ.

    ``max_frac`` bounds the fraction of elements allowed to differ at all (rounding-boundary
    coincidences between two float64 implementations are rare, systematic errors are not);
    ``packed`` ("int4" / "fp4"): uint8 caches of 4-bit codes, compared code by code.
    """
    a, e = np.ascontiguousarray(actual), np.ascontiguousarray(expected)
    assert a.shape == e.shape and a.dtype == e.dtype, f"{what}: {a.shape}/{a.dtype} vs {e.shape}/{e.dtype}"
    differs = np.any(a.view(np.uint8).reshape(a.shape + (-1,)) != e.view(np.uint8).reshape(e.shape + (-1,)), axis=-1)
    ndiff = int(differs.sum())
    if ndiff == 0:
        return
    first = np.argwhere(differs)[0].tolist()
    assert steps > 0, (f"{what}: {ndiff} of {a.size} elements differ (expected byte-identical); first at {first}: "
                       f"got {a[tuple(first)]!r}, expected {e[tuple(first)]!r}")
    if a.dtype.name in T_DTYPES:
        diff = np.abs(a.astype(np.float64) - e.astype(np.float64))
        bad = diff > steps * ulp(e.astype(np.float64), a.dtype.name)
    else:
        bad = np.abs(_code_ordinal(a, packed) - _code_ordinal(e, packed)) > steps
    assert not bad.any(), f"{what}: {int(bad.sum())} elements differ by more than {steps} ulp/code; first at {first}"
    assert ndiff <= max(1, max_frac * a.size), f"{what}: {ndiff} of {a.size} elements differ (by at most {steps} step)"


def split_result(result, qk_output=0, return_lse=False):
    """(output, output_qk or None, lse or None) from what paged_attention returned."""
    if not isinstance(result, tuple):
        return result, None, None
    out, rest = result[0], list(result[1:])
    qk = rest.pop(0) if qk_output else None
    lse = rest.pop(0) if return_lse else None
    assert not rest, f"{len(result)} outputs for qk_output={qk_output}, return_lse={return_lse}"
    return out, qk, lse


def assert_lse_close(lse, expected, what="lse", tol=1e-6):
    """lse (float32) against a float64 expectation: within ``tol`` (relative and absolute; the default is
    float32 rounding, a CUDA backend's fp32 arithmetic needs about 1e-4), -inf exactly where expected."""
    lse = np.asarray(lse)
    assert lse.dtype == np.float32 and lse.shape == expected.shape, f"{what}: {lse.dtype} {lse.shape}"
    none = np.isneginf(expected)
    assert np.array_equal(np.isneginf(lse), none), f"{what}: -inf where no key is admitted, and only there"
    np.testing.assert_allclose(lse[~none].astype(np.float64), expected[~none], rtol=tol, atol=tol, err_msg=what)


def check_against_dense(case: Case, result, dense: DenseResult, *, caches_after: Case = None,
                        return_lse: bool = False):
    """Compare a reference/backend result (output, plus output_qk and lse as asked) and the caches
    with dense."""
    dt = case.dtype
    out, qk, lse = split_result(result, case.attrs.get("qk_output", 0), return_lse)
    assert out.dtype == T_DTYPES[dt]
    assert_within_ulp(out, dense.output, dt, what="output")
    if dense.output_qk is not None:
        assert qk is not None and qk.dtype == np.float32 and qk.shape == dense.output_qk.shape
        np.testing.assert_allclose(qk.astype(np.float64), dense.output_qk, rtol=2e-6, atol=1e-6)
    if return_lse:
        assert_lse_close(lse, dense.lse)
    src = caches_after if caches_after is not None else case
    # float64 implementations may land on opposite sides of a rounding boundary very rarely
    k_packed = case.info.get("cache") if case.info.get("cache") in ("int4", "fp4") else None
    v_packed = case.info.get("v_cache") if case.info.get("v_cache") in ("int4", "fp4") else None
    assert_cache_close(src.inputs["key_cache"], dense.key_cache, steps=1, max_frac=1e-3, what="key_cache",
                       packed=k_packed)
    if dense.value_cache is not None:
        assert_cache_close(src.inputs["value_cache"], dense.value_cache, steps=1, max_frac=1e-3,
                           what="value_cache", packed=v_packed)


def apply_rope(x, cos_row, sin_row, offset=0, interleaved=False):
    """RoPE on channels [offset, offset + 2*len(cos_row)) of x (..., D) in float64 (returns float64).

    ``cos_row``/``sin_row`` broadcast against x's leading dimensions (e.g. (N, 1, rd/2) for x (N, H, D)).
    The formula is the contract's: out1 = x1*cos - x2*sin, out2 = x2*cos + x1*sin with pairs
    (2i, 2i+1) when interleaved, else (i, i + rd/2).
    """
    x = np.asarray(x).astype(np.float64)
    c = np.asarray(cos_row).astype(np.float64)
    s = np.asarray(sin_row).astype(np.float64)
    half = c.shape[-1]
    y = x.copy()
    if interleaved:
        i1 = offset + 2 * np.arange(half)
        i2 = i1 + 1
    else:
        i1 = offset + np.arange(half)
        i2 = i1 + half
    x1, x2 = x[..., i1], x[..., i2]
    y[..., i1] = x1 * c - x2 * s
    y[..., i2] = x2 * c + x1 * s
    return y


def check_against_reference(ref_case: Case, ref_result, out, key_cache, value_cache=None, output_qk=None,
                            dtype=None):
    """Compare a CUDA backend's results (host NumPy copies) with a reference run (contract §6).

    ``ref_case`` is the case after the reference call (its caches are the reference's written caches);
    ``ref_result`` is what the reference returned. Output: relative error below REL_TOL[T]; caches:
    within one ulp of T (T caches) or one code (quantized caches); output_qk: float32 relative error
    below REL_TOL[T].
    """
    dt = dtype or ref_case.dtype
    ref_out, ref_qk = (ref_result if isinstance(ref_result, tuple) else (ref_result, None))
    out = np.asarray(out)
    assert out.shape == ref_out.shape and out.dtype == ref_out.dtype, (out.shape, out.dtype, ref_out.shape)
    assert np.all(np.isfinite(out.astype(np.float32))), "output has non-finite values"
    assert_rel(out, ref_out, dt)
    assert_cache_close(key_cache, ref_case.inputs["key_cache"], steps=1, what="key_cache")
    if value_cache is not None:
        assert_cache_close(value_cache, ref_case.inputs["value_cache"], steps=1, what="value_cache")
    if ref_qk is not None:
        assert output_qk is not None and np.asarray(output_qk).shape == ref_qk.shape
        assert_rel(output_qk, ref_qk, dt, what="output_qk")


# ------------------------------------------------------------------------------------------------
# key shards: block tables that map disjoint key ranges

def shard_block_tables(rng, block_table, num_shards, how="ranges"):
    """``num_shards`` block tables that together map exactly the entries of ``block_table``, each entry in
    one table (the others hold -1 there): the keys of every sequence split into disjoint shards.

    ``how="ranges"`` cuts each row at random block boundaries into consecutive ranges (some empty);
    ``"scatter"`` gives each entry to a random shard. With block_size 1 a cut can fall at any position.
    """
    bt = np.asarray(block_table)
    B, MB = bt.shape
    tables = [np.full_like(bt, -1) for _ in range(num_shards)]
    for b in range(B):
        if how == "ranges":
            edges = [0, *np.sort(rng.integers(0, MB + 1, size=num_shards - 1)), MB]
            owner = np.repeat(np.arange(num_shards), np.diff(edges))
        else:
            owner = rng.integers(0, num_shards, size=MB)
        for s in range(num_shards):
            tables[s][b, owner == s] = bt[b, owner == s]
    return tables
