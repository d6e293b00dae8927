"""The NumPy reference against an independent brute-force dense attention (tests/util.py).

Every feature of contract §1-§4 appears in the matrix; outputs are compared to within one ulp of
T (both sides compute in float64), output_qk to float32 rounding, and the written caches byte for
byte (with a tiny allowance for rounding-boundary coincidences between two float64 computations).
"""

import time

import numpy as np
import pytest

import cupa
import cupa.reference as reference
from tests import util

# (id, make_case options)
MATRIX = [
    ("mha-d64", dict(num_heads=4, kv_num_heads=4)),
    ("gqa2-d64", dict(num_heads=4, kv_num_heads=2)),
    ("gqa4-d128", dict(num_heads=8, kv_num_heads=2, head_size=128)),
    ("mqa-d128", dict(num_heads=4, kv_num_heads=1, head_size=128)),
    ("block1", dict(block_size=1, q_lens=(2, 0, 3), past=(5, 2, 0))),
    ("block64", dict(block_size=64, q_lens=(4, 1, 0, 6), past=(70, 3, 9, 60))),
    ("block16-decode", dict(q_lens=(1, 1, 1, 1, 1), past=(0, 15, 16, 33, 47))),
    ("prefill-only", dict(q_lens=(9, 13), past=(0, 0))),
    ("ragged-zero", dict(q_lens=(0, 5, 0, 2, 0), past=(3, 0, 0, 30, 17))),
    ("no-shuffle-neg-cols", dict(shuffle=False, unused_cols="neg", extra_cols=3)),
    ("packed", dict(packed=True)),
    ("packed-gqa4", dict(packed=True, num_heads=8, kv_num_heads=2)),
    ("rope-half", dict(rotary="half")),
    ("rope-interleaved", dict(rotary="interleaved")),
    ("rope-partial", dict(rotary="half", rotary_dim=32)),
    ("rope-partial-offset", dict(rotary="interleaved", rotary_dim=16, rotary_offset=24)),
    ("rope-offset-d128", dict(rotary="half", head_size=128, rotary_dim=64, rotary_offset=64)),
    ("positions-explicit", dict(positions="explicit", rotary="half")),
    ("positions-random", dict(positions="random", rotary="interleaved")),
    ("qknorm", dict(qk_norm=True)),
    ("qknorm-rope-packed", dict(qk_norm=True, rotary="half", packed=True)),
    ("window1", dict(window=1)),
    ("window3", dict(window=3, q_lens=(6, 2, 1), past=(10, 0, 25))),
    ("window-ge-context", dict(window=1000)),
    ("window-block1", dict(window=5, block_size=1)),
    ("softcap", dict(softcap=3.0)),
    ("softcap-window", dict(softcap=5.0, window=4)),
    ("sink", dict(sink=True)),
    ("sink-window", dict(sink=True, window=2)),
    ("non-causal", dict(is_causal=0)),
    ("non-causal-window", dict(is_causal=0, window=3)),
    ("scale", dict(scale=0.37)),
    ("bias-full", dict(bias=(False, False))),
    ("bias-batch1", dict(bias=(True, False))),
    ("bias-head1", dict(bias=(False, True))),
    ("bias-both1-padded", dict(bias=(True, True), bias_pad=(3, 11))),
    ("bias-undersized", dict(bias=(False, False), bias_pad=(-2, -6), q_lens=(5, 3, 1), past=(10, 2, 20))),
    ("bias-softcap", dict(bias=(False, True), softcap=4.0)),
    ("qk1", dict(qk_output=1)),
    ("qk2", dict(qk_output=2)),
    ("qk2-sink-window", dict(qk_output=2, sink=True, window=3)),
    ("qk1-bias-softcap", dict(qk_output=1, bias=(True, False), softcap=2.0)),
    ("qk1-tight-metadata", dict(qk_output=1, metadata="tight")),
    ("qk2-loose-metadata", dict(qk_output=2, metadata="loose")),
    ("qk1-undersized-metadata", dict(qk_output=1, metadata=(0, 9))),
    ("int8-tensor", dict(cache="int8")),
    ("int8-channel", dict(cache="int8", k_quant="PER_CHANNEL", v_quant="PER_CHANNEL")),
    ("int8-mixed", dict(cache="int8", k_quant="PER_CHANNEL", v_quant="PER_TENSOR", rotary="half")),
    ("fp8-tensor", dict(cache="fp8")),
    ("fp8-channel", dict(cache="fp8", k_quant="PER_CHANNEL", v_quant="PER_CHANNEL", qk_norm=True)),
    ("fp8-bytes-mixed", dict(cache="fp8_bytes", k_quant="PER_TENSOR", v_quant="PER_CHANNEL")),
    ("fp8-bytes-saturating", dict(cache="fp8_bytes", value_scale=40.0)),
    ("int8-saturating", dict(cache="int8", value_scale=40.0, k_quant="PER_CHANNEL")),
    ("int4-tensor", dict(cache="int4")),
    ("int4-channel", dict(cache="int4", k_quant="PER_CHANNEL", v_quant="PER_CHANNEL", rotary="half")),
    ("fp4-tensor", dict(cache="fp4", qk_norm=True)),
    ("fp4-channel", dict(cache="fp4", k_quant="PER_CHANNEL", v_quant="PER_CHANNEL", head_size=128)),
    ("int4-k-fp4-v", dict(cache="int4", v_cache="fp4", k_quant="PER_CHANNEL")),
    ("fp4-k-int4-v", dict(cache="fp4", v_cache="int4", v_quant="PER_CHANNEL", packed=True)),
    ("int4-k-fp8-v", dict(cache="int4", v_cache="fp8_bytes", k_quant="PER_CHANNEL", window=3)),
    ("fp8-k-fp4-v", dict(cache="fp8_bytes", v_cache="fp4", sink=True)),
    ("int4-saturating", dict(cache="int4", value_scale=40.0, k_quant="PER_CHANNEL")),
    ("fp4-saturating", dict(cache="fp4", value_scale=40.0)),
    ("slot-explicit", dict(slot_mapping="derived")),
    ("slot-skip", dict(slot_mapping="skip")),
    ("latent", dict(latent=True, num_heads=4, head_size=96, v_head_size=64, scale=0.11,
                    rotary="interleaved", rotary_offset=64, rotary_dim=32)),
    ("latent-fp8-channel", dict(latent=True, num_heads=2, head_size=64, v_head_size=48, scale=0.2,
                                cache="fp8", k_quant="PER_CHANNEL", qk_output=2)),
    ("latent-int8-tensor", dict(latent=True, num_heads=4, head_size=64, scale=0.2, cache="int8")),
    ("latent-int4-channel", dict(latent=True, num_heads=4, head_size=64, v_head_size=40, scale=0.2, cache="int4",
                                 k_quant="PER_CHANNEL")),
    ("latent-fp4-tensor", dict(latent=True, num_heads=2, head_size=96, v_head_size=64, scale=0.1, cache="fp4",
                               qk_output=1)),
    ("everything", dict(packed=True, rotary="interleaved", rotary_dim=32, rotary_offset=8, qk_norm=True,
                        positions="explicit", window=6, softcap=8.0, sink=True, bias=(False, True),
                        qk_output=2, cache="int8", k_quant="PER_CHANNEL", slot_mapping="skip",
                        num_heads=8, kv_num_heads=2)),
]


@pytest.mark.parametrize("opts", [m[1] for m in MATRIX], ids=[m[0] for m in MATRIX])
def test_reference_matches_dense(rng, opts):
    """Output, output_qk, lse and the written caches against the dense oracle; lse is asked for
    together with output_qk where the case has it (outputs come back as (output, output_qk, lse))."""
    case = util.make_case(rng, **opts)
    dense = util.dense_attention(case)
    result = case.run(return_lse=True)
    assert len(result) == (3 if case.attrs.get("qk_output", 0) else 2)
    util.check_against_dense(case, result, dense, return_lse=True)
    assert np.abs(result[0].astype(np.float32)).max() > 0
    assert np.isfinite(result[-1]).any()


@pytest.mark.parametrize("name", ["gqa2-d64", "qk1", "latent", "sink-window"])
def test_return_lse_changes_nothing_else(rng, name):
    """return_lse adds an output and leaves the others (and the cache writes) bit for bit."""
    case = util.make_case(rng, **dict(MATRIX)[name])
    other = case.copy()
    plain, with_lse = case.run(), other.run(return_lse=True)
    plain = plain if isinstance(plain, tuple) else (plain,)
    assert len(with_lse) == len(plain) + 1
    for a, b in zip(plain, with_lse):
        np.testing.assert_array_equal(np.ascontiguousarray(a).view(np.uint8), np.ascontiguousarray(b).view(np.uint8))
    util.assert_cache_close(case.inputs["key_cache"], other.inputs["key_cache"])


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("cache", ["T", "int8", "fp8", "fp8_bytes", "int4", "fp4"])
def test_dtypes_and_caches(rng, dtype, cache):
    opts = dict(dtype=dtype, cache=cache, rotary="half", qk_norm=bool(rng.integers(2)), sink=True,
                k_quant=str(rng.choice(["PER_TENSOR", "PER_CHANNEL"])),
                v_quant=str(rng.choice(["PER_TENSOR", "PER_CHANNEL"])), window=int(rng.choice([-1, 4])))
    case = util.make_case(rng, **opts)
    dense = util.dense_attention(case)
    util.check_against_dense(case, case.run(), dense)


def test_random_ragged_batches(rng):
    for _ in range(4):
        B = int(rng.integers(1, 6))
        q_lens, past = util.random_lengths(rng, B, max_q=7, max_past=50)
        H, Hk = [(4, 1), (4, 2), (6, 3), (8, 8)][int(rng.integers(4))]
        case = util.make_case(rng, q_lens=q_lens, past=past, num_heads=H, kv_num_heads=Hk,
                              block_size=int(rng.choice([1, 4, 16, 32])), rotary="half",
                              window=int(rng.choice([-1, 1, 5, 100])), softcap=float(rng.choice([0.0, 6.0])))
        util.check_against_dense(case, case.run(), util.dense_attention(case))


def _random_options(rng):
    H, Hk = [(4, 1), (4, 2), (4, 4), (8, 2), (6, 3)][int(rng.integers(5))]
    D = int(rng.choice([32, 64, 128]))
    opts = dict(num_heads=H, kv_num_heads=Hk, head_size=D, block_size=int(rng.choice([1, 2, 8, 16, 64])),
                dtype=str(rng.choice(["float16", "bfloat16", "float32"])),
                cache=str(rng.choice(util.CACHE_KINDS)),
                k_quant=str(rng.choice(["PER_TENSOR", "PER_CHANNEL"])),
                v_quant=str(rng.choice(["PER_TENSOR", "PER_CHANNEL"])),
                packed=bool(rng.integers(2)), qk_norm=bool(rng.integers(2)), sink=bool(rng.integers(2)),
                window=int(rng.choice([-1, -1, 1, 3, 8, 200])), softcap=float(rng.choice([0.0, 0.0, 2.5, 30.0])),
                is_causal=int(rng.choice([1, 1, 0])), qk_output=int(rng.integers(3)),
                slot_mapping=rng.choice([None, "derived", "skip"]), shuffle=bool(rng.integers(2)),
                unused_cols=str(rng.choice(["neg", "garbage"])), extra_cols=int(rng.integers(0, 3)))
    B = int(rng.integers(1, 5))
    opts["q_lens"], opts["past"] = util.random_lengths(rng, B, max_q=6, max_past=40)
    if rng.integers(2):
        opts["rotary"] = str(rng.choice(["half", "interleaved"]))
        rd = int(rng.choice([8, 16, D]))
        opts["rotary_dim"] = rd
        opts["rotary_offset"] = int(rng.choice([o for o in range(0, D - rd + 1, 8)]))
        opts["positions"] = rng.choice([None, "explicit", "random"])
    if rng.integers(2):
        opts["bias"] = (bool(rng.integers(2)), bool(rng.integers(2)))
        opts["bias_pad"] = (int(rng.integers(-1, 3)), int(rng.integers(-4, 6)))
    if rng.integers(3) == 0:
        opts["metadata"] = str(rng.choice(["tight", "loose"]))
    return opts


def test_random_feature_combinations(rng):
    for _ in range(12):
        opts = _random_options(rng)
        case = util.make_case(rng, **opts)
        return_lse = bool(rng.integers(2))
        try:
            dense = util.dense_attention(case)
            util.check_against_dense(case, case.run(return_lse=return_lse), dense, return_lse=return_lse)
        except AssertionError as exc:
            raise AssertionError(f"options {opts}, return_lse={return_lse}: {exc}") from exc


@pytest.mark.parametrize("scores,tile,row", [(3000, 700, 128), (50000, 64, 4), (1, 1, 128), (1 << 23, 1 << 30, 3)])
def test_chunking_paths(rng, monkeypatch, scores, tile, row):
    """Tiny score, tile and row budgets exercise every split: rows of one token, one key per tile,
    packed grids, long rows alone; a huge tile packs every row into one grid."""
    monkeypatch.setattr(reference, "SCORE_ELEMENTS", scores)
    monkeypatch.setattr(reference, "TILE_ELEMENTS", tile)
    monkeypatch.setattr(reference, "ROW_TOKENS", row)
    monkeypatch.setattr(reference, "PROLOGUE_ELEMENTS", max(1, scores // 8))
    case = util.make_case(rng, q_lens=(11, 1, 2, 0, 3, 9), past=(4, 20, 0, 7, 33, 0), rotary="half",
                          sink=True, bias=(False, False), qk_output=1, window=int(rng.choice([-1, 4])))
    util.check_against_dense(case, case.run(), util.dense_attention(case))


# ---------------------------------------------------------------------------------------------- malformed

def _check_zero_and_unwritten(case, before, result, dense, tokens):
    out = result[0] if isinstance(result, tuple) else result
    for t in tokens:
        assert not dense.valid[t] and not dense.written[t]
        assert np.all(out[t].astype(np.float32) == 0)


@pytest.mark.parametrize("explicit_slots", [False, True])
def test_invalid_sequences(rng, explicit_slots):
    # seq1: negative past; seq3: kv_len one block-table capacity too long; seq0, seq2 valid
    case = util.make_case(rng, q_lens=(3, 2, 4, 3), past=(5, 6, 2, 10), qk_output=1,
                          slot_mapping="derived" if explicit_slots else None)
    cap = case.inputs["block_table"].shape[1] * 16
    case.inputs["past_seqlens"][1] = -4
    case.inputs["past_seqlens"][3] = cap - 1          # its first token alone would fit
    if explicit_slots:                                # slots that would be legal writes
        case.inputs["slot_mapping"][[3, 4, 9, 10, 11]] = [1, 2, 3, 17, 18]
    dense = util.dense_attention(case)
    result = case.run()
    util.check_against_dense(case, result, dense)
    _check_zero_and_unwritten(case, None, result, dense, [3, 4, 9, 10, 11])
    assert dense.valid[[0, 1, 2, 5, 6, 7, 8]].all()
    assert np.all(result[1][:, [3, 4, 9, 10, 11]] == 0)


def test_decreasing_cum(rng):
    case = util.make_case(rng, q_lens=(3, 2, 4), past=(5, 6, 2))
    cum = case.inputs["cumulative_sequence_length"]
    cum[1] = 6        # [0, 6, 5, 9]: seq1 (cum[2] < cum[1]) is invalid and, by the binary search,
    dense = util.dense_attention(case)          # owns no token: 0-4 -> seq0, 5-8 -> seq2
    result = case.run()
    util.check_against_dense(case, result, dense)
    assert dense.valid.all() and np.abs(result.astype(np.float32)).max() > 0


@pytest.mark.parametrize("explicit_slots", [False, True])
def test_tokens_beyond_last_sequence(rng, explicit_slots):
    case = util.make_case(rng, q_lens=(3, 4), past=(2, 9), slot_mapping="derived" if explicit_slots else None)
    case.inputs["cumulative_sequence_length"][-1] = 5     # tokens 5, 6 belong to no sequence
    dense = util.dense_attention(case)
    result = case.run()
    util.check_against_dense(case, result, dense)
    _check_zero_and_unwritten(case, None, result, dense, [5, 6])


@pytest.mark.parametrize("explicit_slots", [False, True])
def test_invalid_token_positions(rng, explicit_slots):
    case = util.make_case(rng, q_lens=(4, 3), past=(3, 8), rotary="interleaved", max_position=10,
                          slot_mapping="derived" if explicit_slots else None)
    qp = np.array([3, -1, 5, 6, 8, 9, 10], dtype=np.int32)   # -1 invalid; 10 >= cos rows invalid
    case.inputs["query_positions"] = qp
    if explicit_slots:
        case.inputs["slot_mapping"][[1, 6]] = [4, 5]
    dense = util.dense_attention(case)
    result = case.run()
    util.check_against_dense(case, result, dense)
    _check_zero_and_unwritten(case, None, result, dense, [1, 6])


def test_slots_out_of_range_still_attend(rng):
    case = util.make_case(rng, q_lens=(3, 3), past=(4, 6), slot_mapping="derived")
    NB, bs = case.inputs["key_cache"].shape[:2]
    case.inputs["slot_mapping"][[0, 2, 4]] = [NB * bs, -7, 2 ** 31 - 1]
    before = case.copy()
    dense = util.dense_attention(case)
    result = case.run()
    util.check_against_dense(case, result, dense)
    assert list(dense.written) == [False, True, False, True, False, True]
    assert dense.valid.all()
    for t in (0, 2, 4):
        assert np.abs(result[t].astype(np.float32)).max() > 0
    # rows not written keep their bytes
    kflat = case.inputs["key_cache"].reshape(NB * bs, -1)
    bflat = before.inputs["key_cache"].reshape(NB * bs, -1)
    changed = np.flatnonzero(np.any(kflat != bflat, axis=1))
    assert set(changed) <= set(case.inputs["slot_mapping"][[1, 3, 5]].tolist())


def test_derived_slot_beyond_block_table(rng):
    case = util.make_case(rng, q_lens=(2, 2), past=(3, 5), extra_cols=0)
    MB, bs = case.inputs["block_table"].shape[1], 16
    qp = np.array([3, MB * bs + 3, 5, 6], dtype=np.int32)    # token 1: logical block beyond the row
    case.inputs["query_positions"] = qp
    dense = util.dense_attention(case)
    result = case.run()
    util.check_against_dense(case, result, dense)
    assert dense.valid[1] and not dense.written[1]
    assert np.abs(result[1].astype(np.float32)).max() > 0      # it still attends


def test_block_ids_out_of_range_are_masked(rng):
    case = util.make_case(rng, q_lens=(3, 2), past=(40, 20), block_size=8, qk_output=2)
    bt = case.inputs["block_table"]
    NB = case.inputs["key_cache"].shape[0]
    bt[0, 1], bt[0, 3], bt[1, 0] = -1, NB + 5, -9
    bt[0, 5] = -1                                   # positions 40..47: the new tokens' own block
    dense = util.dense_attention(case)
    result = case.run()
    util.check_against_dense(case, result, dense)
    assert not dense.written[:3].any() and dense.written[3:].all()
    qk = result[1]
    assert np.all(qk[:, 0:3, 8:16] == 0) and np.all(qk[:, 0:3, 24:32] == 0) and np.all(qk[:, 3:5, 0:8] == 0)


@pytest.mark.parametrize("explicit_slots", [False, True])
def test_tokens_before_first_sequence(rng, explicit_slots):
    case = util.make_case(rng, q_lens=(3, 4), past=(2, 9), slot_mapping="derived" if explicit_slots else None)
    case.inputs["cumulative_sequence_length"][0] = 2      # tokens 0, 1: the search finds seq0, cum[0] > t
    dense = util.dense_attention(case)
    result = case.run()
    util.check_against_dense(case, result, dense)
    _check_zero_and_unwritten(case, None, result, dense, [0, 1])
    assert dense.valid[2:].all()


def test_all_keys_masked_outputs_zero(rng):
    case = util.make_case(rng, q_lens=(2,), past=(6,), block_size=4, sink=True, qk_output=1)
    case.inputs["block_table"][0, :] = -1
    result = case.run()
    assert np.all(result[0].astype(np.float32) == 0) and np.all(result[1] == 0)
    assert np.all(np.isfinite(result[0].astype(np.float32)))


# ---------------------------------------------------------------------------------------------- edges

@pytest.mark.parametrize("qk_output", [0, 1])
def test_token_count_zero(rng, qk_output):
    case = util.make_case(rng, q_lens=(0, 0), past=(5, 3), qk_output=qk_output, cache="int8")
    before = case.copy()
    result = case.run()
    out = result[0] if qk_output else result
    assert out.shape == (0, 4 * 64) and out.dtype == np.float16
    if qk_output:
        MB = case.inputs["block_table"].shape[1]
        assert result[1].shape == (4, 0, MB * 16) and result[1].dtype == np.float32
    util.assert_cache_close(case.inputs["key_cache"], before.inputs["key_cache"])
    util.assert_cache_close(case.inputs["value_cache"], before.inputs["value_cache"])


@pytest.mark.parametrize("cache", ["T", "int8", "fp8_bytes"])
@pytest.mark.parametrize("slots", [None, "derived"])
def test_empty_cache(rng, cache, slots):
    """num_blocks == 0 is valid (contract §4.4): nothing is written, every token outputs zeros, output_qk
    is zero and lse is -inf."""
    case = util.make_case(rng, q_lens=(3, 0, 2), past=(4, 2, 0), cache=cache, sink=True, qk_output=1,
                          slot_mapping=slots)
    for name in ("key_cache", "value_cache"):
        c = case.inputs[name]
        case.inputs[name] = np.empty((0,) + c.shape[1:], c.dtype)
    case.inputs["block_table"][...] = -1
    out = np.full((case.token_count, 4 * 64), np.nan, np.float16)
    result = case.run(return_lse=True, out=out)
    assert result[0] is out and np.all(out.astype(np.float32) == 0)
    assert np.all(result[1] == 0) and np.all(np.isneginf(result[2]))


def test_out_parameter(rng):
    case = util.make_case(rng, dtype="bfloat16", qk_output=2)
    N, H = case.token_count, 4
    ref = case.copy().run()
    out = np.full((N, H * 64), np.nan, dtype=util.T_DTYPES["bfloat16"])
    got = case.run(out=out)
    assert got[0] is out
    util.assert_cache_close(out, ref[0])
    np.testing.assert_array_equal(got[1], ref[1])


@pytest.mark.parametrize("bad", ["shape", "dtype", "noncontig", "readonly", "type"])
def test_out_parameter_rejected(rng, bad):
    case = util.make_case(rng)
    N = case.token_count
    if bad == "shape":
        out = np.full((N, 4 * 64 + 8), np.nan, np.float16)
    elif bad == "dtype":
        out = np.full((N, 4 * 64), np.nan, np.float32)
    elif bad == "noncontig":
        out = np.full((4 * 64, N), np.nan, np.float16).T
    elif bad == "readonly":
        out = np.full((N, 4 * 64), np.nan, np.float16)
        out.flags.writeable = False
    else:
        out = [[0.0] * (4 * 64)] * N
    before = case.copy()
    with pytest.raises(cupa.PagedAttentionError, match="out"):
        case.run(out=out)
    util.assert_cache_close(case.inputs["key_cache"], before.inputs["key_cache"])   # nothing written


def test_caches_updated_in_place(rng):
    case = util.make_case(rng, cache="fp8_bytes")
    kc, vc = case.inputs["key_cache"], case.inputs["value_cache"]
    before = kc.copy()
    case.run()
    assert case.inputs["key_cache"] is kc and case.inputs["value_cache"] is vc
    assert not np.array_equal(before, kc)


def test_noncontiguous_cache_rejected(rng):
    case = util.make_case(rng)
    kc = case.inputs["key_cache"]
    big = np.empty(kc.shape[:-1] + (kc.shape[-1] * 2,), kc.dtype)
    case.inputs["key_cache"] = big[..., ::2]
    with pytest.raises(cupa.PagedAttentionError, match="key_cache"):
        case.run()


def test_deterministic(rng):
    case = util.make_case(rng, rotary="half", cache="int8", sink=True, qk_output=2)
    r1, r2 = case.copy().run(), case.copy().run()
    np.testing.assert_array_equal(r1[0].view(np.uint16), r2[0].view(np.uint16))
    np.testing.assert_array_equal(r1[1], r2[1])


def test_backend_object(rng):
    case = util.make_case(rng)
    op = cupa.PagedAttention(**case.attrs)
    plan = op.plan(**{k: v for k, v in case.inputs.items() if v is not None})
    problem, backend = plan.problem, plan.backend
    assert backend is reference.BACKEND and backend.name == "reference"
    assert backend.not_supported_reasons(problem) == [] and backend.preferred(problem)
    assert "reference" in backend.describe(problem).lower() or "numpy" in backend.describe(problem).lower()


# ---------------------------------------------------------------------------------------------- speed

def test_prefill_4k_is_fast(rng):
    """B=2 x 2048 new tokens, H=8, Hk=2, D=64, block 16: seconds, not minutes (loose bound)."""
    case = util.make_case(rng, num_heads=8, kv_num_heads=2, head_size=64, block_size=16,
                          q_lens=(2048, 2048), past=(0, 0), rotary="half")
    before = case.copy()
    t0 = time.perf_counter()
    out = case.run()
    elapsed = time.perf_counter() - t0
    assert elapsed < 30.0, f"4k-token prefill took {elapsed:.1f} s"
    assert out.shape == (4096, 8 * 64) and np.all(np.isfinite(out.astype(np.float32)))
    # the first tokens of sequence 0 against the dense oracle on the same data, truncated (causal)
    n = 24
    small = before.copy()
    for name in ("query", "key", "value"):
        small.inputs[name] = small.inputs[name][:n].copy()
    small.inputs["cumulative_sequence_length"] = np.array([0, n], np.int32)
    small.inputs["past_seqlens"] = np.array([0], np.int32)
    small.inputs["block_table"] = small.inputs["block_table"][:1].copy()
    small.inputs["cos_cache"] = small.inputs["cos_cache"][:n + 1].copy()
    small.inputs["sin_cache"] = small.inputs["sin_cache"][:n + 1].copy()
    util.assert_within_ulp(out[:n], util.dense_attention(small).output, "float16")
