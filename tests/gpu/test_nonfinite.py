"""A NaN or Inf in a key a token does not admit never reaches that token's output (contract §4.4).

Each case writes Inf or NaN into K or V rows (new K/V inputs, or cache rows of the past; fp8 cache
codes 0x7F) that some tokens admit and others do not -- tokens of the same prefill tile or work item,
of the same decode chunk, of other sequences -- and runs one backend (``cupa.Options(backend=...)``)
on the poisoned inputs and on the same inputs without the poison. Every token that admits none of
the poisoned keys must give the same bits in both runs (and be finite), and the clean run must match
the NumPy reference. Tokens that admit a poisoned key get an unspecified result and are not checked.
"""

import numpy as np
import pytest

import cupa
from tests import util

pytestmark = pytest.mark.gpu


def capability(cp) -> tuple:
    cc = cp.cuda.Device().compute_capability
    return int(cc[:-1]), int(cc[-1])


#: the prefill backends, and the wgmma prefill with its V tiles cleaned by the copier warps
PREFILL_BACKENDS = ["prefill", "prefill_wgmma", "prefill_wgmma[copier_clean]"]


def backend_or_skip(cp, backend):
    if backend.startswith("prefill_wgmma") and capability(cp) != (9, 0):
        pytest.skip("the wgmma prefill needs compute capability 9.0")
    return backend


def positions_of(inputs):
    """(sequence, position) of every packed token (query_positions when given)."""
    cum, past = inputs["cumulative_sequence_length"], inputs["past_seqlens"]
    seq = np.repeat(np.arange(len(past)), np.diff(cum))
    pos = inputs.get("query_positions")
    if pos is None:
        pos = np.concatenate([np.arange(p, p + q) for p, q in zip(past, np.diff(cum))]).astype(np.int64)
    return seq, np.asarray(pos, dtype=np.int64)


def untouched(inputs, attrs, poisoned) -> np.ndarray:
    """(N,) bool: the token admits none of ``poisoned`` ({sequence: logical positions}), by contract §4.2
    (kv_len, causal, window; an invalid token admits nothing)."""
    cum, past = inputs["cumulative_sequence_length"], inputs["past_seqlens"]
    seq, pos = positions_of(inputs)
    window, causal = attrs.get("local_window_size", -1), attrs.get("is_causal", 1)
    ok = np.ones(len(seq), dtype=bool)
    for t, (b, p) in enumerate(zip(seq, pos)):
        kv_len = int(past[b]) + int(cum[b + 1] - cum[b])
        if p < 0:
            continue
        for k in poisoned.get(int(b), ()):
            if k < kv_len and (not causal or k <= p) and (window <= 0 or p - window < k):
                ok[t] = False
    return ok


def poison_cache_rows(inputs, b, positions, value, block_size):
    """Every head of the cache rows of sequence b's logical positions (K and V) set to ``value``
    (fp8 codes: 0x7F, a NaN)."""
    bt = inputs["block_table"]
    for name in ("key_cache", "value_cache"):
        cache = inputs[name]
        for k in positions:
            blk = int(bt[b, k // block_size])
            assert blk >= 0
            cache[blk, k % block_size] = 0x7F if cache.dtype == np.uint8 else value


def run(cp, inputs, attrs, backend):
    dev = util.to_device(cp, {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in inputs.items()})
    out = cupa.paged_attention(**dev, **attrs, options=util.backend_options(backend))
    return cp.asnumpy(out)


def check_isolated(cp, clean, poisoned_inputs, attrs, poisoned, backend, *, dtype="float16"):
    """The clean run against the reference; the untouched tokens' rows bit-identical (and finite)
    between the clean and the poisoned run. Returns how many tokens were checked."""
    ref = cupa.paged_attention(**{k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in clean.items()},
                               **attrs)
    want = run(cp, clean, attrs, backend)
    assert util.rel_err(want, ref) < util.TOLERANCE[dtype]
    got = run(cp, poisoned_inputs, attrs, backend)
    keep = untouched(clean, attrs, poisoned)
    assert keep.any() and not keep.all(), "the case must have tokens on both sides"
    bits = np.uint16 if want.dtype.itemsize == 2 else np.uint32
    assert np.isfinite(got[keep].astype(np.float32)).all(), "a token that admits no poisoned key got Inf/NaN"
    same = np.all(got[keep].view(bits) == want[keep].view(bits), axis=1)
    assert same.all(), f"{(~same).sum()} of {keep.sum()} untouched tokens changed (tokens {np.flatnonzero(keep)[~same][:8]})"
    return int(keep.sum())


@pytest.mark.parametrize("backend", PREFILL_BACKENDS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("which", ["key", "value"])
@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_prefill_new_rows_of_the_causal_future(cp, rng, backend, dtype, which, value):
    """Causal prefill without a past: new K or V rows of tokens in the middle of a tile (and of a
    128-row work item) are Inf/NaN; the earlier tokens of the same tile never admit them."""
    backend_or_skip(cp, backend)
    clean, attrs = util.build(rng, q_lens=[150, 70, 0, 97], past=[0, 0, 0, 0], H=16, Hk=4, D=128, dtype=dtype)
    bad = {0: [37, 100, 149], 1: [5], 3: [64]}
    poisoned = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in clean.items()}
    cum = clean["cumulative_sequence_length"]
    for b, positions in bad.items():
        for k in positions:
            poisoned[which][cum[b] + k] = value  # (no past: position k is new token k)
    assert check_isolated(cp, clean, poisoned, attrs, bad, backend, dtype=dtype) > 100


@pytest.mark.parametrize("backend", PREFILL_BACKENDS)
def test_prefill_poisoned_rows_among_many_work_items(cp, rng, backend):
    """Many more work items than SMs (the wgmma prefill's CTAs loop over several), with poisoned V rows
    near the end of each sequence (heavy items, run first), in the middle and near the start (light
    items, run last): every token before a poisoned key keeps its bits."""
    backend_or_skip(cp, backend)
    clean, attrs = util.build(rng, q_lens=[1024, 1024, 1000, 1024], past=[0, 0, 0, 0], H=16, Hk=4, D=128,
                              block_size=256)
    bad = {0: [40, 500, 1000], 1: [700, 1020], 2: [77], 3: [12, 999]}
    poisoned = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in clean.items()}
    cum = clean["cumulative_sequence_length"]
    for i, (b, positions) in enumerate(bad.items()):
        for k in positions:
            poisoned["value"][cum[b] + k] = np.inf if i % 2 else np.nan
    assert check_isolated(cp, clean, poisoned, attrs, bad, backend) > 800  # (40 + 700 + 77 + 12 tokens)


@pytest.mark.parametrize("backend", PREFILL_BACKENDS)
@pytest.mark.parametrize("is_causal", [1, 0])
@pytest.mark.parametrize("dtype,cache", [("float16", "T"), ("bfloat16", "T"), ("float16", "fp8")])
def test_prefill_past_rows_left_of_a_window(cp, rng, backend, is_causal, dtype, cache):
    """Chunked prefill with a window: cache rows of the past that the first tokens of a tile still see
    and the later ones no longer do (both with is_causal=1 and 0), and rows of another sequence."""
    backend_or_skip(cp, backend)
    bs = 16
    clean, attrs = util.build(rng, q_lens=[64, 90, 33], past=[300, 40, 7], H=16, Hk=4, D=128, dtype=dtype,
                            cache=cache, window=48, is_causal=is_causal, block_size=bs)
    bad = {0: [260, 280, 299], 1: [10, 20], 2: [3]}
    poisoned = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in clean.items()}
    for b, positions in bad.items():
        poison_cache_rows(poisoned, b, positions, np.nan, bs)
    checked = check_isolated(cp, clean, poisoned, attrs, bad, backend, dtype=dtype)
    assert checked > 50


@pytest.mark.parametrize("backend", PREFILL_BACKENDS)
def test_prefill_rows_without_keys_write_zeros(cp, rng, backend):
    """Tokens with an invalid (negative) position admit no key and output zeros, also in a tile whose
    other rows admit a V row holding NaN (the rows without keys are not masked on such tiles)."""
    backend_or_skip(cp, backend)
    bs = 16
    clean, attrs = util.build(rng, q_lens=[80, 40], past=[200, 0], H=16, Hk=4, D=128, block_size=bs,
                            query_positions=True)
    pos = clean["query_positions"]
    pos[3:80:5] = -1  # invalid tokens in every tile of sequence 0
    bad = {0: [150]}  # admitted by every valid token of sequence 0
    poisoned = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in clean.items()}
    poison_cache_rows(poisoned, 0, bad[0], np.nan, bs)
    check_isolated(cp, clean, poisoned, attrs, bad, backend)
    got = run(cp, poisoned, attrs, backend)
    assert not got[pos < 0].any(), "a token without admitted keys must output zeros"


@pytest.mark.parametrize("dtype,cache", [("float16", "T"), ("bfloat16", "fp8"), ("float32", "T")])
@pytest.mark.parametrize("is_causal", [1, 0])
def test_decode_rows_outside_the_window(cp, rng, dtype, cache, is_causal):
    """The decode kernels (tensor-core and CUDA-core loops): cache rows of a chunk that one token of a
    sequence admits and another does not (window edges, is_causal=0 included); masked rows of a key
    tile are zero-filled, so no staged row reaches a token that does not admit it."""
    bs = 16
    clean, attrs = util.build(rng, q_lens=[3, 1, 2, 1], past=[50, 10, 300, 70], H=8, Hk=2, D=128, dtype=dtype,
                            cache=cache, window=20, is_causal=is_causal, block_size=bs)
    bad = {0: [31, 33], 2: [282, 283, 290], 3: [49, 50]}
    poisoned = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in clean.items()}
    for b, positions in bad.items():
        poison_cache_rows(poisoned, b, positions, np.inf if dtype == "float32" else np.nan, bs)
    check_isolated(cp, clean, poisoned, attrs, bad, "decode", dtype=dtype)
