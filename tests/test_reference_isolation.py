"""A key a token does not admit never reaches that token, on the NumPy reference (contract §4.4).

NaN and Inf (NaN codes for fp8, extreme codes for int8) go into every cache row no token admits and
into rows that some tokens admit and others do not: in the same sequence and chunk (causal future,
left of the window, is_causal=0 with a window, outside the bias capacity) and across the sequences of
the batch (unmapped blocks, beyond kv_len, other windows); written through the cache or through the
new K/V of the token that writes the row. Every token that admits none of them keeps its output,
output_qk row (qk_output 1 and 2) and lse bit for bit (tests/isolation.py builds the cases).
"""

import numpy as np
import pytest

import cupa.reference as reference
from tests import isolation, util

#: one round per kind of poisoned slot (isolation.choose)
ROUNDS = ("partial", "cross", "partial", "cross")


def _run_pair(case, dirty, qk_output):
    clean = case.copy().run(qk_output=qk_output, return_lse=True)
    poisoned = dirty.copy().run(qk_output=qk_output, return_lse=True)
    return clean, poisoned


def _check(rng, mask, cache_opts):
    checked = changed = same_sequence = 0
    for kind in ROUNDS:
        case = isolation.build(rng, mask, **cache_opts)
        dense = util.dense_attention(case)
        slots = isolation.choose(rng, case, dense, kind)
        dirty = isolation.poison(rng, case, dense, slots)
        same_sequence += isolation.shares_a_sequence(case, dense, slots)
        for qk_output in (0, 1, 2):
            clean, poisoned = _run_pair(case, dirty, qk_output)
            stats = isolation.check_isolated(clean, poisoned, dense, slots, qk_output=qk_output, return_lse=True)
            assert stats["exposed"] > 0, "no token admits a poisoned row: the case tests nothing"
            checked += stats["checked"]
            changed += stats["changed"]
    assert checked > 0, "every token admits a poisoned row"
    assert changed > 0, "no token that admits a poisoned row changed: the poison was never read"
    if mask != "decode":
        assert same_sequence > 0, "no sequence with both an exposed and a clean token"


@pytest.mark.parametrize("cache", [c[0] for c in isolation.CACHES])
@pytest.mark.parametrize("mask", isolation.MASKS)
def test_rows_a_token_does_not_admit_never_reach_it(rng, mask, cache):
    _check(rng, mask, dict(isolation.CACHES)[cache])


@pytest.mark.parametrize("cache", ["f16", "fp8_bytes"])
@pytest.mark.parametrize("mask", ["causal", "window", "non_causal_window", "bias", "decode"])
def test_isolation_with_small_grids_and_tiles(rng, monkeypatch, mask, cache):
    """Rows of a few tokens, tiles of a few keys: a poisoned row shares tiles and grids with clean ones."""
    monkeypatch.setattr(reference, "SCORE_ELEMENTS", 600)
    monkeypatch.setattr(reference, "TILE_ELEMENTS", 3 * 64)
    _check(rng, mask, dict(isolation.CACHES)[cache])


def test_every_unadmitted_row_nan(rng):
    """A cache full of NaN outside the admitted rows (an uninitialized torch.empty cache) changes nothing."""
    case = isolation.build(rng, "window")
    dense = util.dense_attention(case)
    kc, vc = case.inputs["key_cache"], case.inputs["value_cache"]
    NB, bs = kc.shape[:2]
    dirty = case.copy()
    for s in set(range(NB * bs)) - set().union(*dense.admitted) - set(int(x) for x in dense.slot if x >= 0):
        dirty.inputs["key_cache"][s // bs, s % bs] = np.nan
        dirty.inputs["value_cache"][s // bs, s % bs] = np.nan
    for qk_output in (0, 1, 2):
        clean, poisoned = _run_pair(case, dirty, qk_output)
        for a, b in zip(clean, poisoned):
            np.testing.assert_array_equal(isolation._bits(a), isolation._bits(b))
