"""attention_bias on the tensor-core prefill kernel (its bias instances) against the NumPy reference, on a GPU.

Every case runs with ``cupa.Options(backend="prefill")``, draws fresh random data, poisons ``out`` and every
allocation of the call and checks every element (util.check_outputs_against_reference: the output by
contract §6's relative error, lse element by element, every cache byte). The bias tiles are copied whole
when the bias rows are 16-byte aligned (kv capacity a multiple of 8, an aligned pointer) and entry by entry
otherwise; both forms run here, with capacities larger, equal and smaller than the lengths (contract §4.3),
broadcast dimensions, -inf and NaN entries, every mask and the launch-bound rules of §4.5.
"""

import numpy as np
import pytest

import cupa
from cupa.kernels import prefill
from tests import util

pytestmark = pytest.mark.gpu

PREFILL = cupa.Options(backend="prefill")
SHAPES = {
    "prefill": dict(q_lens=[70, 0, 130], past=[0, 0, 0]),
    "chunked": dict(q_lens=[33, 1, 0, 17], past=[300, 40, 7, 0]),
    "long": dict(q_lens=[260, 200], past=[0, 500]),
}


@pytest.fixture(autouse=True)
def prefill_backend(monkeypatch):
    monkeypatch.setattr(util, "OPTIONS", PREFILL)


def check(cp, rng, *, dtype="float16", cache="T", metadata=None, inputs_fn=None, **kw):
    inputs, attrs = util.build(rng, dtype=dtype, cache=cache, **kw)
    if inputs_fn is not None:
        inputs_fn(inputs)
    plan = cupa.PagedAttention(**attrs).plan(**util.to_device(cp, inputs), attention_metadata=metadata)
    assert plan.backend is prefill.BACKEND
    assert plan.backend._spec(plan.problem, plan.device, plan.options).name_expression.endswith(", true>")
    return util.check_outputs_against_reference(cp, inputs, attrs, metadata=metadata, dtype=dtype, cache=cache)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("broadcast", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_bias_broadcast_patterns(cp, rng, shape, broadcast, dtype):
    """(B or 1, H or 1, q_capacity, kv_capacity), the sequence-local query index."""
    check(cp, rng, dtype=dtype, H=8, Hk=2, D=128, bias=broadcast, **SHAPES[shape])


@pytest.mark.parametrize("pad", [(3, 17), (0, 0), (0, 8), (-20, 0), (0, -100), (-60, -250), (5, 3)])
@pytest.mark.parametrize("D", [64, 128, 256])
def test_bias_capacities(cp, rng, pad, D):
    """Capacities larger than needed, exact and smaller than needed (masked, never read); kv capacities of
    any residue mod 8 (the whole-chunk copies and the entry-by-entry ones)."""
    check(cp, rng, D=D, H=8, Hk=2, bias=(False, False), bias_pad=pad, **SHAPES["chunked"])


@pytest.mark.parametrize("cache,kq,vq,v_cache", [
    ("int8", "PER_CHANNEL", "PER_CHANNEL", None), ("int8", "PER_TENSOR", "PER_CHANNEL", None),
    ("fp8", "PER_TENSOR", "PER_TENSOR", None), ("fp8", "PER_CHANNEL", "PER_TENSOR", None),
    ("int4", "PER_CHANNEL", "PER_CHANNEL", None), ("fp4", "PER_TENSOR", "PER_CHANNEL", None),
    ("int4", "PER_CHANNEL", "PER_TENSOR", "fp4"), ("fp4", "PER_CHANNEL", "PER_CHANNEL", "int4"),
])
@pytest.mark.parametrize("dtype,D", [("float16", 128), ("bfloat16", 128), ("float16", 64), ("bfloat16", 256)])
def test_bias_quantized_and_packed_caches(cp, rng, cache, kq, vq, v_cache, dtype, D):
    """int8, fp8 and packed 4-bit caches (K and V of either 4-bit kind), both scale granularities, with a bias."""
    check(cp, rng, dtype=dtype, cache=cache, v_cache=v_cache, k_quant=kq, v_quant=vq, D=D, bias=(False, True),
          bias_pad=(2, 5), sink=True, return_lse=True, **SHAPES["chunked"])


def test_bias_fp8_nan_codes_in_unread_rows(cp, rng):
    inputs, attrs = util.build(rng, cache="fp8", block_table="unmapped", bias=(False, False), return_lse=True,
                               **SHAPES["chunked"])
    assert util.poison_unused_cache_rows(inputs, 16) > 0
    util.check_outputs_against_reference(cp, inputs, attrs, cache="fp8")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_unaligned_bias_pointer(cp, rng, dtype):
    """A bias that is a view starting one element into its buffer: rows not 16-byte aligned, entry-by-entry
    copies."""
    inputs, attrs = util.build(rng, dtype=dtype, bias=(False, False), bias_pad=(0, 8), **SHAPES["chunked"])
    bias = inputs["attention_bias"]
    dev = util.to_device(cp, inputs)
    flat = cp.empty(bias.size + 1, dtype=dev["attention_bias"].dtype)
    view = flat[1:].reshape(bias.shape)
    view[...] = dev["attention_bias"]
    assert view.data.ptr % 16 != 0
    dev["attention_bias"] = view
    ref = cupa.paged_attention(**{k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in inputs.items()},
                               **util.host_attrs(attrs))
    out = cupa.paged_attention(**dev, **attrs)
    util.assert_rel(cp.asnumpy(out), ref, dtype)


@pytest.mark.parametrize("shape", ["prefill", "chunked"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_bias_with_neg_inf_entries(cp, rng, shape, dtype):
    """-inf entries mask keys (a row of only -inf outputs zeros), with sinks and lse."""
    check(cp, rng, dtype=dtype, bias=(False, True), bias_neg_inf=0.3, sink=True, return_lse=True, **SHAPES[shape])


@pytest.mark.parametrize("shape", ["prefill", "chunked"])
@pytest.mark.parametrize("D", [64, 128])
def test_bias_softcap_sink_window(cp, rng, shape, D):
    """The bias is added after the scale and before softcap; with sinks and a window."""
    check(cp, rng, D=D, bias=(True, False), softcap=5.0, sink=True, window=45, return_lse=True, **SHAPES[shape])


@pytest.mark.parametrize("is_causal", [0, 1])
def test_bias_not_causal(cp, rng, is_causal):
    check(cp, rng, is_causal=is_causal, bias=(False, False), window=30, return_lse=True, **SHAPES["prefill"])


@pytest.mark.parametrize("block_size", [1, 48, 256])
def test_bias_block_sizes(cp, rng, block_size):
    check(cp, rng, block_size=block_size, bias=(True, True), bias_pad=(1, 3), **SHAPES["long"])


def test_bias_gqa_groups(cp, rng):
    """Groups of 1, 6 and 32 query heads a KV head: row tiles cut across tokens and heads."""
    for H, Hk in ((4, 4), (12, 2), (32, 1)):
        check(cp, rng, H=H, Hk=Hk, D=64, bias=(False, False), **SHAPES["chunked"])


def test_prologue_transforms_with_bias(cp, rng):
    """Packed QKV, QK-norm and in-op RoPE, then the bias; explicit query positions."""
    check(cp, rng, packed=True, qk_norm=True, rotary=True, bias=(False, False), return_lse=True,
          **SHAPES["chunked"])
    inputs, attrs = util.build(rng, rotary=True, interleaved=True, query_positions=True, bias=(True, True),
                               **SHAPES["chunked"])
    util.check_outputs_against_reference(cp, inputs, attrs)


def _nan_outside_admitted(inputs):
    """NaN in every bias entry of a key its query token does not admit (causal future, beyond kv_len)."""
    bias = inputs["attention_bias"]
    q_lens = np.diff(inputs["cumulative_sequence_length"])
    past = inputs["past_seqlens"]
    for b in range(bias.shape[0]):
        for j in range(bias.shape[2]):
            if j < q_lens[b]:
                bias[b, :, j, past[b] + j + 1:] = np.nan
            else:
                bias[b, :, j, :] = np.nan


def test_nan_bias_entries_never_reach_a_token(cp, rng):
    """contract §4.4: entries of keys a token does not admit never change its output (read or not)."""
    check(cp, rng, bias=(False, False), bias_pad=(4, 40), inputs_fn=_nan_outside_admitted, return_lse=True,
          **SHAPES["chunked"])


def test_malformed_inputs(cp, rng):
    """Tokens no sequence owns, an invalid sequence, block ids out of range and unmapped: zeros where the
    contract says so, never a read out of bounds."""
    inputs, attrs = util.build(rng, q_lens=[20, 3, 9], past=[40, 5, 70], block_table="unmapped",
                               bias=(False, False), return_lse=True)
    inputs["cumulative_sequence_length"][-1] -= 4
    inputs["past_seqlens"][1] = -3
    util.check_outputs_against_reference(cp, inputs, attrs)


def test_nan_in_unread_cache_rows(cp, rng):
    inputs, attrs = util.build(rng, block_table="unmapped", bias=(False, False), return_lse=True, **SHAPES["chunked"])
    assert util.poison_unused_cache_rows(inputs, 16) > 0
    util.check_outputs_against_reference(cp, inputs, attrs)


def test_bit_identical_runs_and_bounds(cp, rng):
    """Two runs give the same bits; so do absent, tight and loose attention_metadata bounds (contract §4.5)."""
    shape = SHAPES["chunked"]
    inputs, attrs = util.build(rng, bias=(False, False), return_lse=True, sink=True, **shape)
    kv = max(p + q for p, q in zip(shape["past"], shape["q_lens"]))
    cap = inputs["block_table"].shape[1] * 16
    util.assert_same_bits_over_bounds(cp, inputs, attrs, (None, None, np.array([33, kv], dtype=np.int32),
                                                         np.array([50, cap], dtype=np.int32)))


def test_graph_capture(cp, rng):
    """A prefill step with a bias captures into a CUDA graph and replays to the reference's output."""
    inputs, attrs = util.build(rng, bias=(True, False), **SHAPES["chunked"])
    util.check_graph_capture(cp, inputs, attrs, None)


def test_not_chosen_by_default_until_verified(cp, rng, monkeypatch):
    """While its bias instances are unverified, a bias prefill goes to the general backend, and explain() says
    why; Options(backend="prefill") runs it."""
    monkeypatch.setattr(prefill.BACKEND, "unverified", frozenset({"bias"}))
    inputs, attrs = util.build(rng, bias=(False, False), **SHAPES["prefill"])
    attrs.pop("options")
    dev = util.to_device(cp, inputs)
    text = cupa.PagedAttention(**attrs).explain(**dev)
    assert "prefill: not eligible: attention_bias: not yet verified on a GPU here" in text, text
    assert "prefill: chosen" in cupa.PagedAttention(**attrs, options=PREFILL).explain(**dev)
