"""cupa.contract.validate_data: the host-side checks of the index inputs' values and the scales.

Every rule gets a call that breaks it once (at a random entry) and must raise a PagedAttentionError
naming the input and the index of that entry; well-formed calls of every feature pass.
"""

import re

import numpy as np
import pytest

import cupa
from cupa.contract import validate_data
from tests import util


def _problem(case):
    return cupa.PagedAttention(**case.attrs).plan(**{k: v for k, v in case.inputs.items() if v is not None}).problem


def _raises(case, name, index):
    with pytest.raises(cupa.PagedAttentionError) as info:
        validate_data(_problem(case), case.inputs)
    msg = str(info.value)
    assert msg.startswith(f"{name}: got "), msg
    assert re.search(rf"at index {re.escape(str(index))};", msg), msg
    return msg


WELL_FORMED = [
    dict(),
    dict(rotary="half", positions="explicit", slot_mapping="skip"),
    dict(rotary="interleaved", positions="random", cache="int8", k_quant="PER_CHANNEL"),
    dict(cache="fp8_bytes", slot_mapping="derived", q_lens=(0, 3, 0), past=(4, 0, 9)),
    dict(latent=True, num_heads=4, head_size=64, scale=0.2, cache="fp8", unused_cols="neg"),
]


@pytest.mark.parametrize("opts", WELL_FORMED)
def test_well_formed_calls_pass(rng, opts):
    case = util.make_case(rng, **opts)
    before = case.copy()
    validate_data(_problem(case), case.inputs)
    for name, x in case.inputs.items():     # nothing is modified
        if isinstance(x, np.ndarray):
            np.testing.assert_array_equal(x.view(np.uint8), before.inputs[name].view(np.uint8))


def test_cum_must_start_at_zero(rng):
    case = util.make_case(rng, q_lens=(3, 2), past=(1, 5))
    case.inputs["cumulative_sequence_length"][0] = 1
    _raises(case, "cumulative_sequence_length", 0)


def test_cum_must_not_decrease(rng):
    case = util.make_case(rng, q_lens=(3, 2, 4, 1), past=(1, 5, 0, 2))
    b = int(rng.integers(1, 4))
    cum = case.inputs["cumulative_sequence_length"]
    cum[b] = cum[b + 1] + 1
    _raises(case, "cumulative_sequence_length", b + 1)


def test_cum_must_end_at_token_count(rng):
    case = util.make_case(rng, q_lens=(3, 2, 4), past=(1, 5, 0))
    case.inputs["cumulative_sequence_length"][-1] -= 1
    _raises(case, "cumulative_sequence_length", 3)


def test_past_seqlens_non_negative(rng):
    case = util.make_case(rng, q_lens=(3, 2, 4, 1), past=(1, 5, 0, 2))
    b = int(rng.integers(4))
    case.inputs["past_seqlens"][b] = -int(rng.integers(1, 9))
    _raises(case, "past_seqlens", b)


def test_kv_len_within_block_table_capacity(rng):
    case = util.make_case(rng, q_lens=(3, 2, 4), past=(1, 5, 0))
    b = int(rng.integers(3))
    capacity = case.inputs["block_table"].shape[1] * 16
    case.inputs["past_seqlens"][b] = capacity - int(case.q_lens[b]) + 1
    msg = _raises(case, "past_seqlens", b)
    assert str(capacity) in msg
    case.inputs["past_seqlens"][b] -= 1                  # exactly full: fine
    validate_data(_problem(case), case.inputs)


@pytest.mark.parametrize("value", ["minus2", "num_blocks", "huge"])
def test_block_ids_in_range(rng, value):
    case = util.make_case(rng, q_lens=(3, 2, 4), past=(20, 5, 0))
    bt = case.inputs["block_table"]
    NB = case.inputs["key_cache"].shape[0]
    b, i = int(rng.integers(bt.shape[0])), int(rng.integers(bt.shape[1]))
    bt[b, i] = {"minus2": -2, "num_blocks": NB, "huge": 2 ** 31 - 1}[value]
    _raises(case, "block_table", (b, i))
    bt[b, i] = -1                                         # unmapped: fine
    validate_data(_problem(case), case.inputs)


@pytest.mark.parametrize("value", ["minus2", "end", "huge"])
def test_slots_in_range(rng, value):
    case = util.make_case(rng, q_lens=(3, 2, 4), past=(20, 5, 0), slot_mapping="derived")
    NB, bs = case.inputs["key_cache"].shape[:2]
    t = int(rng.integers(case.token_count))
    case.inputs["slot_mapping"][t] = {"minus2": -2, "end": NB * bs, "huge": 2 ** 31 - 1}[value]
    _raises(case, "slot_mapping", t)
    case.inputs["slot_mapping"][t] = -1                   # skipped write: fine
    validate_data(_problem(case), case.inputs)


def test_query_positions_non_negative(rng):
    case = util.make_case(rng, q_lens=(3, 2, 4), past=(20, 5, 0), positions="explicit")
    t = int(rng.integers(case.token_count))
    case.inputs["query_positions"][t] = -1
    _raises(case, "query_positions", t)


def test_query_positions_within_cos_cache(rng):
    case = util.make_case(rng, q_lens=(3, 2, 4), past=(20, 5, 0), positions="explicit", rotary="half")
    rows = case.inputs["cos_cache"].shape[0]
    t = int(rng.integers(case.token_count))
    case.inputs["query_positions"][t] = rows
    msg = _raises(case, "query_positions", t)
    assert "cos_cache" in msg
    case.inputs["query_positions"][t] = rows - 1
    validate_data(_problem(case), case.inputs)


def test_derived_positions_within_cos_cache(rng):
    """Without query_positions, sequence b's last new token sits at kv_len - 1: past_seqlens is named."""
    case = util.make_case(rng, q_lens=(3, 0, 4), past=(20, 60, 0), rotary="half", max_position=24)
    validate_data(_problem(case), case.inputs)            # sequence 1 has no token: its past may be long
    case.inputs["past_seqlens"][2] = 21                   # positions 21..24: 24 is past the 24 rows
    _raises(case, "past_seqlens", 2)


@pytest.mark.parametrize("bad", [0.0, -0.5, np.nan, np.inf, 1e-40])
@pytest.mark.parametrize("which", ["k_scale", "v_scale"])
def test_scales_positive_finite(rng, bad, which):
    case = util.make_case(rng, cache="int8", k_quant="PER_CHANNEL", v_quant="PER_CHANNEL")
    scale = case.inputs[which]
    index = tuple(int(rng.integers(n)) for n in scale.shape)
    scale[index] = bad
    _raises(case, which, index)
