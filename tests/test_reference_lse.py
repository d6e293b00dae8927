"""return_lse on the reference: the attention state identity (contract §5.2).

A sequence's keys split into shards through block tables that map disjoint block ranges (-1
elsewhere), each shard run with return_lse and without head_sink, and the shards combined with
weights exp(lse_i - m) (the sink joining the denominator once) reproduce the unsplit call: output
within the tolerance of T's rounding of the shard outputs, lse to float32 rounding. (Against the
dense oracle, lse is tested for every feature in tests/test_reference_dense.py.)
"""

import numpy as np
import pytest

from tests import util

FEATURES = [
    ("plain", dict()),
    ("window", dict(window=7)),
    ("softcap", dict(softcap=3.0)),
    ("sink", dict(sink=True)),
    ("sink-window", dict(sink=True, window=5)),
    ("bias", dict(bias=(False, True))),
    ("non-causal-window", dict(is_causal=0, window=6)),
    ("int8", dict(cache="int8", k_quant="PER_CHANNEL", v_quant="PER_TENSOR")),
    ("fp8-bytes", dict(cache="fp8_bytes", k_quant="PER_TENSOR", v_quant="PER_CHANNEL")),
    ("latent", dict(latent=True, num_heads=4, head_size=64, v_head_size=48, scale=0.15, rotary="interleaved",
                    rotary_offset=48, rotary_dim=16)),
    ("rope-qknorm", dict(rotary="half", qk_norm=True)),
    ("qk2", dict(qk_output=2, sink=True)),
]


def merge(outputs, lses, sink=None):
    """Attention states combined in float64:
    sum_i exp(lse_i - m) o_i / (sum_i exp(lse_i - m) + exp(sink - m)), and the lse of the union."""
    lses = [np.asarray(x, dtype=np.float64) for x in lses]
    N, H = lses[0].shape
    outs = [np.asarray(o, dtype=np.float64).reshape(N, H, -1) for o in outputs]
    m = np.maximum.reduce(lses + ([np.broadcast_to(np.asarray(sink, np.float64), (N, H))] if sink is not None else []))
    m = np.where(np.isfinite(m), m, 0.0)
    w = [np.exp(x - m) for x in lses]                          # exp(-inf) = 0: an empty shard counts nothing
    den = sum(w) + (np.exp(np.asarray(sink, np.float64) - m) if sink is not None else 0.0)
    out = sum(wi[..., None] * o for wi, o in zip(w, outs)) / np.where(den > 0, den, 1.0)[..., None]
    with np.errstate(divide="ignore"):
        lse = np.log(sum(w)) + m
    return out.reshape(N, -1), lse


def shard_cases(case, cuts):
    """Copies of ``case`` whose block tables map logical blocks [cuts[i], cuts[i+1]) only, writing every
    new token to its derived slot (so each shard's cache holds every write), without head_sink."""
    bt = case.inputs["block_table"]
    slots = util.derived_slots(case.inputs, case.info["block_size"], positions=case.info["positions"])
    edges = [0, *cuts, bt.shape[1]]
    shards = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        shard = case.copy()
        table = np.full_like(bt, -1)
        table[:, lo:hi] = bt[:, lo:hi]
        shard.inputs["block_table"] = table
        shard.inputs["slot_mapping"] = slots.astype(np.int32)
        shard.inputs["head_sink"] = None
        shards.append(shard)
    return shards


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("name", [f[0] for f in FEATURES])
def test_shards_merge_to_the_unsplit_call(rng, name, dtype):
    opts = dict(FEATURES)[name]
    case = util.make_case(rng, q_lens=(5, 1, 0, 9, 2), past=(30, 47, 6, 12, 0), block_size=8, dtype=dtype,
                          unused_cols="neg", **opts)
    qk_output = case.attrs.get("qk_output", 0)
    full = util.split_result(case.copy().run(return_lse=True), qk_output, True)
    sink = case.inputs["head_sink"]
    sink64 = None if sink is None else sink.astype(np.float64)[None, :]
    MB = case.inputs["block_table"].shape[1]
    for cuts in ([int(rng.integers(1, MB))], [2], sorted(rng.choice(np.arange(1, MB), size=2, replace=False))):
        parts = [util.split_result(s.run(return_lse=True), qk_output, True) for s in shard_cases(case, cuts)]
        out, lse = merge([p[0] for p in parts], [p[2] for p in parts], sink64)
        assert np.all(np.isneginf(lse) == np.isneginf(full[2].astype(np.float64))), cuts
        util.assert_lse_close(full[2], lse, what=f"lse merged over cuts {cuts}")
        util.assert_rel(out, full[0].astype(np.float64), dtype, what=f"output merged over cuts {cuts}")
        assert np.all(out[np.isneginf(lse).all(axis=1)] == 0)


def test_a_shard_without_keys(rng):
    """A shard that maps none of a token's keys returns lse -inf and zeros, and merging it changes nothing."""
    case = util.make_case(rng, q_lens=(3, 2), past=(5, 9), block_size=8, dtype="float32", unused_cols="neg")
    full = case.copy().run(return_lse=True)
    first, empty = shard_cases(case, [case.inputs["block_table"].shape[1] - 1])
    a, b = first.run(return_lse=True), empty.run(return_lse=True)
    assert np.all(np.isneginf(b[1])) and np.all(b[0] == 0)
    out, lse = merge([a[0], b[0]], [a[1], b[1]])
    np.testing.assert_array_equal(out.astype(np.float32), full[0])
    np.testing.assert_array_equal(lse.astype(np.float32), full[1])
