"""output_qk on the decode backend (paged_decode_mma's QK instances, then paged_general_finish), on a GPU.

Every case runs with ``cupa.Options(backend="decode")``, draws fresh random data, poisons ``out`` and every
allocation of the call (output_qk, lse, workspaces: util.poisoned_allocations) and checks every element
against the NumPy reference: the output by contract §6's relative error, scores element by element,
probabilities row by row, lse element by element, and every cache byte.
"""

import numpy as np
import pytest

import cupa
from cupa.kernels import decode
from tests import util

pytestmark = pytest.mark.gpu

DECODE = cupa.Options(backend="decode")
SHAPE = dict(q_lens=[1] * 5, past=[300, 17, 1, 64, 250])


@pytest.fixture(autouse=True)
def decode_backend(monkeypatch):
    monkeypatch.setattr(util, "OPTIONS", DECODE)


def check(cp, rng, *, dtype="float16", metadata=None, splits=None, **kw):
    """Build a case, check that the decode backend's QK instance serves it (with more than one split when
    ``splits``), then every output against the reference."""
    inputs, attrs = util.build(rng, dtype=dtype, **kw)
    plan = cupa.PagedAttention(**attrs).plan(**util.to_device(cp, inputs), attention_metadata=metadata)
    assert plan.backend is decode.BACKEND
    spec = decode.BACKEND._spec(plan.problem, plan.device, plan.options)
    assert spec.name_expression.endswith(", true>"), spec
    if splits is not None:
        _, num_splits, _ = decode.split_plan(plan.problem, plan.device.sm_count, plan.options)
        assert (num_splits > 1) == splits, num_splits
    return util.check_outputs_against_reference(cp, inputs, attrs, metadata=metadata, dtype=dtype)


FEATURES = {
    "plain": dict(),
    "window": dict(window=20),
    "sink": dict(sink=True),
    "softcap": dict(softcap=3.0),
    "lse": dict(return_lse=True, sink=True),
    "everything": dict(softcap=8.0, sink=True, window=64, return_lse=True),
    "block_size_1": dict(block_size=1, window=7),
    "block_size_48": dict(block_size=48),
    "unmapped_blocks": dict(block_table="unmapped"),
}


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("qk_output", [1, 2])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_output_qk(cp, rng, feature, qk_output, dtype):
    """Scores (after scale and softcap) or probabilities (the sink's share in the denominator) of every
    admitted key; zeros past each sequence's keys, for masked keys and for tokens without keys."""
    check(cp, rng, dtype=dtype, qk_output=qk_output, **SHAPE, **FEATURES[feature])


@pytest.mark.parametrize("qk_output", [1, 2])
@pytest.mark.parametrize("H,Hk,D", [(8, 2, 128), (32, 8, 128), (12, 4, 64), (40, 2, 64)])
def test_splits_and_group_sizes(cp, rng, qk_output, H, Hk, D):
    """Long sequences split their keys over CTAs (each writes its split's scores; the last merges the output
    and lse), with groups of 4, 6 and 20 heads (two head chunks of a KV head)."""
    check(cp, rng, qk_output=qk_output, H=H, Hk=Hk, D=D, q_lens=[1, 1, 1], past=[3000, 900, 5000], sink=True,
          return_lse=True, splits=True)


@pytest.mark.parametrize("metadata", ["tight", "loose"])
def test_output_qk_width_from_the_bound(cp, rng, metadata):
    """output_qk's width is the kv bound of attention_metadata (contract §2) when given."""
    kv = max(p + 1 for p in SHAPE["past"])
    md = np.array([1, kv] if metadata == "tight" else [4, 1000], dtype=np.int32)
    result, dev = check(cp, rng, qk_output=2, metadata=md, **SHAPE)
    assert result[1].shape[2] == min(int(md[1]), dev["block_table"].shape[1] * 16)


def test_malformed_inputs(cp, rng):
    """Tokens no sequence owns (cum[B] < N), an invalid sequence (past < 0), block ids out of range and
    unmapped: zeros where the contract says so, never a read out of bounds."""
    inputs, attrs = util.build(rng, q_lens=[1] * 6, past=[40, 5, 70, 300, 0, 9], block_table="unmapped",
                               qk_output=2, return_lse=True)
    inputs["cumulative_sequence_length"][-1] -= 2   # the last 2 tokens belong to no sequence
    inputs["past_seqlens"][1] = -3                  # sequence 1 is invalid
    util.check_outputs_against_reference(cp, inputs, attrs)


def test_nan_in_unread_cache_rows(cp, rng):
    inputs, attrs = util.build(rng, block_table="unmapped", **SHAPE, qk_output=2, return_lse=True)
    assert util.poison_unused_cache_rows(inputs, 16) > 0
    util.check_outputs_against_reference(cp, inputs, attrs)


def test_bit_identical_runs_and_bounds(cp, rng):
    """Two runs give the same bits; so do absent, tight and loose attention_metadata bounds (contract §4.5)."""
    shape = dict(q_lens=[1, 1, 1], past=[2500, 300, 4000])
    inputs, attrs = util.build(rng, qk_output=2, return_lse=True, sink=True, **shape)
    kv = max(p + 1 for p in shape["past"])
    cap = inputs["block_table"].shape[1] * 16
    util.assert_same_bits_over_bounds(cp, inputs, attrs, (None, None, np.array([1, kv], dtype=np.int32),
                                                         np.array([3, cap], dtype=np.int32)))


def test_graph_capture(cp, rng):
    """Captured once, replayed: the same bits as an eager call (output, output_qk, lse)."""
    inputs, attrs = util.build(rng, H=8, Hk=2, D=128, q_lens=[1] * 4, past=[100, 2000, 300, 400], qk_output=2,
                               return_lse=True, sink=True)
    dev = util.to_device(cp, inputs)
    eager = [cp.asnumpy(x) for x in cupa.paged_attention(**util.to_device(cp, inputs), **attrs)]
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        cupa.paged_attention(**dev, **attrs)  # plan and compile outside the capture
        stream.synchronize()
        stream.begin_capture()
        captured = cupa.paged_attention(**dev, **attrs)
        graph = stream.end_capture()
    for _ in range(2):
        for x in captured:
            x.fill(np.nan)
        graph.launch(stream)
        stream.synchronize()
        for got, want in zip(captured, eager):
            assert np.array_equal(cp.asnumpy(got).view(np.uint8), want.view(np.uint8))
