"""Cases for the isolation rule of contract §4.4: a key a token does not admit never reaches that token.

:func:`build` makes a small paged call for one mask kind in which some tokens admit cache rows
that others do not: in the same sequence (causal future, left of the window, ``is_causal=0`` with a
window, outside the attention_bias capacity) and across the sequences of the batch (a block one
sequence maps within its keys and another maps beyond its kv_len, outside its window or beyond the
bias capacity, or not at all). :func:`poison` writes NaN or Inf (the NaN code for fp8, extreme
codes for int8, which have no NaN) into chosen rows: cache rows, or the new K/V of the token that
writes the row in this call. :func:`check_isolated` compares every token that admits no poisoned
row with the run without the poison, bit for bit (output, output_qk, lse). tests/test_reference_isolation.py
runs them on the reference, tests/gpu/test_isolation.py on the CUDA backends.
"""

from __future__ import annotations

import numpy as np

from tests import util

MASKS = ("causal", "window", "non_causal_window", "unmapped", "kv_len", "bias", "decode", "latent", "packed")
#: (id, make_case options) of the cache kinds
CACHES = (
    ("f16", dict(dtype="float16")),
    ("bf16", dict(dtype="bfloat16")),
    ("f32", dict(dtype="float32")),
    ("int8", dict(cache="int8", k_quant="PER_CHANNEL", v_quant="PER_TENSOR")),
    ("fp8", dict(cache="fp8", k_quant="PER_TENSOR", v_quant="PER_CHANNEL")),
    ("fp8_bytes", dict(cache="fp8_bytes", k_quant="PER_CHANNEL", v_quant="PER_CHANNEL")),
)


def _share(case, dst, src):
    """Sequence ``dst[0]``'s block-table entry ``dst[1]`` maps the physical block of ``src``."""
    bt = case.inputs["block_table"]
    bt[dst] = bt[src]


def build(rng, mask: str, **opts) -> util.Case:
    """A small call (block size 4) for one mask kind; ``opts`` go to util.make_case (cache kind, dtype,
    head sizes)."""
    common = {**dict(block_size=4, num_heads=4, kv_num_heads=2, head_size=32), **opts}
    if mask == "causal":          # causal future of the same chunk; seq 1 maps seq 0's keys beyond its own
        case = util.make_case(rng, q_lens=(7, 5, 1, 0), past=(3, 20, 9, 4), **common)
        _share(case, (2, 3), (1, 2))          # seq 2 positions 12..15 (past kv_len 10), seq 1 positions 8..11
    elif mask == "window":        # left of the window; seq 2 maps seq 0's in-window block left of its window
        case = util.make_case(rng, q_lens=(6, 3, 1), past=(10, 0, 25), window=4, **common)
        _share(case, (2, 1), (0, 2))          # seq 2 positions 4..7, seq 0 positions 8..11
    elif mask == "non_causal_window":
        case = util.make_case(rng, q_lens=(6, 3, 2), past=(8, 0, 5), window=3, is_causal=0, **common)
        _share(case, (2, 0), (0, 1))          # seq 2 positions 0..3 (3 inside one window), seq 0 positions 4..7
    elif mask == "unmapped":      # a block seq 0 no longer maps (-1) that seq 2 maps; an out-of-range id
        case = util.make_case(rng, q_lens=(3, 2, 4), past=(9, 14, 6), **common)
        NB = case.inputs["key_cache"].shape[0]
        _share(case, (2, 0), (0, 1))
        case.inputs["block_table"][0, 1] = -1
        case.inputs["block_table"][1, 2] = NB + 3
    elif mask == "kv_len":        # seq 1 maps seq 0's block beyond its own kv_len
        case = util.make_case(rng, q_lens=(2, 2, 1), past=(13, 6, 3), extra_cols=2, **common)
        _share(case, (1, 2), (0, 2))          # seq 1 positions 8..11 (kv_len 8), seq 0 positions 8..11
        _share(case, (2, 2), (0, 1))          # seq 2 positions 8..11 (kv_len 4), seq 0 positions 4..7
    elif mask == "bias":          # q_capacity 3, kv capacity 15: seq 0 maps seq 2's block beyond the capacity
        case = util.make_case(rng, q_lens=(5, 3, 1), past=(10, 2, 20), bias=(False, False), bias_pad=(-2, -6),
                              **common)
        _share(case, (0, 1), (2, 4))          # seq 0 positions 4..7, seq 2 positions 16..19 (>= 15)
    elif mask == "decode":        # one token per sequence: which sequences share the batch never matters
        case = util.make_case(rng, q_lens=(1, 1, 1, 1, 1), past=(3, 17, 30, 9, 22), window=6, **common)
        _share(case, (1, 3), (2, 1))          # seq 1 positions 12..15 (in its window), seq 2 positions 4..7
        _share(case, (4, 2), (1, 4))          # seq 4 positions 8..11 (left of its window), seq 1 positions 16..19
    elif mask == "latent":        # LATENT: V is the leading channels of the K row
        latent = {**common, **dict(num_heads=4, head_size=48, latent=True, v_head_size=32, scale=0.2)}
        case = util.make_case(rng, q_lens=(5, 2, 1), past=(6, 9, 14), window=5, **latent)
        _share(case, (2, 1), (1, 1))          # seq 2 positions 4..7 (left of its window), seq 1 positions 4..7
    elif mask == "packed":        # packed QKV: the new K/V are columns of query
        case = util.make_case(rng, q_lens=(6, 3), past=(5, 8), packed=True, **common)
        _share(case, (1, 3), (0, 0))          # seq 1 positions 12..15 (kv_len 11), seq 0 positions 0..3
    else:
        raise ValueError(mask)
    return case


def choose(rng, case: util.Case, dense: util.DenseResult, kind: str = "partial") -> set:
    """Flat cache slots to poison: every slot no token admits, and one slot that some tokens admit
    and others do not: ``kind="partial"``, admitted by some tokens of a sequence and not by others
    of that sequence; ``kind="cross"``, admitted by a sequence and mapped in the block table of
    another that does not admit it. Where a case has no slot of that kind, the other kind."""
    NB, bs = case.inputs["key_cache"].shape[:2]
    cum, bt = case.inputs["cumulative_sequence_length"], case.inputs["block_table"]
    B = len(cum) - 1
    admitted = dense.admitted
    chosen = set(range(NB * bs)) - set().union(*admitted)
    per_seq = [[admitted[t] for t in range(cum[b], cum[b + 1]) if admitted[t]] for b in range(B)]
    some = [set().union(*sets) for sets in per_seq]
    partial = sorted({s for sets, any_ in zip(per_seq, some) if len(sets) > 1 for s in any_ - set.intersection(*sets)})
    cross = set()
    for b in range(B):
        for other in range(B):
            mapped = {int(blk) * bs + o for blk in bt[other] if 0 <= blk < NB for o in range(bs)}
            if other != b:
                cross |= (some[b] & mapped) - some[other]
    pools = (partial, sorted(cross)) if kind == "partial" else (sorted(cross), partial)
    pool = pools[0] or pools[1]
    if pool:
        chosen.add(int(rng.choice(pool)))
    return chosen


def poison(rng, case: util.Case, dense: util.DenseResult, slots: set) -> util.Case:
    """A copy of ``case`` with NaN/Inf in ``slots``: the cache row, or the new K/V of the token that
    writes that slot in this call (its write would replace a poisoned cache row)."""
    bad = case.copy()
    x = bad.inputs
    kc, vc = x["key_cache"], x["value_cache"]
    NB, bs = kc.shape[:2]
    writer = {int(s): t for t, s in enumerate(dense.slot) if s >= 0}
    latent = vc is None
    H, Hk = case.attrs["num_heads"], kc.shape[2]
    D = kc.shape[3]

    def spoil(row):
        """NaN/Inf (or the closest the element type has) into some channels of every head of ``row``."""
        for h in range(row.shape[0]):
            cols = rng.choice(row.shape[1], size=int(rng.integers(1, 4)), replace=False)
            if row.dtype == np.int8:
                row[h, cols] = rng.choice([127, -128], size=cols.size)
            elif row.dtype == np.uint8:
                row[h, cols] = rng.choice([0x7F, 0xFF], size=cols.size)
            elif row.dtype == util.F8:
                row[h, cols] = np.nan
            else:
                row[h, cols] = rng.choice([np.nan, np.inf, -np.inf], size=cols.size)

    for s in sorted(slots):
        if s in writer:
            t = writer[s]
            if x["key"] is None:          # packed QKV: K and V are columns of query
                q = x["query"]
                k_row = q[t, H * D:(H + Hk) * D].reshape(Hk, D)
                v_row = q[t, (H + Hk) * D:].reshape(Hk, D)
            else:
                k_row = x["key"][t].reshape(-1, D)
                v_row = None if latent else x["value"][t].reshape(Hk, D)
            spoil(k_row)
            if v_row is not None:
                spoil(v_row)
        else:
            spoil(kc[s // bs, s % bs])
            if not latent:
                spoil(vc[s // bs, s % bs])
    return bad


def _bits(a) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.view(np.uint8).reshape(a.shape[0], -1) if a.ndim else a.view(np.uint8)


def check_isolated(clean, dirty, dense: util.DenseResult, slots: set, *, qk_output: int, return_lse: bool,
                   tokens=None) -> dict:
    """Every token admitting no slot of ``slots`` is bit-identical in output, output_qk row and lse.

    ``clean`` / ``dirty`` are what the two calls returned (host arrays). Returns counts of checked
    tokens and of tokens admitting a poisoned slot whose result changed (the poison was read).
    """
    out_c, qk_c, lse_c = util.split_result(clean, qk_output, return_lse)
    out_d, qk_d, lse_d = util.split_result(dirty, qk_output, return_lse)
    N = out_c.shape[0]
    exposed = [bool(dense.admitted[t] & slots) for t in range(N)]
    checked = changed = 0
    for t in (range(N) if tokens is None else tokens):
        same = np.array_equal(_bits(out_c[t:t + 1]), _bits(out_d[t:t + 1]))
        if qk_c is not None:
            same_qk = np.array_equal(_bits(np.ascontiguousarray(qk_c[:, t])), _bits(np.ascontiguousarray(qk_d[:, t])))
        else:
            same_qk = True
        same_lse = lse_c is None or np.array_equal(_bits(lse_c[t:t + 1]), _bits(lse_d[t:t + 1]))
        if exposed[t]:
            changed += not (same and same_qk and same_lse)
            continue
        assert same, f"token {t} admits no poisoned row, but its output changed"
        assert same_qk, f"token {t} admits no poisoned row, but its output_qk row changed"
        assert same_lse, f"token {t} admits no poisoned row, but its lse changed"
        checked += 1
    return dict(checked=checked, exposed=sum(exposed), changed=changed)


def shares_a_sequence(case: util.Case, dense: util.DenseResult, slots: set) -> bool:
    """Some sequence has a token that admits a poisoned slot and one that admits none (same chunk)."""
    cum = case.inputs["cumulative_sequence_length"]
    for b in range(len(cum) - 1):
        flags = {bool(dense.admitted[t] & slots) for t in range(cum[b], cum[b + 1]) if dense.admitted[t]}
        if flags == {True, False}:
            return True
    return False
