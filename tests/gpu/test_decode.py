"""CUDA decode backend (prologue + paged flash-decoding + merge) against the NumPy reference.

Quick tier: the unmarked-slow tests (run after every kernel change). Full matrix: `slow`.
Every run draws fresh random data, poisons the output and checks every element and cache byte.
"""


import numpy as np
import pytest

import cupa
from tests import util

pytestmark = pytest.mark.gpu


# ---- quick tier -----------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_decode_basic(cp, rng, dtype):
    inputs, attrs = util.build(rng, B=5, H=8, Hk=2, D=128, dtype=dtype)
    util.check_against_reference(cp, inputs, attrs, dtype=dtype)


@pytest.mark.parametrize("cache", ["int8", "fp8"])
@pytest.mark.parametrize("kq,vq", [("PER_TENSOR", "PER_CHANNEL"), ("PER_CHANNEL", "PER_TENSOR")])
def test_decode_quantized(cp, rng, cache, kq, vq):
    inputs, attrs = util.build(rng, B=4, H=8, Hk=2, D=128, cache=cache, k_quant=kq, v_quant=vq)
    util.check_against_reference(cp, inputs, attrs, cache=cache)


@pytest.mark.parametrize("cache", ["int8", "fp8"])
@pytest.mark.parametrize("H,Hk,D", [(8, 1, 128), (12, 4, 64), (16, 2, 128), (16, 1, 64)])
def test_decode_quantized_group_sizes(cp, rng, cache, H, Hk, D):
    """8-bit caches with GQA groups of 8 or fewer query heads (the keys-as-M loop, 8 heads per CTA) and
    of more (the head-major loop, 16 per CTA), with softcap, a window and sinks."""
    inputs, attrs = util.build(rng, B=3, H=H, Hk=Hk, D=D, cache=cache, softcap=25.0, window=300, sink=True,
                             past=[900, 40, 2500])
    util.check_against_reference(cp, inputs, attrs, cache=cache)


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("dtype,cache", [("float16", "T"), ("float32", "T"), ("bfloat16", "fp8"),
                                         ("float16", "int8")])
def test_decode_nan_in_unread_cache_rows(cp, rng, block_size, dtype, cache):
    """NaN (fp8: 0x7F) in every cache row no sequence reads -- past each sequence's last key, evicted and
    spare blocks -- never reaches the output (the tensor-core and CUDA-core loops, 8-bit included)."""
    inputs, attrs = util.build(rng, B=5, H=8, Hk=2, D=128, dtype=dtype, cache=cache, block_size=block_size,
                             block_table="unmapped", past=[300, 17, 1, 64, 250])
    assert util.poison_unused_cache_rows(inputs, block_size) > 0
    util.check_against_reference(cp, inputs, attrs, dtype=dtype, cache=cache)


@pytest.mark.parametrize("cache", ["int8", "fp8"])
def test_decode_quantized_ragged_through_the_decode_backend(cp, rng, cache):
    """Several tokens per sequence (causal within the call), zero-token sequences and a window through the
    decode backend itself (dispatch would send this call to prefill): the keys-as-M loop per token."""
    from cupa.kernels import decode

    inputs, attrs = util.build(rng, q_lens=[3, 0, 9, 1], past=[40, 7, 0, 1200], H=8, Hk=2, D=128, cache=cache,
                             window=100, sink=True)
    ref = cupa.paged_attention(**{k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in inputs.items()},
                               **util.host_attrs(attrs))
    dev = util.to_device(cp, inputs)
    named = util.with_options(attrs, backend="decode")
    op = cupa.PagedAttention(**named)
    plan = op.plan(**dev)
    assert plan.backend is decode.BACKEND and decode.uses_keys_as_m(plan.problem, plan.options)
    out = cp.full((plan.problem.token_count, 8 * 128), np.nan, dtype=dev["query"].dtype)
    op(**dev, out=out)
    host = cp.asnumpy(out)
    assert not np.isnan(host.astype(np.float32)).any()
    assert util.rel_err(host, ref) < util.TOLERANCE["float16"]


def test_decode_quantized_head_major_switch(cp, rng):
    """_tuning.decode_keys_as_m=False keeps 8-bit caches on the head-major loop (for A/B runs); both are right."""
    from cupa.kernels import decode
    from cupa.options import _Tuning

    inputs, attrs = util.build(rng, B=4, H=8, Hk=2, D=128, cache="int8", past=[700, 1500, 3, 90])
    problem = cupa.PagedAttention(**attrs).plan(**inputs).problem
    default, head_major = cupa.Options(), cupa.Options(_tuning=_Tuning(decode_keys_as_m=False))
    assert decode.uses_keys_as_m(problem, default) and decode.heads_per_cta(problem, default) == 8
    assert not decode.uses_keys_as_m(problem, head_major) and decode.heads_per_cta(problem, head_major) == 16
    util.check_against_reference(cp, inputs, attrs, cache="int8")
    util.check_against_reference(cp, inputs, dict(attrs, options=head_major), cache="int8")


def test_decode_features_combined(cp, rng):
    inputs, attrs = util.build(rng, B=6, H=8, Hk=2, D=64, rotary=True, interleaved=True, qk_norm=True, sink=True,
                             softcap=30.0, window=37, packed=True)
    util.check_against_reference(cp, inputs, attrs)


def test_decode_ragged_prefill_shaped(cp, rng):
    # token_count > batch_size and zero-token sequences: the decode kernel stays correct
    inputs, attrs = util.build(rng, q_lens=[3, 0, 17, 1, 0, 40], past=[5, 9, 0, 100, 0, 31], H=4, Hk=4, D=64,
                             rotary=True)
    util.check_against_reference(cp, inputs, attrs)


def test_decode_metadata_bit_identical(cp, rng):
    inputs, attrs = util.build(rng, B=3, H=8, Hk=2, D=128, past=[3000, 17, 900], block_size=16)
    cap = inputs["block_table"].shape[1] * 16
    outs = []
    for md in (None, [1, 3001], [1, cap], [5, 10**9], [1, 3001, 17]):
        fresh = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in inputs.items()}
        out, _ = util.check_against_reference(cp, fresh, attrs, metadata=md)
        outs.append(cp.asnumpy(out).view(np.uint16))
    for o in outs[1:]:
        assert np.array_equal(o, outs[0]), "attention_metadata changed the result bits"


def test_decode_deterministic(cp, rng):
    inputs, attrs = util.build(rng, B=2, H=16, Hk=2, D=128, past=[5000, 7000])
    dev = util.to_device(cp, inputs)
    a = cupa.paged_attention(**dev, **attrs)
    b = cupa.paged_attention(**dev, **attrs)
    assert np.array_equal(cp.asnumpy(a).view(np.uint16), cp.asnumpy(b).view(np.uint16))


def test_decode_slot_mapping_skip(cp, rng):
    inputs, attrs = util.build(rng, B=4, H=4, Hk=2, D=64, q_lens=[2, 1, 3, 1])
    slots = util.derived_slots(inputs, 16)
    slots[1] = -1
    slots[4] = -1
    inputs["slot_mapping"] = np.asarray(slots, dtype=np.int32)
    util.check_against_reference(cp, inputs, attrs)


@pytest.mark.parametrize("table", ["shared", "unmapped"])
def test_decode_block_tables(cp, rng, table):
    inputs, attrs = util.build(rng, B=4, H=4, Hk=1, D=64, block_table=table, past=[70, 80, 90, 60])
    util.check_against_reference(cp, inputs, attrs)


def test_decode_malformed(cp, rng):
    inputs, attrs = util.build(rng, B=4, H=4, Hk=2, D=64, q_lens=[1, 1, 1, 1], past=[10, 20, 30, 40])
    inputs["past_seqlens"][1] = -5                       # invalid sequence: zeros, no write
    inputs["past_seqlens"][2] = 10**6                    # beyond the table: invalid
    inputs["block_table"][3, 0] = 10**6                   # out-of-range block: masked
    util.check_against_reference(cp, inputs, attrs)


def test_decode_empty_call(cp, rng):
    inputs, attrs = util.build(rng, q_lens=[0, 0], past=[3, 4], H=4, Hk=2, D=64)
    dev = util.to_device(cp, inputs)
    out = cupa.paged_attention(**dev, **attrs)
    assert out.shape == (0, 4 * 64)


def test_decode_graph_capture(cp, rng):
    """The call captures into a CUDA graph on a CuPy stream: proof of no host synchronization."""
    inputs, attrs = util.build(rng, B=4, H=8, Hk=2, D=128, past=[100, 200, 300, 400])
    util.check_graph_capture(cp, inputs, attrs, metadata=[1, 512])


@pytest.mark.parametrize("feature", ["bias", "qk_output", "latent"])
def test_decode_backend_declines_what_it_does_not_serve(cp, rng, feature):
    """Named, the decode backend raises a PagedAttentionError naming the feature (auto gives such calls to
    the mla or general backend); output_qk it serves with 16-bit caches only (tests/gpu/test_decode_qk.py)."""
    inputs, attrs = util.build(rng, B=2, H=4, Hk=1, D=64, cache="int8" if feature == "qk_output" else "T")
    attrs["options"] = cupa.Options(backend="decode")
    dev = util.to_device(cp, inputs)
    if feature == "bias":
        dev["attention_bias"] = cp.zeros((1, 1, 1, 512), dtype=cp.float16) + 1
        match = "attention_bias"
    elif feature == "qk_output":
        attrs["qk_output"] = 1
        match = "output_qk"
    else:
        dev.pop("value")
        dev.pop("value_cache")
        attrs.update(kv_cache_layout="LATENT", scale=0.1)
        match = "LATENT"
    with pytest.raises(cupa.PagedAttentionError, match=match):
        cupa.paged_attention(**dev, **attrs)


def test_explain_reports_decode(cp, rng):
    inputs, attrs = util.build(rng, B=2, H=4, Hk=1, D=64)
    op = cupa.PagedAttention(**attrs)
    text = op.explain(**util.to_device(cp, inputs))
    assert "decode: chosen" in text


# ---- full matrix (slow) -----------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("D", [8, 40, 64, 72, 128, 256])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_matrix_head_sizes(cp, rng, D, dtype):
    inputs, attrs = util.build(rng, B=3, H=6, Hk=2, D=D, dtype=dtype, rotary=D >= 16, rotary_dim=min(D, 32) // 8 * 8)
    util.check_against_reference(cp, inputs, attrs, dtype=dtype)


@pytest.mark.slow
@pytest.mark.parametrize("H,Hk", [(4, 4), (6, 2), (8, 1), (16, 2), (32, 2), (24, 8), (12, 12)])
def test_matrix_groups(cp, rng, H, Hk):
    inputs, attrs = util.build(rng, B=3, H=H, Hk=Hk, D=64)
    util.check_against_reference(cp, inputs, attrs)


@pytest.mark.slow
@pytest.mark.parametrize("block_size", [1, 16, 64, 256])
def test_matrix_block_sizes(cp, rng, block_size):
    inputs, attrs = util.build(rng, B=4, H=8, Hk=2, D=128, block_size=block_size, past=[1, 700, 2000, 255])
    util.check_against_reference(cp, inputs, attrs)


@pytest.mark.slow
@pytest.mark.parametrize("sink", [False, True])
@pytest.mark.parametrize("window", [-1, 1, 50])
@pytest.mark.parametrize("softcap", [0.0, 20.0])
def test_matrix_sink_window_softcap(cp, rng, sink, window, softcap):
    inputs, attrs = util.build(rng, B=4, H=8, Hk=2, D=64, sink=sink, window=window, softcap=softcap,
                             q_lens=[1, 3, 1, 2], past=[300, 20, 2, 100])
    util.check_against_reference(cp, inputs, attrs)


@pytest.mark.slow
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("rotary,interleaved", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("packed", [False, True])
def test_matrix_prologue(cp, rng, norm, rotary, interleaved, packed):
    inputs, attrs = util.build(rng, B=3, H=8, Hk=2, D=128, qk_norm=norm, rotary=rotary, interleaved=interleaved,
                             packed=packed, rotary_dim=64, rotary_offset=32 if rotary else 0, q_lens=[1, 4, 2])
    util.check_against_reference(cp, inputs, attrs)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("cache", ["int8", "fp8"])
@pytest.mark.parametrize("kq", ["PER_TENSOR", "PER_CHANNEL"])
@pytest.mark.parametrize("vq", ["PER_TENSOR", "PER_CHANNEL"])
def test_matrix_quant(cp, rng, dtype, cache, kq, vq):
    inputs, attrs = util.build(rng, B=3, H=8, Hk=2, D=128, dtype=dtype, cache=cache, k_quant=kq, v_quant=vq,
                             rotary=True, sink=True, q_lens=[1, 2, 1])
    util.check_against_reference(cp, inputs, attrs, dtype=dtype, cache=cache)


@pytest.mark.slow
def test_matrix_query_positions_and_causal0(cp, rng):
    inputs, attrs = util.build(rng, q_lens=[4, 2, 0, 5], past=[10, 0, 3, 64], H=4, Hk=2, D=64, query_positions=True,
                             is_causal=0, window=6, rotary=True)
    util.check_against_reference(cp, inputs, attrs)


@pytest.mark.slow
def test_matrix_large_batch(cp, rng):
    B = 512
    inputs, attrs = util.build(rng, B=B, H=8, Hk=2, D=64, past=list(rng.integers(0, 300, size=B)))
    util.check_against_reference(cp, inputs, attrs)


@pytest.mark.slow
def test_matrix_long_context_splits(cp, rng):
    inputs, attrs = util.build(rng, B=2, H=32, Hk=8, D=128, past=[20000, 33000], block_size=16)
    util.check_against_reference(cp, inputs, attrs)
