"""The NumPy reference backend: float64 arithmetic, the oracle every CUDA backend is tested against.

Semantics are docs/contract.md sections 1-4 plus the decisions of docs/architecture.md. One call runs in two
phases (seed section 7.2): the prologue of *every* token (packed-QKV split, QK-norm, RoPE, rounding
to T, quantize-on-write, the cache write), then the attention of every token, so a token reads a
cache that already holds every write of this call.

The work is vectorized over tokens and heads. Tokens are processed in chunks whose temporaries stay
under a fixed element budget; a sequence with many new tokens (a prefill) gathers its keys once per
chunk and multiplies all its tokens against them, other tokens gather their own keys through the
block table with fancy indexing.
"""

from __future__ import annotations

import numpy as np
import ml_dtypes

from . import arrays, helpers
from .contract import INPUT_NAMES, Problem
from .errors import fail

_T = {"float16": np.dtype(np.float16), "bfloat16": np.dtype(ml_dtypes.bfloat16), "float32": np.dtype(np.float32)}
_F8 = np.dtype(ml_dtypes.float8_e4m3fn)

#: element budget of one chunk's largest temporaries (float64 elements)
CHUNK_ELEMENTS = 1 << 22
#: a sequence with at least this many attending tokens shares one key gather among them
GROUP_MIN_TOKENS = 8


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
        arrays.check_disjoint({"key_cache": pb.input_nbytes["key_cache"]}, address.__getitem__,
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


# ----------------------------------------------------------------------------------------------

def _run(pb: Problem, inputs: dict, out):
    a = pb.attrs
    T = _T[pb.dtype]
    N, B, H, Hk, D, Dv, G = (pb.token_count, pb.batch_size, pb.num_heads, pb.kv_num_heads,
                             pb.head_size, pb.v_head_size, pb.group_size)
    NB, bs, MB = pb.num_blocks, pb.block_size, pb.max_blocks_per_seq
    latent = pb.latent
    x = {name: inputs.get(name) for name in INPUT_NAMES}

    out_arr = _check_out(out, pb, T)
    kc, vc = x["key_cache"], x["value_cache"]
    _check_cache(kc, "key_cache")
    if not latent:
        _check_cache(vc, "value_cache")

    result = out_arr if out_arr is not None else np.empty(pb.output_shape, dtype=T)
    qk = np.zeros(pb.output_qk_shape, dtype=np.float32) if a.qk_output else None
    lse = np.full(pb.lse_shape, -np.inf, dtype=np.float32) if a.return_lse else None

    def outputs():
        extra = tuple(x for x in (qk, lse) if x is not None)
        return (result, *extra) if extra else result

    if N == 0:
        return outputs()

    # --- split (packed QKV / separate / latent) -----------------------------------------------
    query = np.asarray(x["query"])
    if pb.packed_qkv:
        q_in = query[:, :H * D]
        k_in = query[:, H * D:(H + Hk) * D]
        v_in = query[:, (H + Hk) * D:]
    else:
        q_in, k_in, v_in = query, np.asarray(x["key"]), (None if latent else np.asarray(x["value"]))
    q = _f64(q_in).reshape(N, H, D)
    k = _f64(k_in).reshape(N, Hk, D)
    v_T = None if latent else np.ascontiguousarray(v_in).reshape(N, Hk, D).astype(T)

    # --- token ownership and validity (contract §4.4, architecture.md) ------------------------------
    cum = np.asarray(x["cumulative_sequence_length"]).astype(np.int64)
    past = np.asarray(x["past_seqlens"]).astype(np.int64)
    bt = np.asarray(x["block_table"]).astype(np.int64)
    t = np.arange(N, dtype=np.int64)
    b = _owner(cum, N, B)
    bc = np.minimum(b, B - 1)
    owned = (b < B) & (cum[bc] <= t)
    q_len = cum[1:] - cum[:-1]
    kv_len = past + q_len
    seq_valid = (past >= 0) & (q_len >= 0) & (kv_len <= MB * bs)
    valid = owned & seq_valid[bc]
    j = t - cum[bc]
    if pb.has_query_positions:
        p = np.asarray(x["query_positions"]).astype(np.int64)
    else:
        p = past[bc] + j
    valid &= p >= 0
    if a.do_rotary:
        valid &= p < pb.rotary_max_pos

    # --- prologue: QK-norm, RoPE, round to T ---------------------------------------------------
    if pb.has_qk_norm:
        eps = a.qk_norm_epsilon
        q = _rms_norm(q, _f64(x["q_norm_weight"]), eps)
        k = _rms_norm(k, _f64(x["k_norm_weight"]), eps)
    if a.do_rotary:
        pr = np.where(valid, p, 0)
        cos = _f64(np.asarray(x["cos_cache"])[pr])
        sin = _f64(np.asarray(x["sin_cache"])[pr])
        q = _rope(q, cos, sin, a.rotary_offset, pb.rotary_dim, a.rotary_interleaved)
        k = _rope(k, cos, sin, a.rotary_offset, pb.rotary_dim, a.rotary_interleaved)
    q = q.astype(T).astype(np.float64)      # attention reads Q as T values
    k_T = k.astype(T)                       # what a T cache stores / what is quantized

    # --- cache write (all tokens, before any read) ----------------------------------------------
    if pb.has_slot_mapping:
        slot = np.asarray(x["slot_mapping"]).astype(np.int64)
        write = valid & (slot >= 0) & (slot < NB * bs)
    else:
        lb = np.where(valid, p // bs, 0)
        in_row = lb < MB
        blk = np.where(valid & in_row, bt[bc, np.minimum(lb, MB - 1)], -1)
        write = valid & in_row & (blk >= 0) & (blk < NB)
        slot = np.where(write, blk * bs + p % bs, -1)
    ks = x["k_scale"] if pb.k_quant != "NONE" else None
    vs = x["v_scale"] if (not latent and pb.v_quant != "NONE") else None

    def encode(vals, scale):
        if pb.cache_kind == "T":
            return vals
        if pb.cache_kind == "int8":
            return helpers.quantize(vals, scale, "int8")
        return helpers.quantize(vals, scale, "float8e4m3fn", as_bytes=pb.fp8_as_bytes)

    k_flat = kc.reshape(NB * bs, Hk, D)
    v_flat = None if latent else vc.reshape(NB * bs, Hk, D)
    widx = np.flatnonzero(write)
    if widx.size:
        k_flat[slot[widx]] = encode(k_T[widx], ks)
        if not latent:
            v_flat[slot[widx]] = encode(v_T[widx], vs)

    # --- read setup -----------------------------------------------------------------------------
    def scale_array(s):
        if s is None:
            return None
        s = np.asarray(s, dtype=np.float32).astype(np.float64)
        return s.reshape(Hk, D) if s.ndim == 3 else s.reshape(1)

    ks64, vs64 = scale_array(ks), scale_array(vs)

    def dequant(codes, s64):
        if pb.cache_kind == "T":
            return codes.astype(np.float64)
        if pb.fp8_as_bytes:
            codes = codes.view(_F8)
        return codes.astype(np.float64) * s64

    W = a.local_window_size
    causal = bool(a.is_causal)
    sink = _f64(x["head_sink"]) if pb.has_head_sink else None
    bias = np.asarray(x["attention_bias"]) if pb.has_bias else None
    scale, softcap = pb.scale, a.softcap
    kvcap = pb.kv_capacity
    out64 = np.zeros((N, H, Dv), dtype=np.float64)

    # per-token key range [lo_t, hi_t) (the exact mask is applied per key below)
    kvl_t = np.where(valid, kv_len[bc], 0)
    hi_t = np.minimum(kvl_t, p + 1) if causal else kvl_t
    lo_t = np.maximum(p - W + 1, 0) if W > 0 else np.zeros(N, dtype=np.int64)
    hi_t = np.where(valid, np.maximum(hi_t, 0), 0)
    lo_t = np.where(valid, np.minimum(lo_t, hi_t), 0)
    attend = valid & (hi_t > lo_t)
    head_of = (np.arange(Hk)[:, None] * G + np.arange(G)[None, :])     # (Hk, G) -> query head

    def chunk(grid, real):
        """Attend the tokens of ``grid`` (U, M): row u holds tokens of one sequence, padded with
        repeats of its first token where ``real`` is False (computed, then discarded)."""
        U, M = grid.shape
        toks = grid[real]
        klo, khi = int(lo_t[toks].min()), int(hi_t[toks].max())
        if khi <= klo:
            return
        pos = np.arange(klo, khi, dtype=np.int64)
        Kc = pos.size
        gb = bc[grid[:, 0]]                                           # (U,) sequence of each row
        blk = bt[gb][:, pos // bs]                                    # (U, Kc)
        mapped = (blk >= 0) & (blk < NB)
        kslot = np.where(mapped, blk, 0) * bs + pos % bs
        # Keys no row of u may see (unmapped blocks, positions past its sequence's keys) are zeroed, so
        # whatever those slots hold (NaN, Inf) is multiplied by their zero probabilities harmlessly.
        seen = (mapped & (pos < kv_len[gb][:, None]))[..., None, None]  # (U, Kc, 1, 1)
        Kg = np.where(seen, dequant(k_flat[kslot], ks64), 0.0)        # (U, Kc, Hk, D)
        Vg = Kg[..., :Dv] if latent else np.where(seen, dequant(v_flat[kslot], vs64), 0.0)
        pi, ji = p[grid], j[grid]                                     # (U, M)
        mask = mapped[:, None, :] & (pos < kv_len[gb][:, None, None])  # (U, M, Kc)
        if causal:
            mask = mask & (pos <= pi[..., None])
        if W > 0:
            mask = mask & (pos > (pi - W)[..., None])
        if bias is not None:
            Bb, Hb, Qc, Kcb = bias.shape
            mask = mask & (ji < Qc)[..., None] & (pos < Kcb)
        # scores (U, Hk, M*G, Kc): query head h = kvh*G + g, row m*G + g
        qg = q[grid].reshape(U, M, Hk, G, D).transpose(0, 2, 1, 3, 4).reshape(U, Hk, M * G, D)
        s = np.matmul(qg, Kg.transpose(0, 2, 3, 1))
        s *= scale
        s5 = s.reshape(U, Hk, M, G, Kc)
        if bias is not None:
            bb = (gb if Bb > 1 else np.zeros(U, dtype=np.int64))[:, None, None, None, None]
            hh = (head_of if Hb > 1 else np.zeros((Hk, G), dtype=np.int64))[None, :, None, :, None]
            bj = np.minimum(ji, Qc - 1)[:, None, :, None, None]
            bk = np.minimum(pos, Kcb - 1)
            s5 += bias[bb, hh, bj, bk].astype(np.float64)
        if softcap > 0:
            s5 /= softcap
            np.tanh(s5, out=s5)
            s5 *= softcap
        m5 = mask[:, None, :, None, :]                                # (U, 1, M, 1, Kc)
        scores = np.where(m5, s5, 0.0) if a.qk_output == 1 else None
        np.copyto(s5, -np.inf, where=~m5)
        mx = s5.max(axis=-1, keepdims=True)
        if sink is not None:
            sk = sink[head_of][None, :, None, :, None]                # (1, Hk, 1, G, 1)
            mx = np.maximum(mx, sk)
        mx[~np.isfinite(mx)] = 0.0
        s5 -= mx
        np.exp(s5, out=s5)                                            # masked: exp(-inf) = 0
        den = s5.sum(axis=-1, keepdims=True)
        if lse is not None:                                           # log-sum-exp over the keys, sink left out
            with np.errstate(divide="ignore"):
                l5 = (np.log(den) + mx)[..., 0]                       # (U, Hk, M, G); -inf where no key
            lse[toks] = l5.transpose(0, 2, 1, 3).reshape(U, M, H)[real]
        if sink is not None:
            den += np.exp(sk - mx)
        den[den == 0] = 1.0
        s5 /= den                                                     # probabilities
        o = np.matmul(s, Vg.transpose(0, 2, 1, 3))                    # (U, Hk, M*G, Dv)
        o = o.reshape(U, Hk, M, G, Dv).transpose(0, 2, 1, 3, 4).reshape(U, M, H, Dv)
        out64[toks] = o[real]
        if qk is not None and klo < kvcap:
            w = min(khi, kvcap) - klo
            vals = scores if a.qk_output == 1 else s5
            vals = vals[..., :w].transpose(0, 2, 1, 3, 4).reshape(U, M, H, w)[real]   # (n, H, w)
            qk[:, toks, klo:klo + w] = vals.transpose(1, 0, 2).astype(np.float32)

    # Group attending tokens by sequence. A sequence with many tokens (prefill) gets rows of its own
    # (one key gather per chunk, shared by all its tokens); the others are packed into padded grids.
    aidx = np.flatnonzero(attend)
    if aidx.size:
        order = aidx[np.argsort(bc[aidx], kind="stable")]
        counts = np.bincount(bc[order], minlength=B)
        starts = np.concatenate([[0], np.cumsum(counts)])
        per_gather = Hk * (D + Dv)
        big = np.flatnonzero(counts >= GROUP_MIN_TOKENS)
        for sb in big:                                  # at most N / GROUP_MIN_TOKENS iterations
            toks = order[starts[sb]:starts[sb + 1]]
            span = int(hi_t[toks].max() - lo_t[toks].min())
            C = max(1, (CHUNK_ELEMENTS - span * per_gather) // max(1, span * H))
            for c0 in range(0, toks.size, C):
                part = toks[c0:c0 + C]
                chunk(part[None, :], np.ones((1, part.size), dtype=bool))
        small = np.flatnonzero((counts > 0) & (counts < GROUP_MIN_TOKENS))
        if small.size:
            M = int(counts[small].max())
            m = np.arange(M)
            real = m[None, :] < counts[small][:, None]
            grid = order[starts[small][:, None] + np.minimum(m[None, :], counts[small][:, None] - 1)]
            lo_s = np.where(real, lo_t[grid], np.iinfo(np.int64).max).min(axis=1)
            hi_s = np.where(real, hi_t[grid], 0).max(axis=1)
            span = int(hi_s.max() - lo_s.min())
            R = max(1, CHUNK_ELEMENTS // max(1, span * (M * H + per_gather)))
            for r0 in range(0, small.size, R):
                chunk(grid[r0:r0 + R], real[r0:r0 + R])

    result[...] = out64.reshape(N, H * Dv).astype(T)
    return outputs()
