"""The NumPy reference backend: float64 arithmetic, the oracle every CUDA backend is tested against.

Semantics are docs/contract.md sections 1-4 plus the decisions of docs/architecture.md. One call
runs in two phases (seed section 7.2): the prologue of *every* token (packed-QKV split, QK-norm,
RoPE, rounding to T, quantize-on-write, the cache write), then the attention of every token, so a
token reads a cache that already holds every write of this call.

Token t of sequence b admits the key positions k with ``lo_t <= k < hi_t`` (its kv_len, the causal
bound, the window and the bias capacity, :func:`_tokens`) whose block is mapped. Attention runs on
*grids*: rows of consecutive tokens of one sequence (a long prefill is cut into several rows, short
sequences are packed several rows to a grid), each grid against the key positions its tokens admit:

1. scores ``s = scale * (q . k)`` for every (token, head, key), the keys gathered through the block
   table and dequantized one tile at a time;
2. ``+ attention_bias``, then softcap; keys the token does not admit become -inf;
3. softmax over the admitted keys: ``e = exp(s - max)``, ``den = sum(e)`` plus the sink's term; lse,
   output_qk;
4. ``output = sum(e * v) / den`` over the admitted keys, the values again gathered tile by tile.

A key a token does not admit contributes nothing to that token, whatever its cache row holds: rows
that no token of a grid row admits are zeroed as they are gathered, and a value row holding NaN or
Inf that some tokens of the row admit is added to exactly those tokens (a probability of 0 times NaN
is NaN, not 0). Grids, rows and tiles follow from lengths and positions alone, never from cache
contents, so two calls that differ only in rows a token does not admit give that token the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import ml_dtypes

from . import arrays, helpers
from .contract import INPUT_NAMES, Problem
from .errors import fail

_T = {"float16": np.dtype(np.float16), "bfloat16": np.dtype(ml_dtypes.bfloat16), "float32": np.dtype(np.float32)}
_F8 = np.dtype(ml_dtypes.float8_e4m3fn)
#: cupa.quantize's name of each quantized cache kind
_CACHE_DTYPE = {"int8": "int8", "fp8": "float8e4m3fn", "int4": "int4", "fp4": "float4e2m1"}

#: float64 elements of one grid's scores (tokens x heads x keys): how many tokens share a grid
SCORE_ELEMENTS = 1 << 23
#: tokens of one grid row at most: every token of a row is scored against the keys of all of them,
#: so a long causal row computes (then masks) about rows**2 / 2 pairs for nothing
ROW_TOKENS = 128
#: float64 elements of one gathered tile of keys or values (rows x keys x kv heads x head size)
TILE_ELEMENTS = 1 << 18
#: float64 elements of the prologue's temporaries (tokens x heads x head size)
PROLOGUE_ELEMENTS = 1 << 21


class ReferenceBackend:
    """Host inputs run here: float64 arithmetic on the CPU, output cast to T.

    NumPy arrays, and CPU arrays of any library NumPy can view without a copy (PyTorch CPU tensors,
    JAX CPU arrays): the outputs come back in the library of ``query`` and the caches are updated in
    place where they live.
    """

    name = "reference"
    verified = True

    def not_supported_reasons(self, problem: Problem, device=None, options=None) -> list:
        return []

    def preferred(self, problem: Problem, device=None, options=None) -> bool:
        return True

    def describe(self, problem: Problem, device=None, options=None) -> str:
        return (f"NumPy float64 reference on the CPU: N={problem.token_count} B={problem.batch_size} "
                f"H={problem.num_heads} Hk={problem.kv_num_heads} D={problem.head_size} "
                f"cache={problem.cache_kind}")

    def run(self, plan, inputs: dict, out=None, stream=None):
        pb = plan.problem
        like = inputs["query"]
        views = {name: (x if name == "attention_metadata" else arrays.host_view(x, name, cache=name in _CACHES))
                 for name, x in inputs.items()}
        out_view = arrays.host_out(out, like, pb.output_shape, _T[pb.dtype])
        _check_disjoint(pb, views, out_view, plan.options)
        result = _run(pb, views, out_view)
        if isinstance(result, tuple):
            return (arrays.wrap_host(result[0], like, out), *(arrays.wrap_host(r, like) for r in result[1:]))
        return arrays.wrap_host(result, like, out)


_CACHES = ("key_cache", "value_cache")


def _check_disjoint(pb: Problem, views: dict, out, options) -> None:
    """value_cache apart from key_cache (SEPARATE; or interleaved a whole number of blocks apart under
    ``Options(kv_pages_interleaved=True)``), out= apart from every input (host memory)."""
    kc, vc = views["key_cache"], views["value_cache"]
    if not pb.latent and isinstance(kc, np.ndarray) and isinstance(vc, np.ndarray) and np.may_share_memory(kc, vc):
        address = {"key_cache": kc.__array_interface__["data"][0], "value_cache": vc.__array_interface__["data"][0]}
        arrays.check_disjoint({name: pb.input_nbytes[name] for name in _CACHES}, address.__getitem__,
                              interleaved_block_bytes=pb.cache_block_bytes if options.kv_pages_interleaved else 0)
    if out is not None:
        for name, x in views.items():
            if name != "attention_metadata" and isinstance(x, np.ndarray) and np.may_share_memory(out, x):
                raise fail("out", f"memory overlapping {name}", "an output buffer of its own (out= never aliases "
                           "an input)")


BACKEND = ReferenceBackend()


# ----------------------------------------------------------------------------------------------
# checks of the arrays the reference writes

def _check_out(out, pb: Problem, T):
    if out is None:
        return None
    if not isinstance(out, np.ndarray):
        raise fail("out", f"a {type(out).__name__}", "a NumPy array (the library of query)")
    if tuple(out.shape) != tuple(pb.output_shape):
        raise fail("out", f"shape {tuple(out.shape)}", f"shape {tuple(pb.output_shape)} (token_count, num_heads*v_head_size)")
    if out.dtype != T:
        raise fail("out", f"dtype {out.dtype.name}", f"dtype {T.name} (the query's type)")
    if not out.flags.c_contiguous:
        raise fail("out", "a non-contiguous array", "a C-contiguous array")
    if not out.flags.writeable:
        raise fail("out", "a read-only array", "a writeable array")
    return out


def _check_cache(c, name):
    if not isinstance(c, np.ndarray):
        raise fail(name, f"a {type(c).__name__}", "a NumPy array")
    if not c.flags.c_contiguous:
        raise fail(name, "a non-contiguous array", "a C-contiguous array (it is updated in place)")
    if not c.flags.writeable:
        raise fail(name, "a read-only array", "a writeable array (it is updated in place)")


# ----------------------------------------------------------------------------------------------
# prologue pieces

def _owner(cum: np.ndarray, N: int, B: int) -> np.ndarray:
    """Owner sequence of every token: the binary search of docs/architecture.md (B = no owner)."""
    t = np.arange(N, dtype=np.int64)
    lo = np.zeros(N, dtype=np.int64)
    hi = np.full(N, B, dtype=np.int64)
    for _ in range(int(B).bit_length() + 1):
        act = lo < hi
        if not act.any():
            break
        mid = (lo + hi) // 2
        go = cum[np.minimum(mid + 1, B)] > t
        hi = np.where(act & go, mid, hi)
        lo = np.where(act & ~go, mid + 1, lo)
    return lo


def _rms_norm(x, w, eps):
    ms = np.mean(x * x, axis=-1, keepdims=True)
    return x * (1.0 / np.sqrt(ms + eps)) * w


def _rope(x, cos, sin, off, rd, interleaved):
    """Rotate channels [off, off+rd) of x (N, heads, D) with per-token cos/sin (N, rd/2)."""
    y = x.copy()
    half = rd // 2
    c, s = cos[:, None, :], sin[:, None, :]
    if interleaved:
        x1, x2 = x[..., off:off + rd:2], x[..., off + 1:off + rd:2]
        y[..., off:off + rd:2] = x1 * c - x2 * s
        y[..., off + 1:off + rd:2] = x2 * c + x1 * s
    else:
        x1, x2 = x[..., off:off + half], x[..., off + half:off + rd]
        y[..., off:off + half] = x1 * c - x2 * s
        y[..., off + half:off + rd] = x2 * c + x1 * s
    return y


def _f64(x):
    return np.asarray(x).astype(np.float64)


def _scale64(s, D: int):
    """A k_scale / v_scale as float64 broadcasting against (..., Hk, D): (Hk, D) or (1,); None if absent."""
    if s is None:
        return None
    s = np.asarray(s, dtype=np.float32).astype(np.float64)
    return s.reshape(s.shape[0], D) if s.ndim == 3 else s.reshape(1)


# ----------------------------------------------------------------------------------------------

@dataclass
class _Tokens:
    """Per-token facts of one call (contract §4, docs/architecture.md), arrays of shape (N,)."""

    seq: np.ndarray        # owner sequence, clipped to [0, B) (meaningful where ``valid``)
    valid: np.ndarray      # owned by a valid sequence, position valid
    j: np.ndarray          # index among its sequence's new tokens
    position: np.ndarray   # logical position p
    lo: np.ndarray         # admitted keys lie in [lo, hi) (then only the mapped ones)
    hi: np.ndarray


def _tokens(pb: Problem, x: dict) -> _Tokens:
    a = pb.attrs
    N, B, MB, bs = pb.token_count, pb.batch_size, pb.max_blocks_per_seq, pb.block_size
    cum = np.asarray(x["cumulative_sequence_length"]).astype(np.int64)
    past = np.asarray(x["past_seqlens"]).astype(np.int64)
    t = np.arange(N, dtype=np.int64)
    b = _owner(cum, N, B)
    seq = np.minimum(b, B - 1)
    owned = (b < B) & (cum[seq] <= t)
    q_len = cum[1:] - cum[:-1]
    kv_len = past + q_len
    seq_valid = (past >= 0) & (q_len >= 0) & (kv_len <= MB * bs)
    valid = owned & seq_valid[seq]
    j = t - cum[seq]
    p = np.asarray(x["query_positions"]).astype(np.int64) if pb.has_query_positions else past[seq] + j
    valid &= p >= 0
    if a.do_rotary:
        valid &= p < pb.rotary_max_pos

    # keys k < kv_len, k <= p when causal, k > p - W with a window, (j, k) inside the bias capacity
    hi = kv_len[seq]
    if a.is_causal:
        hi = np.minimum(hi, p + 1)
    lo = np.maximum(p - a.local_window_size + 1, 0) if a.local_window_size > 0 else np.zeros(N, np.int64)
    if pb.has_bias:
        q_capacity, kv_capacity = pb.bias_shape[2:]
        hi = np.where(j < q_capacity, np.minimum(hi, kv_capacity), 0)
    hi = np.where(valid, np.maximum(hi, 0), 0)
    lo = np.where(valid, np.minimum(lo, hi), 0)
    return _Tokens(seq, valid, j, p, lo, hi)


def _prologue(pb: Problem, x: dict, tok: _Tokens):
    """Q, K and V of every token as T values (N, heads, D): split, RMSNorm, RoPE, rounding to T."""
    a = pb.attrs
    T = _T[pb.dtype]
    N, H, Hk, D = pb.token_count, pb.num_heads, pb.kv_num_heads, pb.head_size
    query = np.asarray(x["query"])
    if pb.packed_qkv:
        q_in, k_in, v_in = query[:, :H * D], query[:, H * D:(H + Hk) * D], query[:, (H + Hk) * D:]
    else:
        q_in, k_in = query, np.asarray(x["key"])
        v_in = None if pb.latent else np.asarray(x["value"])
    v_T = None if v_in is None else v_in.reshape(N, Hk, D)
    if not (pb.has_qk_norm or a.do_rotary):       # Q and K are T values already
        return q_in.reshape(N, H, D), k_in.reshape(N, Hk, D), v_T

    q_T, k_T = np.empty((N, H, D), T), np.empty((N, Hk, D), T)
    step = max(1, PROLOGUE_ELEMENTS // ((H + Hk) * D))
    for t0 in range(0, N, step):
        rows = slice(t0, t0 + step)
        q, k = _f64(q_in[rows]).reshape(-1, H, D), _f64(k_in[rows]).reshape(-1, Hk, D)
        if pb.has_qk_norm:
            q = _rms_norm(q, _f64(x["q_norm_weight"]), a.qk_norm_epsilon)
            k = _rms_norm(k, _f64(x["k_norm_weight"]), a.qk_norm_epsilon)
        if a.do_rotary:
            p = np.where(tok.valid[rows], tok.position[rows], 0)
            cos, sin = _f64(np.asarray(x["cos_cache"])[p]), _f64(np.asarray(x["sin_cache"])[p])
            q = _rope(q, cos, sin, a.rotary_offset, pb.rotary_dim, a.rotary_interleaved)
            k = _rope(k, cos, sin, a.rotary_offset, pb.rotary_dim, a.rotary_interleaved)
        q_T[rows], k_T[rows] = q, k               # rounded to T: attention reads Q as T values
    return q_T, k_T, v_T


def _write_cache(pb: Problem, x: dict, tok: _Tokens, k_T, v_T) -> None:
    """Every valid token's K and V to its slot (contract §4.1): a T cache stores the T value, a quantized
    cache the code of :func:`cupa.quantize`; slots outside the cache write nothing."""
    NB, bs, MB = pb.num_blocks, pb.block_size, pb.max_blocks_per_seq
    valid = tok.valid
    if pb.has_slot_mapping:
        slot = np.asarray(x["slot_mapping"]).astype(np.int64)
        write = valid & (slot >= 0) & (slot < NB * bs)
    else:
        block_index = np.where(valid, tok.position // bs, 0)
        in_row = block_index < MB
        block = np.where(valid & in_row, np.asarray(x["block_table"])[tok.seq, np.minimum(block_index, MB - 1)], -1)
        write = valid & in_row & (block >= 0) & (block < NB)
        slot = np.where(write, block * bs + tok.position % bs, -1)
    rows = np.flatnonzero(write)
    if not rows.size:
        return

    def encode(vals, scale, kind):
        if kind == "T":
            return vals
        # uint8 arrays hold fp8 bytes or packed 4-bit codes (two a byte, a row of head_size / 2 bytes)
        return helpers.quantize(vals, scale, _CACHE_DTYPE[kind], as_bytes=pb.cache_array_dtype == "uint8")

    Hk = pb.kv_num_heads
    key_codes = encode(k_T[rows], x["k_scale"], pb.cache_kind)
    x["key_cache"].reshape(NB * bs, Hk, pb.cache_row_items)[slot[rows]] = key_codes
    if not pb.latent:
        x["value_cache"].reshape(NB * bs, Hk, pb.v_cache_row_items)[slot[rows]] = encode(
            v_T[rows], x["v_scale"], pb.v_cache_kind)


# ----------------------------------------------------------------------------------------------

def _run(pb: Problem, inputs: dict, out):
    a = pb.attrs
    T = _T[pb.dtype]
    x = {name: inputs.get(name) for name in INPUT_NAMES}

    out_arr = _check_out(out, pb, T)
    _check_cache(x["key_cache"], "key_cache")
    if not pb.latent:
        _check_cache(x["value_cache"], "value_cache")
    if pb.quantized:                           # before anything is written
        helpers.check_scale(x["k_scale"], "k_scale")
        if not pb.latent:
            helpers.check_scale(x["v_scale"], "v_scale")

    result = out_arr if out_arr is not None else np.empty(pb.output_shape, dtype=T)
    result[...] = 0                            # tokens that admit no key output zeros
    qk = np.zeros(pb.output_qk_shape, dtype=np.float32) if a.qk_output else None
    lse = np.full(pb.lse_shape, -np.inf, dtype=np.float32) if a.return_lse else None
    if pb.token_count:
        tok = _tokens(pb, x)
        q_T, k_T, v_T = _prologue(pb, x, tok)
        _write_cache(pb, x, tok, k_T, v_T)
        if pb.num_blocks:                          # an empty cache maps no key
            _Attention(pb, x, tok, q_T, result, qk, lse).run()
    extra = tuple(y for y in (qk, lse) if y is not None)
    return (result, *extra) if extra else result


class _Attention:
    """Attention of every token over the cache the prologue wrote (contract §4.2-§4.3), grid by grid."""

    def __init__(self, pb: Problem, x: dict, tok: _Tokens, q_T, result, qk, lse):
        self.pb, self.tok, self.q_T = pb, tok, q_T
        self.result, self.qk, self.lse = result, qk, lse
        NB, bs, Hk, D, Dv = pb.num_blocks, pb.block_size, pb.kv_num_heads, pb.head_size, pb.v_head_size
        self.block_table = np.asarray(x["block_table"]).astype(np.int64)
        self.key_rows = x["key_cache"].reshape(NB * bs, Hk, pb.cache_row_items)
        self.value_rows = self.key_rows if pb.latent else x["value_cache"].reshape(NB * bs, Hk, pb.v_cache_row_items)
        self.k_scale = k_scale = _scale64(x["k_scale"], D)
        self.v_scale = k_scale[..., :Dv] if pb.latent and k_scale is not None else _scale64(x["v_scale"], D)
        self.sink = _f64(x["head_sink"]) if pb.has_head_sink else None
        self.bias = np.asarray(x["attention_bias"]) if pb.has_bias else None
        G = pb.group_size
        self.head_of = np.arange(Hk)[:, None] * G + np.arange(G)[None, :]   # (Hk, G) -> query head
        self.row_keys = Hk * max(D, Dv)            # gathered elements per key of one grid row
        self._buffers = {}

    # -- grids ----------------------------------------------------------------------------------
    def _rows(self, tokens: np.ndarray) -> list:
        """Consecutive runs of at most ROW_TOKENS of one sequence's attending tokens whose scores fit
        SCORE_ELEMENTS."""
        lo, hi, H = self.tok.lo[tokens], self.tok.hi[tokens], self.pb.num_heads
        rows, i, n = [], 0, tokens.size
        while i < n:                           # a row is no longer than its first token's span allows
            ahead = slice(i, min(n, i + max(1, SCORE_ELEMENTS // (H * max(1, int(hi[i] - lo[i]))))))
            span = np.maximum.accumulate(hi[ahead]) - np.minimum.accumulate(lo[ahead])
            size = np.arange(1, span.size + 1) * H * span      # non-decreasing
            m = min(ROW_TOKENS, max(1, int(np.count_nonzero(size <= SCORE_ELEMENTS))))
            rows.append(tokens[i:i + m])
            i += m
        return rows

    def grids(self):
        """Yield ``(grid, real)``: grid (U, M) holds token indices, row u the tokens of one sequence,
        padded with repeats of its first token where ``real`` is False. A row whose keys fit one
        tile is packed with other such rows (sorted by key span); a longer row is a grid of its own."""
        tok = self.tok
        attending = np.flatnonzero(tok.hi > tok.lo)
        order = attending[np.argsort(tok.seq[attending], kind="stable")]
        starts = np.flatnonzero(np.diff(tok.seq[order], prepend=-1))
        rows = []
        for s, e in zip(starts, np.append(starts[1:], order.size)):
            rows.extend(self._rows(order[s:e]))
        span = np.array([tok.hi[r].max() - tok.lo[r].min() for r in rows], dtype=np.int64)
        short = span * self.row_keys <= TILE_ELEMENTS
        for r in np.flatnonzero(~short):
            yield rows[r][None, :], np.ones((1, rows[r].size), dtype=bool)
        H, per_key = self.pb.num_heads, self.row_keys
        group, longest = [], 0
        for r in np.flatnonzero(short)[np.argsort(span[short], kind="stable")]:
            w, m = int(span[r]), max(longest, rows[r].size)      # spans ascend: w is the group's widest
            U = len(group) + 1
            if group and (U * w * per_key > TILE_ELEMENTS or U * m * H * w > SCORE_ELEMENTS):
                yield _pad(group, longest)
                group, m = [], rows[r].size
            group.append(rows[r])
            longest = m
        if group:
            yield _pad(group, longest)

    def _buffer(self, name: str, shape: tuple) -> np.ndarray:
        """A float64 array of ``shape`` in a buffer that every grid and tile reuses (a fresh array
        of megabytes costs its page faults each time)."""
        n = int(np.prod(shape))
        buf = self._buffers.get(name)
        if buf is None or buf.size < n:
            buf = self._buffers[name] = np.empty(n)
        return buf[:n].reshape(shape)

    def run(self) -> None:
        # NaN or Inf in an admitted row gives its tokens an unspecified result, without warnings
        with np.errstate(invalid="ignore", over="ignore"):
            for grid, real in self.grids():
                self.attend(grid, real)

    # -- one grid -------------------------------------------------------------------------------
    def gather(self, rows, slots, needed, scale, width, kind):
        """Keys or values at ``slots`` (U, kt) as float64 (U, kt, Hk, width), dequantized as
        ``code * scale`` (``kind``: the cache's Problem.cache_kind); a row no token of its grid row
        admits (``needed`` False) is zero whatever the cache holds there."""
        codes = rows[slots]
        if kind in helpers.PACKED_KINDS:                # two codes a byte: values first, then the zeros
            vals = helpers.packed_values(codes, kind)[..., :width].astype(np.float64)
            if not needed.all():
                vals[~needed] = 0.0
        else:
            if not needed.all():
                codes[~needed] = 0
            codes = codes[..., :width]
            if kind == "fp8" and codes.dtype == np.uint8:
                codes = codes.view(_F8)
            vals = self._buffer("tile", codes.shape)           # valid until the next gather
            np.copyto(vals, codes)
        if scale is not None:
            vals *= scale
        return vals

    def attend(self, grid: np.ndarray, real: np.ndarray) -> None:
        pb, tok, a = self.pb, self.tok, self.pb.attrs
        U, M = grid.shape
        H, Hk, G, D, Dv = pb.num_heads, pb.kv_num_heads, pb.group_size, pb.head_size, pb.v_head_size
        NB, bs = pb.num_blocks, pb.block_size
        seq = tok.seq[grid[:, 0]]                                     # (U,) sequence of each row
        lo, hi = tok.lo[grid], tok.hi[grid]                           # (U, M)
        klo, khi = int(lo[real].min()), int(hi[real].max())
        pos = np.arange(klo, khi, dtype=np.int64)                     # the grid's key positions
        Kc = pos.size

        # admitted[u, m, k]: token grid[u, m] attends key pos[k] (its range and a mapped block)
        block = self.block_table[seq][:, pos // bs]                   # (U, Kc)
        mapped = (block >= 0) & (block < NB)
        slots = np.where(mapped, block, 0) * bs + pos % bs
        admitted = mapped[:, None, :] & (pos >= lo[..., None]) & (pos < hi[..., None])
        needed = admitted.any(axis=1)                                 # (U, Kc): read for this row
        # keys per tile: TILE_ELEMENTS float64 (each used while in cache), or as many as the grid has
        # scores when those are more (a prefill: fewer, larger matrix products)
        tile = max(1, max(TILE_ELEMENTS, U * H * M * Kc) // (U * self.row_keys))

        # 1. scores s = scale * (q . k), (U, Hk, M*G, Kc): query head h = kv_head*G + g is row m*G + g
        #    of its kv head; the scale is applied to q (a pass over q instead of one over s)
        q = self.q_T[grid].astype(np.float64).reshape(U, M, Hk, G, D) * pb.scale
        q = q.transpose(0, 2, 1, 3, 4).reshape(U, Hk, M * G, D)
        s = self._buffer("scores", (U, Hk, M * G, Kc))
        for k0 in range(0, Kc, tile):
            t = slice(k0, k0 + tile)
            keys = self.gather(self.key_rows, slots[:, t], needed[:, t], self.k_scale, D, pb.cache_kind)
            np.matmul(q, keys.transpose(0, 2, 3, 1), out=s[..., t])
        s5 = s.reshape(U, Hk, M, G, Kc)

        # 2. bias, softcap, mask
        if self.bias is not None:
            Bb, Hb = self.bias.shape[:2]
            bb = (seq if Bb > 1 else np.zeros(U, np.int64))[:, None, None, None, None]
            hh = (self.head_of if Hb > 1 else np.zeros((Hk, G), np.int64))[None, :, None, :, None]
            s5 += self.bias[bb, hh, tok.j[grid][:, None, :, None, None], pos]
        if a.softcap > 0:
            s5 /= a.softcap
            np.tanh(s5, out=s5)
            s5 *= a.softcap
        m5 = admitted[:, None, :, None, :]                            # (U, 1, M, 1, Kc)
        toks = grid[real]
        if a.qk_output == 1:
            self._write_qk(np.where(m5, s5, 0.0), toks, real, klo, khi)
        np.copyto(s5, -np.inf, where=~m5)

        # 3. softmax over the admitted keys, e = exp(s - max) and den = sum(e) (+ the sink's term)
        mx = s5.max(axis=-1, keepdims=True)
        if self.sink is not None:
            sink = self.sink[self.head_of][None, :, None, :, None]     # (1, Hk, 1, G, 1)
            mx = np.maximum(mx, sink)
        mx[~np.isfinite(mx)] = 0.0
        s5 -= mx
        np.exp(s5, out=s5)                                            # not admitted: exp(-inf) = 0
        den = s5.sum(axis=-1, keepdims=True)
        if self.lse is not None:                                      # the sink left out
            with np.errstate(divide="ignore"):
                l5 = (np.log(den) + mx)[..., 0]                       # (U, Hk, M, G); -inf: no key
            self.lse[toks] = l5.transpose(0, 2, 1, 3).reshape(U, M, H)[real]
        if self.sink is not None:
            den += np.exp(sink - mx)
        den[den == 0] = 1.0
        if a.qk_output == 2:
            self._write_qk(s5[..., :max(0, min(khi, pb.kv_capacity) - klo)] / den, toks, real, klo, khi)

        # 4. output = sum over the admitted keys of e * v, divided by den
        o = np.zeros((U, Hk, M * G, Dv))
        for k0 in range(0, Kc, tile):
            t = slice(k0, k0 + tile)
            values = self.gather(self.value_rows, slots[:, t], needed[:, t], self.v_scale, Dv, pb.v_cache_kind)
            o += _weighted_values(s[..., t], values, admitted[:, :, t], G)
        o5 = o.reshape(U, Hk, M, G, Dv)
        o5 /= den
        self.result[toks] = o5.transpose(0, 2, 1, 3, 4).reshape(U, M, H * Dv)[real]

    def _write_qk(self, vals, toks, real, klo: int, khi: int) -> None:
        """output_qk[:, toks, klo:...] from ``vals`` (U, Hk, M, G, >= width), inside kv_capacity."""
        w = min(khi, self.pb.kv_capacity) - klo
        if w <= 0:
            return
        U, Hk, M, G = vals.shape[:4]
        vals = vals[..., :w].transpose(0, 2, 1, 3, 4).reshape(U, M, Hk * G, w)[real]   # (n, H, w)
        self.qk[:, toks, klo:klo + w] = vals.transpose(1, 0, 2)


def _pad(rows: list, M: int):
    """Rows of token indices as a (U, M) grid padded with each row's first token, and its real mask."""
    grid = np.stack([np.concatenate([r, np.full(M - r.size, r[0])]) for r in rows])
    real = np.arange(M)[None, :] < np.array([r.size for r in rows])[:, None]
    return grid, real


def _weighted_values(e, values, admitted, G: int):
    """``sum_k e[..., k] * values[:, k]`` over the keys each token admits: (U, Hk, M*G, Dv).

    e: softmax numerators (U, Hk, M*G, kt), 0 where not admitted; values: (U, kt, Hk, Dv);
    admitted: (U, M, kt). A NaN or Inf in a value row would reach every token of the grid row
    through its zero weight (0 * NaN is NaN): then such rows are left out of the product and added
    back for the tokens that admit them. (A non-finite value always makes the plain product
    non-finite, which is the cheap test.)
    """
    by_head = values.transpose(0, 2, 1, 3)                            # (U, Hk, kt, Dv)
    o = np.matmul(e, by_head)
    if np.isfinite(o).all():
        return o
    finite = np.isfinite(values).all(axis=-1)                         # (U, kt, Hk)
    o = np.matmul(e, np.where(finite.transpose(0, 2, 1)[..., None], by_head, 0.0))
    U, Hk, MG, kt = e.shape
    o5, e5 = o.reshape(U, Hk, MG // G, G, -1), e.reshape(U, Hk, MG // G, G, kt)
    for u, k, h in zip(*np.nonzero(~finite)):
        tokens = admitted[u, :, k]
        o5[u, h, tokens] += e5[u, h, tokens, :, k, None] * values[u, k, h]
    return o
