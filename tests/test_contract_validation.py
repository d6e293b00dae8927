"""Negative tests: one test per validation rule (seed section 15 / 17.5, contract §1-§5).

Every test asserts the message, not just the failure: the offending input or attribute comes
first ("<name>: got <...>; expected <...>"), followed by a distinctive part of what it got and
what it expected.

Each rule runs twice (the ``check`` fixture's two params):

* ``validate``: ``cupa.contract.validate(Attributes(...), {name: ArrayInfo}, metadata)``;
* ``plan``: ``cupa.PagedAttention(...).plan(...)`` with small NumPy arrays, with backend
  selection replaced by a stub so that no backend can run: every violation must be raised by
  validation, before a backend is chosen.

A valid baseline is built once per test and exactly one thing is changed.
"""

from __future__ import annotations

import math
import re

import ml_dtypes
import numpy as np
import pytest

import cupa
from cupa import PagedAttention, PagedAttentionError, Problem
from cupa import contract, dispatch
from cupa.contract import ArrayInfo, Attributes, metadata_values, validate

# ---------------------------------------------------------------------------------------------
# baseline and runners

N, B, H, HK, D = 5, 2, 4, 2, 16          # tokens, sequences, heads, kv heads, head size
NB, BS, MB = 6, 4, 3                     # num_blocks, block_size, max blocks per sequence

_NP = {"float16": np.float16, "float32": np.float32, "float64": np.float64,
       "bfloat16": ml_dtypes.bfloat16, "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
       "float8_e5m2": ml_dtypes.float8_e5m2, "int8": np.int8, "uint8": np.uint8,
       "int32": np.int32, "int64": np.int64, "uint32": np.uint32}


def A(shape, dtype="float16") -> ArrayInfo:
    return ArrayInfo(shape=tuple(shape), dtype=dtype)


def separate(T="float16", **changes):
    """(attrs, infos) of a valid SEPARATE call, then ``changes`` applied (None removes an input)."""
    infos = {
        "query": A((N, H * D), T), "key": A((N, HK * D), T), "value": A((N, HK * D), T),
        "key_cache": A((NB, BS, HK, D), T), "value_cache": A((NB, BS, HK, D), T),
        "cumulative_sequence_length": A((B + 1,), "int32"), "past_seqlens": A((B,), "int32"),
        "block_table": A((B, MB), "int32"),
    }
    infos.update(changes)
    return {"num_heads": H, "kv_num_heads": HK}, infos


def packed(**changes):
    attrs, infos = separate(key=None, value=None, query=A((N, (H + 2 * HK) * D)))
    infos.update(changes)
    return attrs, infos


LD, LDV = 32, 16                          # LATENT head_size and v_head_size


def latent(**changes):
    """A valid LATENT (absorbed MLA) call: one latent head, V = leading LDV channels of K."""
    infos = {
        "query": A((N, H * LD)), "key": A((N, LD)), "key_cache": A((NB, BS, 1, LD)),
        "cumulative_sequence_length": A((B + 1,), "int32"), "past_seqlens": A((B,), "int32"),
        "block_table": A((B, MB), "int32"),
    }
    infos.update(changes)
    attrs = {"num_heads": H, "kv_num_heads": 1, "kv_cache_layout": "LATENT", "v_head_size": LDV,
             "scale": 0.125}
    return attrs, infos


def quantized(cache="int8", kq="PER_TENSOR", vq="PER_CHANNEL", **changes):
    """A valid quantized SEPARATE call (int8 / float8_e4m3fn / uint8 e4m3 bytes caches)."""
    attrs, infos = separate(key_cache=A((NB, BS, HK, D), cache), value_cache=A((NB, BS, HK, D), cache))
    attrs.update(k_quant_type=kq, v_quant_type=vq)
    if cache == "uint8":
        attrs.update(k_cache_dtype="float8e4m3fn", v_cache_dtype="float8e4m3fn")
    infos["k_scale"] = A((1,) if kq == "PER_TENSOR" else (HK, 1, D), "float32")
    infos["v_scale"] = A((1,) if vq == "PER_TENSOR" else (HK, 1, D), "float32")
    infos.update(changes)
    return attrs, infos


def rotary(half=4, **changes):
    attrs, infos = separate(cos_cache=A((64, half)), sin_cache=A((64, half)))
    attrs["do_rotary"] = 1
    infos.update(changes)
    return attrs, infos


def _array(info: ArrayInfo):
    return np.zeros(info.shape, dtype=_NP[info.dtype])


_STUB_BACKEND = object()


@pytest.fixture(params=["validate", "plan"])
def check(request, monkeypatch):
    """``check(attrs, infos, metadata=None, **more_attrs) -> Problem`` through one of the two paths."""

    def no_backend(problem, inputs, options, writes=True):   # validation passed: stand in for any backend
        return dispatch.Plan(problem, _STUB_BACKEND, None, options, writes=writes)

    monkeypatch.setattr(dispatch, "make_plan", no_backend)

    def run(attrs, infos, metadata=None, options=None, **more_attrs):
        attrs = {**attrs, **more_attrs}
        if request.param == "validate":
            limit = (options or cupa.Options()).output_qk_max_bytes
            return validate(Attributes(**attrs), infos, metadata_values(metadata), output_qk_max_bytes=limit)
        op = PagedAttention(**attrs, options=options)
        arrays = {name: _array(info) for name, info in infos.items() if info is not None}
        plan = op.plan(**arrays, attention_metadata=metadata)
        problem, backend = plan.problem, plan.backend
        assert backend is _STUB_BACKEND
        return problem

    run.mode = request.param
    return run


def raises(name, *parts):
    """pytest.raises for PagedAttentionError: '<name>: got ...' then each part, in order."""
    pattern = "^" + re.escape(name) + ": got .*" + ".*".join(re.escape(p) for p in parts)
    return pytest.raises(PagedAttentionError, match=re.compile(pattern, re.S))


# ---------------------------------------------------------------------------------------------
# the baselines are valid (so each negative test changes exactly one thing)

def test_error_type_is_value_error():
    assert issubclass(PagedAttentionError, ValueError)
    assert cupa.PagedAttentionError is PagedAttentionError


def test_valid_separate(check):
    p = check(*separate())
    assert isinstance(p, Problem)
    assert (p.token_count, p.batch_size, p.num_heads, p.kv_num_heads, p.head_size) == (N, B, H, HK, D)
    assert (p.v_head_size, p.group_size, p.packed_qkv, p.latent, p.dtype) == (D, H // HK, False, False, "float16")
    assert (p.num_blocks, p.block_size, p.max_blocks_per_seq, p.kv_capacity) == (NB, BS, MB, MB * BS)
    assert p.cache_kind == "T" and not p.quantized and p.scale == pytest.approx(1 / math.sqrt(D))
    assert p.output_shape == (N, H * D)


def test_valid_packed(check):
    p = check(*packed())
    assert p.packed_qkv and p.head_size == D


def test_valid_latent(check):
    p = check(*latent())
    assert p.latent and p.head_size == LD and p.v_head_size == LDV and p.output_shape == (N, H * LDV)
    assert p.scale == 0.125 and p.kv_num_heads == 1


def test_valid_latent_head_size_above_256(check):
    attrs, infos = latent(query=A((N, H * 576)), key=A((N, 576)), key_cache=A((NB, BS, 1, 576)))
    p = check(attrs, infos, v_head_size=512)
    assert (p.head_size, p.v_head_size) == (576, 512)


@pytest.mark.parametrize("cache,kq", [("int8", "PER_CHANNEL"), ("float8_e4m3fn", "PER_TENSOR"), ("uint8", "PER_TENSOR")])
def test_valid_latent_quantized(check, cache, kq):
    attrs, infos = latent(key_cache=A((NB, BS, 1, LD), cache),
                          k_scale=A((1, 1, LD) if kq == "PER_CHANNEL" else (1,), "float32"))
    more = {"k_cache_dtype": "float8e4m3fn"} if cache == "uint8" else {}
    p = check(attrs, infos, k_quant_type=kq, **more)
    assert p.latent and p.quantized and p.k_quant == p.v_quant == kq


@pytest.mark.parametrize("cache", ["int8", "float8_e4m3fn", "uint8"])
def test_valid_quantized(check, cache):
    p = check(*quantized(cache))
    assert p.quantized and p.cache_kind == ("int8" if cache == "int8" else "fp8")
    assert p.fp8_as_bytes == (cache == "uint8")
    assert (p.k_quant, p.v_quant) == ("PER_TENSOR", "PER_CHANNEL")


@pytest.mark.parametrize("T", ["float16", "bfloat16", "float32"])
def test_valid_cache_dtype_named_explicitly(check, T):
    attrs, infos = separate(T)
    p = check(attrs, infos, k_cache_dtype=T, v_cache_dtype=T)
    assert p.dtype == T and p.cache_kind == "T"


def test_valid_every_optional_input(check):
    attrs, infos = rotary(
        slot_mapping=A((N,), "int32"), query_positions=A((N,), "int32"), head_sink=A((H,)),
        q_norm_weight=A((D,)), k_norm_weight=A((D,)), attention_bias=A((1, H, 3, 7)))
    p = check(attrs, infos, [2, 9, 4], rotary_offset=8, qk_output=2)
    assert (p.rotary_dim, p.rotary_max_pos) == (8, 64)
    assert p.has_slot_mapping and p.has_query_positions and p.has_head_sink and p.has_qk_norm and p.has_bias
    assert p.bias_shape == (1, H, 3, 7)
    assert (p.max_query_len_bound, p.max_kv_len_bound, p.max_kv_len_lower_bound) == (2, 9, 4)
    assert p.output_qk_shape == (H, N, 9)


def test_valid_token_count_zero(check):
    """token_count == 0 is valid: an empty output, nothing launched."""
    attrs, infos = separate(query=A((0, H * D)), key=A((0, HK * D)), value=A((0, HK * D)))
    p = check(attrs, infos)
    assert p.token_count == 0 and p.output_shape == (0, H * D)


def test_valid_metadata_clamped_to_static_capacity(check):
    p = check(*separate(), np.array([100, 1000], np.int32))
    assert (p.max_query_len_bound, p.max_kv_len_bound, p.kv_capacity) == (N, MB * BS, MB * BS)
    p = check(*separate(), (0, 0))
    assert (p.max_query_len_bound, p.max_kv_len_bound) == (N, MB * BS)


def test_valid_string_attributes_as_bytes():
    """ONNX helper attributes arrive as bytes; they are decoded, not rejected."""
    a = Attributes(num_heads=4, kv_num_heads=2, k_quant_type=b"PER_TENSOR", kv_cache_layout=b"SEPARATE")
    assert a.k_quant_type == "PER_TENSOR" and a.kv_cache_layout == "SEPARATE"


# ---------------------------------------------------------------------------------------------
# attributes (contract §3)

def test_num_heads_required():
    with raises("num_heads", "None (absent)", "; expected an integer >= 1", "required attribute"):
        PagedAttention(kv_num_heads=1)


def test_kv_num_heads_required():
    with raises("kv_num_heads", "None (absent)", "; expected an integer >= 1", "required attribute"):
        PagedAttention(num_heads=4)


def test_num_heads_positive(check):
    with raises("num_heads", "0", "; expected an integer >= 1"):
        check(*separate(), num_heads=0)


def test_kv_num_heads_positive(check):
    with raises("kv_num_heads", "-2", "; expected an integer >= 1"):
        check(*separate(), kv_num_heads=-2)


@pytest.mark.parametrize("bad", [4.0, "4", True])
def test_integer_attribute_type(check, bad):
    with raises("num_heads", repr(bad), "; expected an integer"):
        check(*separate(), num_heads=bad)


def test_kv_num_heads_divides_num_heads(check):
    with raises("kv_num_heads", "3", "; expected a divisor of num_heads=4", "num_heads % kv_num_heads == 0"):
        check(*separate(), kv_num_heads=3)


@pytest.mark.parametrize("name", ["scale", "softcap", "qk_norm_epsilon"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_real_attribute_finite(check, name, bad):
    with raises(name, repr(float(bad)), "; expected a finite number"):
        check(*separate(), **{name: bad})


def test_real_attribute_type(check):
    with raises("scale", "'0.5' (str)", "; expected a real number"):
        check(*separate(), scale="0.5")


def test_scale_not_negative(check):
    with raises("scale", "-0.5", "; expected 0 (meaning 1/sqrt(head_size)) or a positive number"):
        check(*separate(), scale=-0.5)


def test_softcap_not_negative(check):
    with raises("softcap", "-30.0", "; expected 0 (off) or a positive number"):
        check(*separate(), softcap=-30.0)


@pytest.mark.parametrize("bad", [0, -2, -100])
def test_local_window_size(check, bad):
    with raises("local_window_size", str(bad), "; expected -1 (no window) or a positive window W"):
        check(*separate(), local_window_size=bad)


@pytest.mark.parametrize("name", ["is_causal", "do_rotary", "rotary_interleaved"])
@pytest.mark.parametrize("bad", [2, -1])
def test_flag_attributes_are_0_or_1(check, name, bad):
    with raises(name, str(bad), "; expected 0 or 1"):
        check(*separate(), **{name: bad})


def test_rotary_offset_not_negative(check):
    with raises("rotary_offset", "-8", "; expected an integer >= 0"):
        check(*separate(), rotary_offset=-8)


def test_rotary_offset_multiple_of_8(check):
    with raises("rotary_offset", "4", "; expected a multiple of 8"):
        check(*separate(), rotary_offset=4)


@pytest.mark.parametrize("bad", [0.0, -1e-6])
def test_qk_norm_epsilon_positive(check, bad):
    with raises("qk_norm_epsilon", repr(bad), "; expected a positive number"):
        check(*separate(), qk_norm_epsilon=bad)


@pytest.mark.parametrize("name", ["k_quant_type", "v_quant_type"])
def test_quant_type_vocabulary(check, name):
    with raises(name, "'PER_BLOCK'", "; expected one of 'NONE', 'PER_TENSOR', 'PER_CHANNEL'"):
        check(*separate(), **{name: "PER_BLOCK"})


@pytest.mark.parametrize("name", ["k_cache_dtype", "v_cache_dtype"])
def test_cache_dtype_vocabulary(check, name):
    with raises(name, "'float64'", "; expected one of ''", "'int8'", "'float8e4m3fn'"):
        check(*separate(), **{name: "float64"})


@pytest.mark.parametrize("name", ["k_cache_dtype", "v_cache_dtype"])
@pytest.mark.parametrize("bad", ["uint8", "uint4"])
def test_cache_dtype_unsigned_rejected(check, name, bad):
    with raises(name, repr(bad), "; expected a signed, zero-symmetric type", "no zero point"):
        check(*separate(), **{name: bad})


def sub_byte(k="int4", v="int4", kq="PER_CHANNEL", vq="PER_TENSOR", **changes):
    """A valid packed sub-byte SEPARATE call: uint8 caches, last dim D/2 for a 4-bit type, D for fp8 bytes."""
    width = {"int4": D // 2, "float4e2m1": D // 2, "float8e4m3fn": D}
    attrs, infos = quantized("uint8", kq, vq, key_cache=A((NB, BS, HK, width[k]), "uint8"),
                             value_cache=A((NB, BS, HK, width[v]), "uint8"))
    attrs.update(k_cache_dtype=k, v_cache_dtype=v)
    infos.update(changes)
    return attrs, infos


KINDS = {"int4": "int4", "float4e2m1": "fp4", "float8e4m3fn": "fp8"}


@pytest.mark.parametrize("k,v", [("int4", "int4"), ("float4e2m1", "float4e2m1"), ("int4", "float4e2m1"),
                                 ("float4e2m1", "int4"), ("int4", "float8e4m3fn"), ("float8e4m3fn", "float4e2m1")])
def test_valid_sub_byte(check, k, v):
    p = check(*sub_byte(k, v))
    assert (p.cache_kind, p.v_cache_kind) == (KINDS[k], KINDS[v]) and p.quantized and p.sub_byte
    assert p.packed == (k != "float8e4m3fn" and v != "float8e4m3fn")
    assert p.fp8_as_bytes == ("float8e4m3fn" in (k, v))
    assert (p.cache_row_items, p.v_cache_row_items) == (D if k == "float8e4m3fn" else D // 2,
                                                         D if v == "float8e4m3fn" else D // 2)
    rows = NB * BS * HK
    assert p.input_nbytes["key_cache"] == rows * p.cache_row_items
    assert p.input_nbytes["value_cache"] == rows * p.v_cache_row_items
    assert p.cache_block_bytes == BS * HK * p.cache_row_items


@pytest.mark.parametrize("kind", ["int4", "float4e2m1"])
def test_valid_sub_byte_latent(check, kind):
    attrs, infos = latent(key_cache=A((NB, BS, 1, LD // 2), "uint8"), k_scale=A((1, 1, LD), "float32"))
    p = check(attrs, infos, k_quant_type="PER_CHANNEL", k_cache_dtype=kind)
    assert p.latent and p.cache_kind == p.v_cache_kind == KINDS[kind] and p.packed


@pytest.mark.parametrize("which", ["key_cache", "value_cache"])
def test_sub_byte_cache_last_dim_is_half_the_head_size(check, which):
    with raises(which, f"shape ({NB}, {BS}, {HK}, {D})", f"dim 3 == head_size / 2 ({D // 2})",
                "packs two codes a byte"):
        check(*sub_byte(**{which: A((NB, BS, HK, D), "uint8")}))


def test_fp8_bytes_beside_a_packed_cache_keeps_the_head_size(check):
    with raises("value_cache", f"shape ({NB}, {BS}, {HK}, {D // 2})", f"dim 3 == head_size ({D})"):
        check(*sub_byte("int4", "float8e4m3fn", value_cache=A((NB, BS, HK, D // 2), "uint8")))
    with raises("key_cache", f"shape ({NB}, {BS}, {HK}, {D // 2})", f"dim 3 == head_size ({D})"):
        check(*sub_byte("float8e4m3fn", "int4", key_cache=A((NB, BS, HK, D // 2), "uint8")))


def test_sub_byte_odd_head_size(check):
    """A head size that does not split into whole bytes (or 8-channel chunks) is refused before the caches."""
    attrs, infos = sub_byte(query=A((N, H * 13)), key=A((N, HK * 13)), value=A((N, HK * 13)))
    with raises("query", "head_size 13", "a positive multiple of 8"):
        check(attrs, infos)


@pytest.mark.parametrize("name", ["k_cache_dtype", "v_cache_dtype"])
@pytest.mark.parametrize("bad", ["int4", "float4e2m1"])
def test_sub_byte_needs_uint8_arrays(check, name, bad):
    with raises(name, repr(bad), "; expected '' or the cache tensor's own type (int8)", "packs two codes a byte"):
        check(*quantized("int8"), **{name: bad})


def test_sub_byte_per_channel_scale_is_per_logical_channel(check):
    with raises("k_scale", f"shape ({HK}, 1, {D // 2})", f"shape ({HK}, 1, {D})"):
        check(*sub_byte(k_scale=A((HK, 1, D // 2), "float32")))


def test_sub_byte_needs_scales(check):
    with raises("k_quant_type", "'NONE'", "'PER_TENSOR' or 'PER_CHANNEL'"):
        check(*sub_byte(k_scale=None), k_quant_type="NONE")


def test_kv_cache_layout_vocabulary(check):
    with raises("kv_cache_layout", "'KV_CONCAT'", "; expected one of 'SEPARATE', 'LATENT'"):
        check(*separate(), kv_cache_layout="KV_CONCAT")


def test_v_head_size_not_negative(check):
    with raises("v_head_size", "-16", "; expected an integer >= 0"):
        check(*latent(), v_head_size=-16)


@pytest.mark.parametrize("bad", [3, -1])
def test_qk_output_vocabulary(check, bad):
    with raises("qk_output", str(bad), "; expected 0 (off), 1 (scores) or 2 (probabilities)"):
        check(*separate(), qk_output=bad)


def test_unknown_attribute_name():
    with raises("softmax_scale", "an unknown attribute name", "; expected one of", "'scale'"):
        PagedAttention(num_heads=4, kv_num_heads=2, softmax_scale=0.1)


def test_input_given_as_attribute():
    with raises("block_table", "an unknown attribute name (an input", "; expected one of"):
        PagedAttention(num_heads=4, kv_num_heads=2, block_table=None)


# ---------------------------------------------------------------------------------------------
# binding inputs (contract §5)

def _op_and_arrays(attrs_infos=None):
    attrs, infos = attrs_infos or separate()
    return PagedAttention(**attrs), {n: _array(i) for n, i in infos.items() if i is not None}


def test_unknown_input_name():
    op, arrs = _op_and_arrays()
    with raises("position_ids", "an unknown input name", "; expected one of", "'query_positions'"):
        op.plan(**arrs, position_ids=np.zeros(N, np.int32))


def test_attribute_given_at_call_time():
    op, arrs = _op_and_arrays()
    with raises("softcap", "an unknown input name (an attribute", "; expected one of"):
        op.plan(**arrs, softcap=30.0)


def test_input_given_positionally_and_by_keyword():
    op, arrs = _op_and_arrays()
    with raises("key", "both positionally (input 1) and by keyword", "; expected it once"):
        op.plan(arrs["query"], arrs["key"], arrs["value"], key=arrs["key"])


def test_input_given_positionally_as_none_and_by_keyword():
    op, arrs = _op_and_arrays()
    with raises("value", "both positionally (input 2) and by keyword", "; expected it once"):
        op.plan(arrs["query"], arrs["key"], None, value=arrs["value"])


def test_too_many_positional_inputs():
    op, _ = _op_and_arrays()
    with raises("inputs", "20 positional inputs", "; expected at most 19"):
        op.plan(*([None] * 20))


def test_input_not_an_array():
    op, arrs = _op_and_arrays()
    arrs["past_seqlens"] = [0, 0]
    with raises("past_seqlens", "a builtins.list", "; expected an array"):
        op.plan(**arrs)


def test_explain_validates_like_plan():
    op, arrs = _op_and_arrays()
    with raises("attention_metadata", "dtype int64", "; expected dtype int32"):
        op.explain(**arrs, attention_metadata=np.array([1, 2], np.int64))


# ---------------------------------------------------------------------------------------------
# query (input 0)

def test_query_required(check):
    with raises("query", "None (absent)", "; expected a (token_count, num_heads*head_size) array"):
        check(*separate(query=None))


def test_query_rank(check):
    with raises("query", "shape (5, 4, 16) (rank 3)", "; expected rank 2"):
        check(*separate(query=A((N, H, D))))


@pytest.mark.parametrize("bad", ["float64", "int32", "int8"])
def test_query_dtype(check, bad):
    with raises("query", f"dtype {bad}", "; expected dtype float16, bfloat16 or float32"):
        check(*separate(query=A((N, H * D), bad)))


def test_query_hidden_divisible_by_num_heads(check):
    with raises("query", "shape (5, 66)", "; expected dim 1 divisible by 4 (num_heads)"):
        check(*separate(query=A((N, 66))))


def test_packed_qkv_divisible(check):
    with raises("query", "shape (5, 132)", "; expected dim 1 divisible by 8", "packed QKV"):
        check(*packed(query=A((N, 132))))


def test_head_size_multiple_of_8(check):
    with raises("query", "head_size 12", "; expected head_size a positive multiple of 8"):
        check(*separate(query=A((N, H * 12))))


def test_head_size_at_most_256_in_separate(check):
    attrs, infos = separate(query=A((N, H * 264)), key=A((N, HK * 264)), value=A((N, HK * 264)),
                            key_cache=A((NB, BS, HK, 264)), value_cache=A((NB, BS, HK, 264)))
    with raises("query", "head_size 264", "; expected head_size <= 256", "only in LATENT"):
        check(attrs, infos)


# ---------------------------------------------------------------------------------------------
# key / value (inputs 1, 2) and the input-mode state machine (seed 4.6)

def test_value_required_with_key(check):
    with raises("value", "None (absent)", "; expected present because key is present", "both present or both absent"):
        check(*separate(value=None))


def test_key_required_with_value(check):
    with raises("key", "None (absent)", "; expected present because value is present"):
        check(*separate(key=None))


def test_key_shape(check):
    with raises("key", "shape (4, 32)", "; expected shape (5, 32)", "kv_num_heads*head_size"):
        check(*separate(key=A((N - 1, HK * D))))


def test_key_dtype(check):
    with raises("key", "dtype float32", "; expected dtype float16 (same as query)"):
        check(*separate(key=A((N, HK * D), "float32")))


def test_value_shape(check):
    with raises("value", "shape (5, 64)", "; expected shape (5, 32)"):
        check(*separate(value=A((N, 2 * HK * D))))


def test_value_dtype(check):
    with raises("value", "dtype bfloat16", "; expected dtype float16 (same as query)"):
        check(*separate(value=A((N, HK * D), "bfloat16")))


# ---------------------------------------------------------------------------------------------
# LATENT layout (seed 12.10)

def test_latent_key_required(check):
    with raises("key", "None (absent)", "; expected present in LATENT layout"):
        check(*latent(key=None))


def test_latent_value_absent(check):
    with raises("value", "an array of shape (5, 32)", "; expected absent in LATENT layout"):
        check(*latent(value=A((N, LD))))


def test_latent_value_cache_absent(check):
    with raises("value_cache", "an array", "; expected absent in LATENT layout"):
        check(*latent(value_cache=A((NB, BS, 1, LD))))


def test_latent_v_scale_absent(check):
    attrs, infos = latent(key_cache=A((NB, BS, 1, LD), "int8"), k_scale=A((1,), "float32"),
                          v_scale=A((1,), "float32"))
    with raises("v_scale", "an array", "; expected absent in LATENT layout"):
        check(attrs, infos, k_quant_type="PER_TENSOR")


def test_latent_kv_num_heads_is_1(check):
    with raises("kv_num_heads", "2", "; expected 1 in LATENT layout"):
        check(*latent(), kv_num_heads=2)


def test_latent_v_quant_type_none(check):
    with raises("v_quant_type", "'PER_TENSOR'", "; expected 'NONE' in LATENT layout"):
        check(*latent(), v_quant_type="PER_TENSOR")


def test_latent_v_cache_dtype_unset(check):
    with raises("v_cache_dtype", "'float16'", "; expected '' in LATENT layout"):
        check(*latent(), v_cache_dtype="float16")


def test_latent_key_shape(check):
    with raises("key", "shape (5, 64)", "; expected shape (5, 32)", "LATENT latent row"):
        check(*latent(key=A((N, 2 * LD))))


def test_latent_head_sink_rejected(check):
    with raises("head_sink", "an array", "; expected absent in LATENT layout"):
        check(*latent(head_sink=A((H,))))


def test_latent_qk_norm_rejected(check):
    with raises("q_norm_weight", "an array", "; expected absent in LATENT layout", "QK-norm"):
        check(*latent(q_norm_weight=A((LD,)), k_norm_weight=A((LD,))))


def test_v_head_size_only_in_latent(check):
    with raises("v_head_size", "8", "; expected 0 or head_size=16 in SEPARATE layout"):
        check(*separate(), v_head_size=8, scale=0.1)


def test_v_head_size_at_most_head_size(check):
    with raises("v_head_size", "40", "; expected 0 or a width in [1, head_size=32]"):
        check(*latent(), v_head_size=40)


def test_explicit_scale_when_v_head_size_differs(check):
    with raises("scale", "0 (the default", "; expected an explicit scale when v_head_size (16) != head_size (32)"):
        check(*latent(), scale=0.0)


# ---------------------------------------------------------------------------------------------
# caches (inputs 3, 4)

def test_key_cache_required(check):
    with raises("key_cache", "None (absent)", "; expected a (num_blocks, block_size, kv_num_heads, head_size) cache"):
        check(*separate(key_cache=None))


def test_key_cache_rank(check):
    with raises("key_cache", "shape (6, 4, 32) (rank 3)", "; expected rank 4"):
        check(*separate(key_cache=A((NB, BS, HK * D))))


def test_key_cache_block_size_positive(check):
    attrs, infos = separate(key_cache=A((NB, 0, HK, D)), value_cache=A((NB, 0, HK, D)))
    with raises("key_cache", "shape (6, 0, 2, 16)", "; expected block_size (dim 1) >= 1"):
        check(attrs, infos)


def test_key_cache_kv_num_heads(check):
    with raises("key_cache", "shape (6, 4, 4, 16)", "; expected dim 2 == kv_num_heads (2)"):
        check(*separate(key_cache=A((NB, BS, 2 * HK, D))))


def test_key_cache_head_size(check):
    with raises("key_cache", "shape (6, 4, 2, 8)", "; expected dim 3 == head_size (16)"):
        check(*separate(key_cache=A((NB, BS, HK, 8))))


def test_value_cache_required_in_separate(check):
    with raises("value_cache", "None (absent)", "; expected present in SEPARATE layout"):
        check(*separate(value_cache=None))


def test_value_cache_shape(check):
    with raises("value_cache", "shape (7, 4, 2, 16)", "; expected shape (6, 4, 2, 16) (same as key_cache)"):
        check(*separate(value_cache=A((NB + 1, BS, HK, D))))


def test_value_cache_dtype(check):
    attrs, infos = quantized("int8", value_cache=A((NB, BS, HK, D), "float8_e4m3fn"))
    with raises("value_cache", "dtype float8_e4m3fn", "; expected dtype int8", "share one element type"):
        check(attrs, infos)


def test_float_cache_with_other_float_query(check):
    """A float16 cache with a bfloat16 query is an error (contract §1)."""
    attrs, infos = separate("bfloat16", key_cache=A((NB, BS, HK, D), "float16"),
                            value_cache=A((NB, BS, HK, D), "float16"))
    with raises("key_cache", "dtype float16", "; expected the query's dtype bfloat16",
                "a float16 cache with a bfloat16 query is not allowed"):
        check(attrs, infos)


@pytest.mark.parametrize("bad", ["int32", "float8_e5m2", "float64"])
def test_cache_dtype_unsupported(check, bad):
    attrs, infos = separate(key_cache=A((NB, BS, HK, D), bad), value_cache=A((NB, BS, HK, D), bad))
    with raises("key_cache", f"dtype {bad}", "; expected", "int8, float8_e4m3fn or uint8"):
        check(attrs, infos)


def test_uint8_cache_needs_fp8_name_for_k(check):
    with raises("k_cache_dtype", "''", "; expected 'float8e4m3fn' (raw e4m3 bytes), 'int4' or 'float4e2m1' (two "
                "codes a byte) when the cache arrays are uint8"):
        check(*quantized("uint8"), k_cache_dtype="")


def test_uint8_cache_needs_fp8_name_for_v(check):
    with raises("v_cache_dtype", "'int8'", "; expected 'float8e4m3fn' (raw e4m3 bytes), 'int4' or 'float4e2m1' (two "
                "codes a byte) when the cache arrays are uint8"):
        check(*quantized("uint8"), v_cache_dtype="int8")


@pytest.mark.parametrize("name", ["k_cache_dtype", "v_cache_dtype"])
def test_cache_dtype_attribute_agrees_with_tensor(check, name):
    with raises(name, "'float8e4m3fn'", "; expected '' or the cache tensor's own type (int8)"):
        check(*quantized("int8"), **{name: "float8e4m3fn"})


def test_cache_dtype_attribute_names_query_type_for_t_cache(check):
    with raises("k_cache_dtype", "'bfloat16'", "; expected '' or the cache tensor's own type (float16)"):
        check(*separate(), k_cache_dtype="bfloat16")


# ---------------------------------------------------------------------------------------------
# quantization (inputs 14, 15; seed 8.7)

@pytest.mark.parametrize("name", ["k_quant_type", "v_quant_type"])
def test_quant_type_needs_quantized_cache(check, name):
    attrs, infos = separate(**{name[0] + "_scale": A((1,), "float32")})
    with raises(name, "'PER_TENSOR'", "; expected 'NONE' because the cache has the query's type float16"):
        check(attrs, infos, **{name: "PER_TENSOR"})


@pytest.mark.parametrize("name", ["k_quant_type", "v_quant_type"])
def test_quantized_cache_needs_quant_type(check, name):
    scale = "k_scale" if name == "k_quant_type" else "v_scale"
    with raises(name, "'NONE'", "; expected 'PER_TENSOR' or 'PER_CHANNEL' because the cache is int8"):
        check(*quantized("int8", **{scale: None}), **{name: "NONE"})


@pytest.mark.parametrize("name", ["k_scale", "v_scale"])
def test_scale_absent_when_quant_type_none(check, name):
    with raises(name, "an array", f"; expected absent because {name[0]}_quant_type is 'NONE'"):
        check(*separate(**{name: A((1,), "float32")}))


@pytest.mark.parametrize("name", ["k_scale", "v_scale"])
def test_scale_required_when_quantized(check, name):
    with raises(name, "None (absent)", f"; expected a float32 scale because {name[0]}_quant_type is"):
        check(*quantized("float8_e4m3fn", **{name: None}))


@pytest.mark.parametrize("bad", ["float16", "float64"])
def test_scale_dtype_float32(check, bad):
    with raises("k_scale", f"dtype {bad}", "; expected dtype float32"):
        check(*quantized("int8", k_scale=A((1,), bad)))


def test_per_tensor_scale_shape(check):
    with raises("k_scale", "shape (2,)", "; expected shape (1,) (PER_TENSOR scale)"):
        check(*quantized("int8", k_scale=A((HK,), "float32")))


def test_per_channel_scale_shape(check):
    with raises("v_scale", "shape (2, 16)", "; expected shape (2, 1, 16) (kv_num_heads, 1, head_size)"):
        check(*quantized("int8", v_scale=A((HK, D), "float32")))


# ---------------------------------------------------------------------------------------------
# sequence description (inputs 5, 6, 7)

@pytest.mark.parametrize("name", ["cumulative_sequence_length", "past_seqlens", "block_table"])
def test_sequence_inputs_required(check, name):
    with raises(name, "None (absent)", "; expected an int32"):
        check(*separate(**{name: None}))


def test_cumulative_sequence_length_rank(check):
    with raises("cumulative_sequence_length", "shape (3, 1) (rank 2)", "; expected rank 1"):
        check(*separate(cumulative_sequence_length=A((B + 1, 1), "int32")))


@pytest.mark.parametrize("name,shape", [("cumulative_sequence_length", (B + 1,)), ("past_seqlens", (B,)),
                                        ("block_table", (B, MB))])
@pytest.mark.parametrize("bad", ["int64", "uint32", "float32"])
def test_index_inputs_int32(check, name, shape, bad):
    """Index inputs must be int32: no silent casts."""
    with raises(name, f"dtype {bad}", "; expected dtype int32", "no silent casts"):
        check(*separate(**{name: A(shape, bad)}))


def test_cumulative_sequence_length_at_least_two_entries(check):
    attrs, infos = separate(cumulative_sequence_length=A((1,), "int32"), past_seqlens=A((0,), "int32"),
                            block_table=A((0, MB), "int32"))
    with raises("cumulative_sequence_length", "shape (1,)", "; expected at least 2 entries"):
        check(attrs, infos)


def test_past_seqlens_batch_size(check):
    with raises("past_seqlens", "shape (3,)", "; expected shape (2,)", "batch_size = len(cumulative_sequence_length) - 1"):
        check(*separate(past_seqlens=A((B + 1,), "int32")))


def test_past_seqlens_rank(check):
    with raises("past_seqlens", "shape (2, 1)", "; expected shape (2,)"):
        check(*separate(past_seqlens=A((B, 1), "int32")))


def test_block_table_rank(check):
    with raises("block_table", "shape (6,) (rank 1)", "; expected rank 2"):
        check(*separate(block_table=A((B * MB,), "int32")))


def test_block_table_batch_size(check):
    with raises("block_table", "shape (3, 3)", "; expected dim 0 == batch_size (2)"):
        check(*separate(block_table=A((B + 1, MB), "int32")))


def test_block_table_has_columns(check):
    with raises("block_table", "shape (2, 0)", "; expected at least one column"):
        check(*separate(block_table=A((B, 0), "int32")))


# ---------------------------------------------------------------------------------------------
# rotary (inputs 8, 9)

@pytest.mark.parametrize("present,absent", [("cos_cache", "sin_cache"), ("sin_cache", "cos_cache")])
def test_cos_sin_both_or_neither(check, present, absent):
    attrs, infos = rotary(**{absent: None})
    with raises(absent, "None (absent)", f"; expected present because {present} is present"):
        check(attrs, infos)


def test_rotary_caches_required_when_do_rotary(check):
    with raises("cos_cache", "None (absent)", "; expected cos_cache and sin_cache because do_rotary=1"):
        check(*separate(), do_rotary=1)


def test_rotary_caches_absent_without_do_rotary(check):
    with raises("cos_cache", "an array", "; expected absent because do_rotary=0"):
        check(*rotary(), do_rotary=0)


def test_cos_cache_rank(check):
    with raises("cos_cache", "shape (64,) (rank 1)", "; expected rank 2"):
        check(*rotary(cos_cache=A((64,)), sin_cache=A((64,))))


def test_cos_cache_dtype(check):
    with raises("cos_cache", "dtype float32", "; expected dtype float16 (same as query)"):
        check(*rotary(cos_cache=A((64, 4), "float32"), sin_cache=A((64, 4), "float32")))


def test_sin_cache_shape(check):
    with raises("sin_cache", "shape (32, 4)", "; expected shape (64, 4) (same as cos_cache)"):
        check(*rotary(sin_cache=A((32, 4))))


def test_sin_cache_dtype(check):
    with raises("sin_cache", "dtype bfloat16", "; expected dtype float16 (same as query)"):
        check(*rotary(sin_cache=A((64, 4), "bfloat16")))


def test_rotary_dim_positive(check):
    with raises("cos_cache", "shape (64, 0)", "; expected dim 1 >= 1"):
        check(*rotary(half=0))


def test_rotary_offset_plus_rotary_dim_within_head_size(check):
    with raises("rotary_offset", "16", "; expected rotary_offset + rotary_dim (8", "<= head_size (16)"):
        check(*rotary(half=4), rotary_offset=16)


def test_rotary_dim_within_head_size(check):
    with raises("rotary_offset", "0", "; expected rotary_offset + rotary_dim (24", "<= head_size (16)"):
        check(*rotary(half=12))


# ---------------------------------------------------------------------------------------------
# slot_mapping, head_sink, QK-norm, query_positions (inputs 10-13, 17)

@pytest.mark.parametrize("name", ["slot_mapping", "query_positions"])
def test_token_vector_shape(check, name):
    with raises(name, "shape (6,)", "; expected shape (5,) (token_count,)"):
        check(*separate(**{name: A((N + 1,), "int32")}))


@pytest.mark.parametrize("name", ["slot_mapping", "query_positions"])
def test_token_vector_rank(check, name):
    with raises(name, "shape (5, 1)", "; expected shape (5,)"):
        check(*separate(**{name: A((N, 1), "int32")}))


@pytest.mark.parametrize("name", ["slot_mapping", "query_positions"])
def test_token_vector_int32(check, name):
    with raises(name, "dtype int64", "; expected dtype int32", "no silent casts"):
        check(*separate(**{name: A((N,), "int64")}))


def test_head_sink_shape(check):
    with raises("head_sink", "shape (2,)", "; expected shape (4,) (num_heads,)"):
        check(*separate(head_sink=A((HK,))))


def test_head_sink_dtype(check):
    with raises("head_sink", "dtype float32", "; expected dtype float16 (same as query)"):
        check(*separate(head_sink=A((H,), "float32")))


@pytest.mark.parametrize("present,absent", [("q_norm_weight", "k_norm_weight"), ("k_norm_weight", "q_norm_weight")])
def test_norm_weights_both_or_neither(check, present, absent):
    with raises(absent, "None (absent)", f"; expected present because {present} is present"):
        check(*separate(**{present: A((D,))}))


@pytest.mark.parametrize("name", ["q_norm_weight", "k_norm_weight"])
def test_norm_weight_shape(check, name):
    attrs, infos = separate(q_norm_weight=A((D,)), k_norm_weight=A((D,)))
    infos[name] = A((H * D,))
    with raises(name, "shape (64,)", "; expected shape (16,) (head_size,)"):
        check(attrs, infos)


@pytest.mark.parametrize("name", ["q_norm_weight", "k_norm_weight"])
def test_norm_weight_dtype(check, name):
    attrs, infos = separate(q_norm_weight=A((D,)), k_norm_weight=A((D,)))
    infos[name] = A((D,), "float32")
    with raises(name, "dtype float32", "; expected dtype float16 (same as query)"):
        check(attrs, infos)


# ---------------------------------------------------------------------------------------------
# attention_bias (input 18)

def test_attention_bias_rank(check):
    with raises("attention_bias", "shape (4, 5, 12) (rank 3)", "; expected rank 4"):
        check(*separate(attention_bias=A((H, N, MB * BS))))


def test_attention_bias_dtype(check):
    with raises("attention_bias", "dtype float32", "; expected dtype float16 (same as query)"):
        check(*separate(attention_bias=A((1, 1, 4, 12), "float32")))


def test_attention_bias_batch_broadcast(check):
    with raises("attention_bias", "shape (3, 1, 4, 12)", "; expected dim 0 of 1 or batch_size (2)"):
        check(*separate(attention_bias=A((3, 1, 4, 12))))


def test_attention_bias_head_broadcast(check):
    with raises("attention_bias", "shape (2, 2, 4, 12)", "; expected dim 1 of 1 or num_heads (4)"):
        check(*separate(attention_bias=A((B, HK, 4, 12))))


def test_attention_bias_capacities_positive(check):
    with raises("attention_bias", "shape (1, 4, 0, 12)", "; expected q_capacity >= 1 and kv_capacity >= 1"):
        check(*separate(attention_bias=A((1, H, 0, 12))))


# ---------------------------------------------------------------------------------------------
# attention_metadata (input 16): host memory, int32, 2 or 3 entries, entries >= 0

class _FakeDeviceArray:
    """Stands in for a device array (CuPy-like): it exposes __cuda_array_interface__."""

    shape, dtype = (2,), np.dtype(np.int32)

    @property
    def __cuda_array_interface__(self):
        return {"shape": (2,), "typestr": "<i4", "data": (0, False), "version": 3}


def test_attention_metadata_device_array_rejected(check):
    with raises("attention_metadata", "device array", "; expected host memory"):
        check(*separate(), _FakeDeviceArray())


@pytest.mark.gpu
def test_attention_metadata_cupy_array_rejected(check):
    import cupy

    with raises("attention_metadata", "a cupy device array", "; expected host memory"):
        check(*separate(), cupy.array([1, 2], dtype=cupy.int32))


@pytest.mark.parametrize("bad", ["int64", "uint32", "float32"])
def test_attention_metadata_int32(check, bad):
    with raises("attention_metadata", f"dtype {bad}", "; expected dtype int32"):
        check(*separate(), np.array([1, 2], dtype=bad))


def test_attention_metadata_list_entries_are_ints(check):
    with raises("attention_metadata", "an entry 2.0 (float)", "; expected int32 host values"):
        check(*separate(), [1, 2.0])


def test_attention_metadata_list_entries_fit_int32(check):
    with raises("attention_metadata", str(2**31), "; expected int32 entries"):
        check(*separate(), [1, 2**31])


@pytest.mark.parametrize("bad", [np.array([1], np.int32), np.array([1, 2, 3, 4], np.int32),
                                 np.array([[1, 2]], np.int32)])
def test_attention_metadata_shape(check, bad):
    with raises("attention_metadata", f"shape {contract._dims(bad.shape)}", "; expected shape (2,) or (3,)"):
        check(*separate(), bad)


@pytest.mark.parametrize("bad", [[1], [1, 2, 3, 4]])
def test_attention_metadata_length(check, bad):
    with raises("attention_metadata", f"{len(bad)} entries", "; expected 2 or 3 entries"):
        check(*separate(), bad)


@pytest.mark.parametrize("bad", [[-1, 0], (0, -5), np.array([1, 2, -3], np.int32)])
def test_attention_metadata_entries_not_negative(check, bad):
    with raises("attention_metadata", "-", "; expected entries >= 0 (0 means unknown)"):
        check(*separate(), bad)


def test_attention_metadata_type(check):
    with raises("attention_metadata", "a builtins.dict", "; expected host memory (a list/tuple or NumPy array"):
        check(*separate(), {"max_query_len": 1})


# ---------------------------------------------------------------------------------------------
# output_qk (seed 11.2): a configurable byte threshold

def test_output_qk_size_limit_exceeded(check):
    with raises("qk_output", "2", "; expected an output_qk of at most 900 bytes", "4*5*12 float32 = 960 bytes",
                "attention_metadata"):
        check(*separate(), qk_output=2, options=cupa.Options(output_qk_max_bytes=900))


def test_output_qk_size_uses_metadata_bound(check):
    p = check(*separate(), [0, 8], qk_output=1, options=cupa.Options(output_qk_max_bytes=900))   # 4*5*8*4 = 640 bytes
    assert p.output_qk_shape == (H, N, 8)


# ---------------------------------------------------------------------------------------------
# the memo in PagedAttention never hides a violation

def test_memoized_plan_still_validates(monkeypatch):
    monkeypatch.setattr(dispatch, "make_plan", lambda problem, inputs, options, writes=True: dispatch.Plan(
        problem, _STUB_BACKEND, None, options, writes=writes))
    op, arrs = _op_and_arrays()
    p1 = op.plan(**arrs).problem
    assert op.plan(**arrs).problem is p1                    # same shapes: the memoized Problem
    arrs["past_seqlens"] = arrs["past_seqlens"].astype(np.int64)
    with raises("past_seqlens", "dtype int64", "; expected dtype int32"):
        op.plan(**arrs)
    arrs["past_seqlens"] = arrs["past_seqlens"].astype(np.int32)
    with raises("attention_metadata", "[-1, 0]", "; expected entries >= 0"):
        op.plan(**arrs, attention_metadata=[-1, 0])
