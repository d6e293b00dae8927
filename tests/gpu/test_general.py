"""The general CUDA backend (attention_bias, output_qk, lse) against the NumPy reference, on a GPU.

Every case runs with ``cupa.Options(backend="general")`` (the backend is not chosen by default until these
pass), draws fresh random data, poisons ``out`` and every allocation of the call (output_qk, lse,
workspaces: util.poisoned_allocations) and checks every element: the output by contract §6's
relative error, output_qk and lse element by element (util.check_outputs_against_reference), and
every cache byte. Both kernels are covered: tensor cores (fp16/bf16, head_size 64/128/256, SEPARATE) and
CUDA cores (float32, other head sizes, LATENT).
"""

import numpy as np
import pytest

import cupa
from cupa.kernels import general
from tests import util

pytestmark = pytest.mark.gpu

GENERAL = cupa.Options(backend="general")
SHAPES = {
    "prefill": dict(q_lens=[70, 0, 130], past=[0, 0, 0]),
    "chunked": dict(q_lens=[33, 1, 0, 17], past=[300, 40, 7, 0]),
    "decode": dict(q_lens=[1] * 5, past=[300, 17, 1, 64, 250]),
}


@pytest.fixture(autouse=True)
def general_backend(monkeypatch):
    monkeypatch.setattr(util, "OPTIONS", GENERAL)


def check(cp, rng, *, dtype="float16", cache="T", metadata=None, kernel=None, **kw):
    """Build a case, check every output against the reference; ``kernel``: the one the plan must use."""
    inputs, attrs = util.build(rng, dtype=dtype, cache=cache, **kw)
    if kernel is not None:
        plan = cupa.PagedAttention(**attrs).plan(**util.to_device(cp, inputs), attention_metadata=metadata)
        assert plan.backend is general.BACKEND
        assert general.launch_plan(plan.problem, plan.device)["kernel"] == kernel
    return util.check_outputs_against_reference(cp, inputs, attrs, metadata=metadata, dtype=dtype, cache=cache)


# ---- attention_bias -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("broadcast", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("dtype,kernel", [("float16", "mma"), ("bfloat16", "mma"), ("float32", "simt")])
def test_bias_broadcast_patterns(cp, rng, shape, broadcast, dtype, kernel):
    """(B or 1, H or 1, q_capacity, kv_capacity), the sequence-local query index, both kernels."""
    check(cp, rng, dtype=dtype, kernel=kernel, H=8, Hk=2, D=128, bias=broadcast, **SHAPES[shape])


@pytest.mark.parametrize("pad", [(3, 17), (0, 0), (-20, 0), (0, -100), (-60, -250)])
@pytest.mark.parametrize("dtype,D", [("float16", 128), ("float16", 96), ("float32", 64)])
def test_bias_capacities(cp, rng, pad, dtype, D):
    """Capacities larger than needed (entries never read), exact, and smaller than needed: a (j, k) outside
    them is masked and never read (contract §4.3), so an undersized capacity masks keys and whole query rows."""
    check(cp, rng, dtype=dtype, D=D, bias=(False, False), bias_pad=pad, **SHAPES["chunked"])


@pytest.mark.parametrize("shape", ["prefill", "decode"])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_bias_with_neg_inf_entries(cp, rng, shape, dtype):
    """-inf entries mask their keys; a query row whose every key is -inf outputs zeros (lse -inf, output_qk
    probabilities 0), also with a sink."""
    check(cp, rng, dtype=dtype, bias=(False, True), bias_neg_inf=0.3, sink=True, qk_output=2, return_lse=True,
          **SHAPES[shape])


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("dtype,D", [("float16", 128), ("bfloat16", 64), ("float16", 256), ("float32", 128),
                                     ("float16", 40)])
def test_bias_softcap_sink_window(cp, rng, shape, dtype, D):
    """The bias is added after the scale and before softcap; with sinks and a window, output_qk scores."""
    check(cp, rng, dtype=dtype, D=D, bias=(True, False), softcap=5.0, sink=True, window=45, qk_output=1,
          return_lse=True, **SHAPES[shape])


@pytest.mark.parametrize("cache", ["int8", "fp8"])
@pytest.mark.parametrize("kq,vq", [("PER_TENSOR", "PER_CHANNEL"), ("PER_CHANNEL", "PER_TENSOR")])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_bias_quantized_caches(cp, rng, cache, kq, vq, dtype):
    check(cp, rng, dtype=dtype, cache=cache, k_quant=kq, v_quant=vq, D=128, bias=(False, False), qk_output=2,
          **SHAPES["chunked"])


@pytest.mark.parametrize("D", [8, 40, 64, 72, 128, 256])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_head_sizes(cp, rng, D, dtype):
    check(cp, rng, dtype=dtype, D=D, H=6, Hk=2, bias=(True, True), return_lse=True, **SHAPES["chunked"])


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_prologue_transforms_with_bias(cp, rng, dtype):
    """Packed QKV, QK-norm and rotary (the attention kernels read the Q workspace), slot_mapping, positions."""
    check(cp, rng, dtype=dtype, packed=True, qk_norm=True, rotary=True, bias=(False, False), qk_output=1,
          **SHAPES["chunked"])
    inputs, attrs = util.build(rng, dtype=dtype, rotary=True, interleaved=True, query_positions=True, bias=(True, True),
                             return_lse=True, **SHAPES["chunked"])
    inputs["slot_mapping"] = np.asarray(util.derived_slots(inputs, 16), dtype=np.int32)
    util.check_outputs_against_reference(cp, inputs, attrs, dtype=dtype)


@pytest.mark.parametrize("is_causal", [0, 1])
def test_bias_not_causal(cp, rng, is_causal):
    check(cp, rng, is_causal=is_causal, bias=(False, False), qk_output=2, window=30, **SHAPES["prefill"])


# ---- output_qk ------------------------------------------------------------------------------------------------

OUTPUT_QK_FEATURES = {
    "plain": dict(),
    "window": dict(window=20),
    "sink": dict(sink=True),
    "softcap": dict(softcap=3.0),
    "bias": dict(bias=(False, True), bias_pad=(2, 5)),
    "everything": dict(bias=(True, False), softcap=8.0, sink=True, window=64, return_lse=True),
    "int8": dict(cache="int8", k_quant="PER_CHANNEL", v_quant="PER_TENSOR"),
    "fp8": dict(cache="fp8", k_quant="PER_TENSOR", v_quant="PER_CHANNEL", sink=True),
    "block_size_1": dict(block_size=1, window=7),
    "unmapped_blocks": dict(block_table="unmapped"),
}


@pytest.mark.parametrize("feature", list(OUTPUT_QK_FEATURES))
@pytest.mark.parametrize("qk_output", [1, 2])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_output_qk(cp, rng, feature, qk_output, shape, dtype):
    """Scores (after scale, bias, softcap) or probabilities (the sink's share in the denominator) of every
    admitted key; zeros past each sequence's keys, for masked keys and for tokens without keys."""
    kw = dict(OUTPUT_QK_FEATURES[feature])
    cache = kw.pop("cache", "T")
    check(cp, rng, dtype=dtype, cache=cache, qk_output=qk_output, **SHAPES[shape], **kw)


@pytest.mark.parametrize("qk_output", [0, 1, 2])
@pytest.mark.parametrize("dtype,D", [("float16", 128), ("float32", 64)])
def test_splits(cp, rng, qk_output, dtype, D):
    """Long decode-shaped calls split their keys; the finish kernel merges the partial states in split order
    (output, lse) and turns the splits' scores into probabilities."""
    inputs, attrs = util.build(rng, q_lens=[1, 1, 2], past=[3000, 900, 5000], H=8, Hk=2, D=D, dtype=dtype,
                             bias=(False, False), sink=True, qk_output=qk_output, return_lse=True)
    plan = cupa.PagedAttention(**attrs).plan(**util.to_device(cp, inputs))
    assert general.launch_plan(plan.problem, plan.device)["num_splits"] > 1
    util.check_outputs_against_reference(cp, inputs, attrs, dtype=dtype)


@pytest.mark.parametrize("metadata", ["tight", "loose"])
def test_output_qk_width_from_the_bound(cp, rng, metadata):
    """output_qk's width is the kv bound of attention_metadata (contract §2) when given."""
    shape = SHAPES["chunked"]
    kv = max(p + q for p, q in zip(shape["past"], shape["q_lens"]))
    md = np.array([33, kv] if metadata == "tight" else [100, 1000], dtype=np.int32)
    result, dev = check(cp, rng, qk_output=2, bias=(False, False), metadata=md, **shape)
    assert result[1].shape[2] == min(int(md[1]), dev["block_table"].shape[1] * 16)


def test_output_qk_byte_limit_before_allocation(cp, rng):
    """An output_qk over Options.output_qk_max_bytes fails in validation, before any device allocation."""
    inputs, attrs = util.build(rng, qk_output=2, **SHAPES["decode"])
    dev = util.to_device(cp, inputs)
    N, H, cap = 5, attrs["num_heads"], inputs["block_table"].shape[1] * 16
    attrs = util.with_options(attrs, output_qk_max_bytes=N * H * cap * 4 - 1)
    pool = cp.get_default_memory_pool()
    used = pool.used_bytes()
    with pytest.raises(cupa.PagedAttentionError, match="expected an output_qk of at most"):
        cupa.paged_attention(**dev, **attrs)
    assert pool.used_bytes() == used


# ---- return_lse, LATENT, malformed inputs, determinism, graphs -------------------------------------------------

@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_return_lse(cp, rng, shape, dtype):
    """lse alone (no bias): the natural log of the sum of exp(score) over the admitted keys, the sink left out."""
    check(cp, rng, dtype=dtype, return_lse=True, sink=True, window=100, **SHAPES[shape])


@pytest.mark.parametrize("D,Dv,H", [(576, 512, 16), (64, 40, 4), (128, 128, 8)])
@pytest.mark.parametrize("cache,kq", [("T", "PER_CHANNEL"), ("int8", "PER_CHANNEL"), ("fp8", "PER_TENSOR")])
@pytest.mark.parametrize("shape", ["chunked", "decode"])
def test_latent_with_bias(cp, rng, D, Dv, H, cache, kq, shape):
    """LATENT (absorbed MLA): one cache, V = the leading v_head_size channels of the K row, with bias,
    output_qk and lse; quantized latent caches."""
    check(cp, rng, latent=True, D=D, v_head_size=Dv, H=H, scale=0.07, cache=cache, k_quant=kq,
          bias=(False, False), qk_output=2, return_lse=True, kernel="simt", **SHAPES[shape])


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_latent_prefill_rotary(cp, rng, dtype):
    """In-op offset RoPE on the latent row's last 64 channels (the prologue), then the bias."""
    check(cp, rng, latent=True, D=576, v_head_size=512, H=8, scale=0.05, rotary=True, rotary_dim=64,
          rotary_offset=512, bias=(True, True), dtype=dtype, **SHAPES["prefill"])


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_malformed_inputs(cp, rng, dtype):
    """Tokens no sequence owns (cum[B] < N), an invalid sequence (past < 0), block ids out of range and
    unmapped: zeros where the contract says so, never a read out of bounds."""
    inputs, attrs = util.build(rng, dtype=dtype, q_lens=[20, 3, 9], past=[40, 5, 70], block_table="unmapped",
                             bias=(False, False), qk_output=2, return_lse=True)
    inputs["cumulative_sequence_length"][-1] -= 4   # the last 4 tokens belong to no sequence
    inputs["past_seqlens"][1] = -3                  # sequence 1 is invalid
    util.check_outputs_against_reference(cp, inputs, attrs, dtype=dtype)


@pytest.mark.parametrize("dtype,cache", [("float16", "T"), ("float32", "T"), ("bfloat16", "fp8"), ("float16", "int8")])
def test_nan_in_unread_cache_rows(cp, rng, dtype, cache):
    inputs, attrs = util.build(rng, dtype=dtype, cache=cache, block_table="unmapped", past=[300, 17, 1, 64, 250],
                             q_lens=[1, 1, 1, 1, 1], bias=(False, False), qk_output=2, return_lse=True)
    assert util.poison_unused_cache_rows(inputs, 16) > 0
    util.check_outputs_against_reference(cp, inputs, attrs, dtype=dtype, cache=cache)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_bit_identical_runs_and_bounds(cp, rng, dtype):
    """Two runs give the same bits; so do absent, tight and loose attention_metadata bounds (contract §4.5)."""
    shape = dict(q_lens=[1, 5, 1], past=[2500, 300, 4000])
    inputs, attrs = util.build(rng, dtype=dtype, bias=(False, False), qk_output=2, return_lse=True, sink=True, **shape)
    kv = max(p + q for p, q in zip(shape["past"], shape["q_lens"]))
    cap = inputs["block_table"].shape[1] * 16
    util.assert_same_bits_over_bounds(cp, inputs, attrs, (None, None, np.array([5, kv], dtype=np.int32),
                                                         np.array([50, cap], dtype=np.int32)))


def test_graph_capture(cp, rng):
    """A decode step with bias, output_qk and lse captures into a CUDA graph (no host synchronization) and
    replays to the reference's outputs."""
    inputs, attrs = util.build(rng, H=8, Hk=2, D=128, past=[100, 2000, 300, 400], bias=(False, False), qk_output=2,
                             return_lse=True)
    ref = util.split_result(cupa.paged_attention(**{k: (v.copy() if isinstance(v, np.ndarray) else v)
                                                  for k, v in inputs.items()}, **util.host_attrs(attrs)),
                          attrs["qk_output"], attrs["return_lse"])
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        cupa.paged_attention(**util.to_device(cp, inputs), **attrs)  # compile first
        dev = util.to_device(cp, inputs)
        stream.synchronize()
        stream.begin_capture()
        got = util.split_result(cupa.paged_attention(**dev, **attrs), attrs["qk_output"], attrs["return_lse"])
        graph = stream.end_capture()
        graph.launch(stream)
        stream.synchronize()
    assert util.rel_err(cp.asnumpy(got[0]), ref[0]) < util.TOLERANCE["float16"]
    util.assert_elementwise(cp.asnumpy(got[1]), ref[1], util.TOLERANCE["float16"], "output_qk", floor=1e-30)
    util.assert_elementwise(cp.asnumpy(got[2]), ref[2], util.TOLERANCE["float16"], "lse")


def test_empty_call(cp, rng):
    inputs, attrs = util.build(rng, q_lens=[0, 0], past=[3, 4], bias=(False, False), qk_output=1, return_lse=True)
    out, qk, lse = cupa.paged_attention(**util.to_device(cp, inputs), **attrs)
    assert out.shape == (0, 8 * 64) and qk.shape == (8, 0, inputs["block_table"].shape[1] * 16) and lse.shape == (0, 8)


def test_not_chosen_by_default_until_verified(cp, rng, monkeypatch):
    """Unverified, without Options(backend="general") a bias call only it serves (float32) raises the clear
    error; explain() says why."""
    monkeypatch.setattr(general.BACKEND, "verified", False)
    inputs, attrs = util.build(rng, bias=(False, False), dtype="float32")
    attrs.pop("options")
    dev = util.to_device(cp, inputs)
    with pytest.raises(cupa.PagedAttentionError, match="general: not yet verified on a GPU"):
        cupa.paged_attention(**dev, **attrs)
    assert "general: chosen" in cupa.PagedAttention(**attrs, options=GENERAL).explain(**dev)
