"""Attention states on the NumPy backend: the lse of paged_attention, and cupa.merge_states.

The central check (docs/attention_states.md): a call's keys split into shards by block tables that map
disjoint key sets (unmapped = -1), each shard computed without head_sink and with return_lse, then
merged with the sink, reproduce the unsplit call -- output within SPEC section 6 tolerances, lse to
float32 rounding, the cache writes byte for byte -- for every feature that composes.
"""

import re

import numpy as np
import pytest

import cupa
from tests.util import (TOLERANCE, T_DTYPES, assert_lse_close, assert_rel, dense_attention, make_case, rel_err,
                        shard_block_tables)

#: features that compose with key shards (make_case keywords)
FEATURES = {
    "plain": {},
    "window": dict(window=4),
    "softcap": dict(softcap=1.5),
    "sink": dict(sink=True),
    "bias": dict(bias=(False, False)),
    "bias_broadcast_sink": dict(bias=(True, True), sink=True),
    "int8_per_channel": dict(cache="int8", k_quant="PER_CHANNEL", v_quant="PER_CHANNEL"),
    "fp8": dict(cache="fp8", sink=True),
    "fp8_bytes_window": dict(cache="fp8_bytes", window=6, k_quant="PER_TENSOR", v_quant="PER_CHANNEL"),
    "latent": dict(latent=True, v_head_size=48, scale=0.125),
    "latent_int8_softcap": dict(latent=True, cache="int8", softcap=2.0),
    "rotary_qk_norm": dict(rotary="half", qk_norm=True),
    "interleaved_packed": dict(rotary="interleaved", packed=True),
    "not_causal_window": dict(is_causal=0, window=5),
    "random_positions": dict(positions="random"),
    "slot_skip": dict(slot_mapping="skip"),
    "bf16": dict(dtype="bfloat16", sink=True, softcap=2.0),
    "fp32": dict(dtype="float32", window=3, sink=True),
}
LENGTHS = dict(q_lens=(3, 0, 5, 1, 2), past=(7, 4, 0, 18, 30))


def _run_shards(case, tables, **extra):
    """The shard calls on one set of inputs (one cache): no head_sink, return_lse, one block table each."""
    outs, lses = [], []
    for table in tables:
        kw = case.kwargs()
        kw.pop("head_sink", None)
        kw.update(block_table=table, return_lse=True, **extra)
        o, lse = cupa.paged_attention(**kw)
        outs.append(o)
        lses.append(lse)
    return outs, lses


def _check_merged(case, ref, merged, merged_lse):
    ref_out, ref_lse = ref
    T = T_DTYPES[case.dtype]
    assert merged.dtype == T and merged.shape == ref_out.shape
    assert merged_lse.dtype == np.float32 and merged_lse.shape == ref_lse.shape
    assert np.all(np.isfinite(merged.astype(np.float32))), "merged output has non-finite values"
    assert_rel(merged, ref_out, case.dtype, what="merged output")
    assert_lse_close(merged_lse, ref_lse)
    H = ref_lse.shape[1]
    empty = np.isneginf(ref_lse)
    rows = merged.astype(np.float32).reshape(merged.shape[0], H, -1)
    assert np.all(rows[empty] == 0), "a (token, head) without admitted keys must output zeros"


@pytest.mark.parametrize("block_size", [1, 3, 16])
@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_key_shards_merge_to_the_unsplit_call(rng, feature, block_size):
    case = make_case(rng, block_size=block_size, **LENGTHS, **FEATURES[feature])
    unsplit = case.copy()
    ref = unsplit.run(return_lse=True)
    shards = case.copy()
    num_shards = int(rng.integers(2, 6))
    tables = shard_block_tables(rng, case.inputs["block_table"], num_shards, how=rng.choice(["ranges", "scatter"]))
    outs, lses = _run_shards(shards, tables)
    merged, merged_lse = cupa.merge_states(outs, lses, head_sink=case.inputs["head_sink"])
    _check_merged(case, ref, merged, merged_lse)
    # every new key was written by exactly the shard that maps its block (or by all, with slot_mapping)
    for name in ("key_cache", "value_cache"):
        if unsplit.inputs[name] is not None:
            assert np.array_equal(shards.inputs[name].view(np.uint8), unsplit.inputs[name].view(np.uint8)), name


@pytest.mark.parametrize("feature", ["plain", "sink", "window", "bias", "latent", "softcap"])
def test_reference_lse_is_the_brute_force_log_sum_exp(rng, feature):
    case = make_case(rng, block_size=4, **LENGTHS, **FEATURES[feature])
    dense = dense_attention(case)
    out, lse = case.copy().run(return_lse=True)
    assert_lse_close(lse, dense.lse)
    assert np.array_equal(np.isneginf(lse), ~np.isfinite(dense.lse))


def test_empty_shards_and_tokens_without_keys(rng):
    case = make_case(rng, block_size=4, q_lens=(2, 3, 1), past=(5, 9, 12), sink=True)
    bt = case.inputs["block_table"]
    bt[1, :] = -1                          # sequence 1 admits no key at all (unsplit lse -inf, output 0)
    ref = case.copy().run(return_lse=True)
    assert np.isneginf(ref[1][2:5]).all()
    shards = case.copy()
    tables = [np.full_like(bt, -1), bt.copy(), np.full_like(bt, -1)]   # two shards map nothing
    outs, lses = _run_shards(shards, tables)
    for s in (0, 2):
        assert np.isneginf(lses[s]).all() and not np.any(outs[s].astype(np.float32))
    merged, merged_lse = cupa.merge_states(outs, lses, head_sink=case.inputs["head_sink"])
    _check_merged(case, ref, merged, merged_lse)


def test_prefill_chunks_split_at_every_position(rng):
    """block_size 1: shard edges at arbitrary positions, including inside the new tokens of a prefill."""
    case = make_case(rng, block_size=1, q_lens=(9, 4), past=(6, 0), softcap=3.0, window=7, sink=True)
    ref = case.copy().run(return_lse=True)
    shards = case.copy()
    tables = shard_block_tables(rng, case.inputs["block_table"], 6, how="ranges")
    outs, lses = _run_shards(shards, tables)
    _check_merged(case, ref, *cupa.merge_states(outs, lses, head_sink=case.inputs["head_sink"]))


# ------------------------------------------------------------------------------------------------
# merge_states itself

def _random_states(rng, S, N=5, H=3, Dv=8, dtype="float16", empty=0.2):
    T = T_DTYPES[dtype]
    outs = [rng.standard_normal((N, H * Dv)).astype(T) for _ in range(S)]
    lses = [(rng.standard_normal((N, H)) * 4).astype(np.float32) for _ in range(S)]
    for s in range(S):
        lses[s][rng.random((N, H)) < empty] = -np.inf
    return outs, lses


def _formula(outs, lses, sink):
    """The merge written out per (token, head) in float64 (docs/attention_states.md)."""
    S, (N, H) = len(outs), lses[0].shape
    o = np.stack([np.asarray(x, dtype=np.float64) for x in outs]).reshape(S, N, H, -1)
    lse = np.stack(lses).astype(np.float64)
    out = np.zeros(o.shape[1:])
    merged_lse = np.full((N, H), -np.inf)
    for n in range(N):
        for h in range(H):
            live = [s for s in range(S) if np.isfinite(lse[s, n, h])]
            if not live:
                continue
            total = sum(np.exp(lse[s, n, h]) for s in live)
            den = total + (np.exp(float(sink[h])) if sink is not None else 0.0)
            out[n, h] = sum(np.exp(lse[s, n, h]) * o[s, n, h] for s in live) / den
            merged_lse[n, h] = np.log(total)
    return out.reshape(N, -1), merged_lse


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("S", [1, 2, 5, 20])
@pytest.mark.parametrize("with_sink", [False, True])
def test_merge_matches_the_formula(rng, dtype, S, with_sink):
    outs, lses = _random_states(rng, S, dtype=dtype)
    sink = (rng.standard_normal(3) * 2).astype(np.float32) if with_sink else None
    want, want_lse = _formula(outs, lses, sink)
    got, got_lse = cupa.merge_states(outs, lses, head_sink=sink)
    assert got.dtype == T_DTYPES[dtype] and got_lse.dtype == np.float32
    np.testing.assert_array_equal(got, want.astype(T_DTYPES[dtype]))   # float64 arithmetic, one rounding
    assert_lse_close(got_lse, want_lse)
    stacked, stacked_lse = cupa.merge_states(np.stack(outs), np.stack(lses), head_sink=sink)
    assert np.array_equal(stacked, got) and np.array_equal(stacked_lse, got_lse)


def test_merge_in_place_and_empty_states(rng):
    outs, lses = _random_states(rng, 3, dtype="float32", empty=0.4)
    lses[0][0, :] = lses[1][0, :] = lses[2][0, :] = -np.inf   # token 0: every state empty
    outs[1][1, :] = np.nan                                      # an empty state's row is never read
    lses[1][1, :] = -np.inf
    sink = np.array([50.0, -3.0, 0.5], dtype=np.float32)
    want, want_lse = cupa.merge_states([o.copy() for o in outs], [x.copy() for x in lses], head_sink=sink)
    assert np.all(want[0] == 0) and np.isneginf(want_lse[0]).all()
    assert np.all(np.isfinite(want))
    o0, l0 = outs[0], lses[0]
    got, got_lse = cupa.merge_states(outs, lses, head_sink=sink, out=o0, out_lse=l0)
    assert got is o0 and got_lse is l0
    assert np.array_equal(got, want) and np.array_equal(got_lse, want_lse)


def test_huge_sink_and_far_apart_states_stay_finite(rng):
    outs, lses = _random_states(rng, 2, N=2, H=2, dtype="float32", empty=0.0)
    lses[0][:] = 1e4
    lses[1][:] = -1e4
    sink = np.array([1e5, -1e5], dtype=np.float32)
    got, got_lse = cupa.merge_states(outs, lses, head_sink=sink)
    assert np.all(np.isfinite(got)) and np.all(got.reshape(2, 2, -1)[:, 0] == 0)
    np.testing.assert_allclose(got.reshape(2, 2, -1)[:, 1], outs[0].reshape(2, 2, -1)[:, 1], rtol=1e-6)
    np.testing.assert_allclose(got_lse, 1e4)


def test_merge_is_associative_without_sink(rng):
    outs, lses = _random_states(rng, 4, dtype="float32", empty=0.3)
    sink = rng.standard_normal(3).astype(np.float32)
    ab = cupa.merge_states(outs[:2], lses[:2])
    nested = cupa.merge_states([ab[0], *outs[2:]], [ab[1], *lses[2:]], head_sink=sink)
    flat = cupa.merge_states(outs, lses, head_sink=sink)
    assert rel_err(nested[0], flat[0]) < TOLERANCE["float32"]
    assert_lse_close(nested[1], flat[1])


def test_merge_torch_cpu_tensors_in_and_out(rng):
    torch = pytest.importorskip("torch")
    outs, lses = _random_states(rng, 3, dtype="bfloat16")
    sink = rng.standard_normal(3).astype(T_DTYPES["bfloat16"])
    want, want_lse = cupa.merge_states(outs, lses, head_sink=sink)
    to_t = lambda a: torch.from_numpy(a.view(np.int16)).view(torch.bfloat16) if a.dtype == T_DTYPES["bfloat16"] \
        else torch.from_numpy(a)
    got, got_lse = cupa.merge_states([to_t(o) for o in outs], [torch.from_numpy(x) for x in lses],
                                     head_sink=to_t(sink))
    assert isinstance(got, torch.Tensor) and got.dtype == torch.bfloat16 and isinstance(got_lse, torch.Tensor)
    assert np.array_equal(got.view(torch.int16).numpy(), want.view(np.int16))
    assert np.array_equal(got_lse.numpy(), want_lse)
    out = torch.empty(want.shape, dtype=torch.bfloat16)
    assert cupa.merge_states([to_t(o) for o in outs], [torch.from_numpy(x) for x in lses], out=out)[0] is out


def test_merge_of_no_tokens(rng):
    outs, lses = _random_states(rng, 2, N=0)
    got, got_lse = cupa.merge_states(outs, lses)
    assert got.shape == (0, 24) and got_lse.shape == (0, 3)


@pytest.mark.parametrize("mutate, name, message", [
    (lambda o, l, kw: o.__setitem__(1, o[1][:, :-8]), "outputs[1]", "shape"),
    (lambda o, l, kw: o.__setitem__(1, o[1].astype(np.float32)), "outputs[1]", "dtype"),
    (lambda o, l, kw: o.__setitem__(0, o[0].astype(np.float64)), "outputs[0]", "dtype float64"),
    (lambda o, l, kw: l.__setitem__(0, l[0].astype(np.float16)), "lses[0]", "float32"),
    (lambda o, l, kw: l.pop(), "lses", "one per output"),
    (lambda o, l, kw: l.__setitem__(1, l[1][:, :2]), "lses[1]", "shape"),
    (lambda o, l, kw: kw.update(head_sink=np.zeros(4, np.float32)), "head_sink", r"shape \(3,\)"),
    (lambda o, l, kw: kw.update(head_sink=np.zeros(3, np.float64)), "head_sink", "dtype"),
    (lambda o, l, kw: kw.update(out=np.zeros((5, 24), np.float32)), "out", "dtype float16"),
    (lambda o, l, kw: kw.update(out=np.zeros((5, 23), np.float16)), "out", "shape"),
    (lambda o, l, kw: kw.update(out_lse=np.zeros((5, 2), np.float32)), "out_lse", "shape"),
    (lambda o, l, kw: kw.update(out_lse=np.zeros((5, 3), np.float16)), "out_lse", "dtype float32"),
    (lambda o, l, kw: o.__setitem__(0, "x"), "outputs[0]", "an array"),
])
def test_merge_errors_name_the_argument(rng, mutate, name, message):
    outs, lses = _random_states(rng, 2)
    kw = {}
    mutate(outs, lses, kw)
    with pytest.raises(cupa.PagedAttentionError, match=rf"^{re.escape(name)}: .*{message}"):
        cupa.merge_states(outs, lses, **kw)


def test_merge_form_errors(rng):
    outs, lses = _random_states(rng, 2)
    with pytest.raises(cupa.PagedAttentionError, match="^outputs: got an empty sequence"):
        cupa.merge_states([], [])
    with pytest.raises(cupa.PagedAttentionError, match="^lses: got an array; expected the same form"):
        cupa.merge_states(outs, np.stack(lses))
    with pytest.raises(cupa.PagedAttentionError, match=r"^outputs\[0\]: got width 24; expected a multiple"):
        cupa.merge_states(outs, [np.zeros((5, 5), np.float32)] * 2)
    with pytest.raises(cupa.PagedAttentionError, match="^outputs: got shape"):
        cupa.merge_states(np.stack(outs)[0], np.stack(lses))
