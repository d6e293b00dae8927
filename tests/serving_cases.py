"""Test kit of the serving toolkit: a toy model, a driver that runs steps through cupa, a dense oracle.

* :class:`ToyModel` gives every layer's q / k / v as a fixed function of (token, position), rounded
  to T, as a real model does: two sequences with the same tokens get the same keys, so a shared
  prefix, a recomputed prefix and a private prefix hold the same values.
* :class:`Driver` owns a :class:`cupa.serving.KVCacheManager`, remembers every sequence's tokens (the
  test's side: the toolkit keeps none), builds each step, runs every layer through
  ``cupa.PagedAttention`` (NumPy, or CuPy with ``xp=cupy``) and returns the outputs per layer.
* :func:`dense_attention` is float64 softmax attention over a sequence's whole history, independent
  of blocks, slots and tables; :meth:`Driver.check_dense` compares a step's outputs with it.
"""

from __future__ import annotations

import math

import numpy as np

import cupa
from cupa import serving
from tests import util


class ToyModel:
    """q, k, v of every layer: ``T(embedding[layer, token] + position_embedding[layer, position])``."""

    def __init__(self, rng, num_layers, num_heads, kv_num_heads, head_size, dtype="float32", vocab=97,
                 max_position=512, value_scale=1.0):
        self.H, self.Hk, self.D = num_heads, kv_num_heads, head_size
        self.T = util.T_DTYPES[dtype]
        width = (num_heads + 2 * kv_num_heads) * head_size
        self.emb = rng.standard_normal((num_layers, vocab, width))
        self.pos = 0.5 * rng.standard_normal((num_layers, max_position, width))
        self.emb[:, :, (num_heads + kv_num_heads) * head_size:] *= value_scale

    def qkv(self, layer, tokens, positions):
        x = (self.emb[layer][tokens] + self.pos[layer][positions]).astype(self.T)
        a, b = self.H * self.D, (self.H + self.Hk) * self.D
        return np.ascontiguousarray(x[:, :a]), np.ascontiguousarray(x[:, a:b]), np.ascontiguousarray(x[:, b:])


def dense_attention(q, keys, values, positions, num_heads, window=-1, sink=None, scale=None):
    """float64 causal attention of queries ``q`` (n, H*D) at ``positions`` over ``keys``/``values``
    (L, Hk, D): token t admits keys k <= p_t with p_t - window < k (window > 0)."""
    n = q.shape[0]
    L, Hk, D = keys.shape
    H, G = num_heads, num_heads // keys.shape[1]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    qh = np.asarray(q, np.float64).reshape(n, H, D)
    out = np.zeros((n, H, D))
    k_all = np.arange(L)
    for t in range(n):
        p = int(positions[t])
        ok = k_all <= p
        if window > 0:
            ok &= k_all > p - window
        for h in range(H):
            s = scale * keys[ok, h // G] @ qh[t, h]
            m = s.max() if sink is None else max(s.max(), float(sink[h]))
            e = np.exp(s - m)
            den = e.sum() + (0.0 if sink is None else math.exp(float(sink[h]) - m))
            out[t, h] = (e / den) @ values[ok, h // G]
    return out.reshape(n, H * D)


def to_host(x):
    if isinstance(x, np.ndarray):
        return x
    if type(x).__module__.split(".")[0] == "torch":
        return x.cpu().numpy()
    import cupy

    return cupy.asnumpy(x)


class Driver:
    """Runs a KVCacheManager's steps through cupa with a ToyModel and keeps every sequence's tokens.

    Parameters
    ----------
    cache_kw : dict
        KVCache arguments besides the library (``layers``, ``kv_num_heads``, ...).
    manager_kw : dict
        KVCacheManager arguments besides the cache.
    xp : module, default numpy
        numpy or cupy: where the caches and step arrays live.
    sink : bool or list
        Give every layer a head_sink (random, or the given arrays, one per layer).
    scales : callable, optional
        ``scales(layer) -> (k_scale, v_scale)`` values for a quantized cache.
    """

    def __init__(self, rng, model, num_heads, cache_kw, manager_kw, xp=np, sink=False, scales=None):
        self.rng, self.model, self.H, self.xp = rng, model, num_heads, xp
        self.cache = serving.KVCache(library=xp.__name__, **cache_kw)
        self.m = serving.KVCacheManager(self.cache, **manager_kw)
        T = model.T
        self.ops = [cupa.PagedAttention(num_heads=num_heads, **self.cache.attributes(l))
                    for l in range(self.cache.num_layers)]
        if isinstance(sink, list):
            self.sinks = sink
        else:
            self.sinks = [(rng.standard_normal(num_heads) * 2).astype(T) if sink else None
                          for _ in range(self.cache.num_layers)]
        if scales is not None:
            for l in range(self.cache.num_layers):
                for arr, val in zip((self.cache.k_scales[l], self.cache.v_scales[l]), scales(l)):
                    if arr is not None:
                        arr[...] = xp.asarray(val)
        self.tokens: dict = {}       # seq -> list of every token (prompt, generated, pending)
        self.sent: dict = {}         # seq -> tokens appended since the last step

    # -- sequences (the test's side mirrors the toolkit's) ------------------------------------------
    def add(self, seq, prompt, **kw):
        prompt = [int(t) for t in prompt]
        cached = self.m.add(seq, prompt, **kw)
        self.tokens[seq] = prompt[:cached]
        self.sent[seq] = []
        return cached, prompt[cached:]

    def append(self, seq, tokens):
        tokens = [int(t) for t in tokens]
        self.m.append(seq, tokens)
        self.tokens[seq] += tokens
        self.sent[seq] += tokens

    def append_decode(self, tokens=None):
        ids = self.m.seq_ids
        tokens = self.rng.integers(0, self.model.emb.shape[1], len(ids)) if tokens is None else np.asarray(tokens)
        self.m.append_decode(tokens)
        for s, t in zip(ids, tokens.tolist()):
            self.tokens[s].append(t)
            self.sent[s].append(t)

    def rollback(self, seq, n):
        self.m.rollback(seq, n)
        if n:
            del self.tokens[seq][-n:]
            self.sent[seq] = self.sent[seq][:max(0, len(self.sent[seq]) - n)]

    def finish(self, seq):
        self.m.finish(seq)
        del self.tokens[seq], self.sent[seq]

    def preempt(self, seq):
        self.m.preempt(seq)
        self.sent.pop(seq)
        return self.tokens.pop(seq)

    # -- steps -----------------------------------------------------------------------------------------
    def step(self, **build_kw):
        """Build and run one step on every layer; returns (step, packed tokens, outputs per layer)."""
        step = self.m.build_step(**build_kw)
        packed = [t for s in step.seq_ids for t in self.sent[s]]
        for s in step.seq_ids:
            self.sent[s] = []
        N = len(packed)
        assert N == step.token_count
        positions = to_host(step.query_positions)[:N].astype(np.int64)
        cap = int(step.query_positions.shape[0])
        tok = np.asarray(packed, dtype=np.int64)
        outs = []
        for l in range(self.cache.num_layers):
            q, k, v = self.model.qkv(l, tok, positions)
            if cap > N:   # fixed-capacity step: padding tokens get arbitrary values (they belong to no sequence)
                pad = lambda a: np.concatenate([a, util._rand_T(self.rng, (cap - N, a.shape[1]), a.dtype)])
                q, k, v = pad(q), pad(k), pad(v)
            extra = {} if self.sinks[l] is None else {"head_sink": self.xp.asarray(self.sinks[l])}
            out = step.attention(self.ops[l], l, self.xp.asarray(q), self.xp.asarray(k), self.xp.asarray(v), **extra)
            outs.append(to_host(out))
        return step, tok, outs

    def history(self, layer, seq):
        """float64 keys and values of every position of ``seq`` in ``layer``, as the cache holds them."""
        toks = np.asarray(self.tokens[seq], dtype=np.int64)
        _, k, v = self.model.qkv(layer, toks, np.arange(len(toks)))
        c = self.cache
        shape = (len(toks), c.kv_num_heads, c.head_size)
        k, v = k.reshape(shape), v.reshape(shape)
        if not c.cache_dtype.quantized:
            return k.astype(np.float64), v.astype(np.float64)
        name = c.cache_dtype.name
        ks, vs = to_host(c.k_scales[layer]), to_host(c.v_scales[layer])
        k = cupa.dequantize(cupa.quantize(k, ks, name), ks).astype(np.float64)
        v = cupa.dequantize(cupa.quantize(v, vs, name), vs).astype(np.float64)
        return k, v

    def check_dense(self, step, outs, tol=1e-5):
        """Every token's output of every layer against dense attention over its sequence's history."""
        positions = to_host(step.query_positions)
        cum = to_host(step.cumulative_sequence_length)
        for l in range(self.cache.num_layers):
            window = self.cache.groups[self.cache.group_of(l)].kind.window
            for b, s in enumerate(step.seq_ids):
                lo, hi = int(cum[b]), int(cum[b + 1])
                if hi == lo:
                    continue
                pos = positions[lo:hi].astype(np.int64)
                toks = np.asarray(self.tokens[s], dtype=np.int64)
                q, _, _ = self.model.qkv(l, toks[pos], pos)
                keys, values = self.history(l, s)
                want = dense_attention(q, keys, values, pos, self.H, window, self.sinks[l])
                err = util.rel_err(outs[l][lo:hi], want)
                assert err <= tol, f"layer {l}, sequence {s!r}, positions {pos.tolist()}: relative error {err:.3g}"


def live_kv(driver, seq, layer):
    """{position: (key row, value row)} of every position of ``seq`` the block table of ``layer``
    maps, read from the cache (host copies, bytes as stored)."""
    c, m = driver.cache, driver.m
    bt = m.block_table(seq, c.group_of(layer))
    kc, vc = (to_host(a) if a is not None else None for a in c.layer_arrays(layer))
    bs = c.block_size
    out = {}
    for p in range(m.length(seq)):
        if p // bs < len(bt) and bt[p // bs] >= 0:
            blk = int(bt[p // bs])
            out[p] = (kc[blk, p % bs].tobytes(), None if vc is None else vc[blk, p % bs].tobytes())
    return out


def same_bits(a, b, what="output"):
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {a.shape} {a.dtype} vs {b.shape} {b.dtype}"
    assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), f"{what}: not bit-identical"
