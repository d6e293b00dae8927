"""cupa.helpers: rope_cache, compute_scale, quantize (the write rule), dequantize (the read rule)."""

import re
import warnings

import ml_dtypes
import numpy as np
import pytest

import cupa
from cupa import helpers

F8 = np.dtype(ml_dtypes.float8_e4m3fn)


# ---------------------------------------------------------------------------------------------- rope

@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32])
def test_rope_cache_values(rng, dtype):
    max_pos, rd = int(rng.integers(5, 40)), int(rng.choice([8, 32, 64]))
    base = float(rng.choice([100.0, 10000.0, 500000.0]))
    cos, sin = cupa.rope_cache(max_pos, rd, base=base, dtype=dtype)
    assert cos.shape == sin.shape == (max_pos, rd // 2)
    assert cos.dtype == np.dtype(dtype) and sin.dtype == np.dtype(dtype)
    for _ in range(20):
        p, i = int(rng.integers(max_pos)), int(rng.integers(rd // 2))
        ang = p * base ** (-2.0 * i / rd)
        assert cos[p, i] == np.array(np.cos(ang)).astype(dtype)
        assert sin[p, i] == np.array(np.sin(ang)).astype(dtype)
    assert np.all(cos[0].astype(np.float64) == 1.0) and np.all(sin[0].astype(np.float64) == 0.0)


def test_rope_cache_rejects_odd_dim():
    with pytest.raises(ValueError, match="rotary_dim"):
        cupa.rope_cache(8, 7)


# ---------------------------------------------------------------------------------------------- scales

@pytest.mark.parametrize("cache_dtype,qmax", [("int8", 127.0), ("float8e4m3fn", 448.0), (F8, 448.0)])
def test_compute_scale_per_tensor(rng, cache_dtype, qmax):
    x = (rng.standard_normal((7, 3, 2, 16)) * 3).astype(np.float16)
    s = cupa.compute_scale(x, "PER_TENSOR", cache_dtype)
    assert s.shape == (1,) and s.dtype == np.float32
    assert s[0] == np.float32(np.abs(x.astype(np.float64)).max() / qmax)


@pytest.mark.parametrize("cache_dtype,qmax", [("int8", 127.0), ("float8e4m3fn", 448.0)])
def test_compute_scale_per_channel(rng, cache_dtype, qmax):
    Hk, D = 3, 16
    x = (rng.standard_normal((5, 4, Hk, D)) * rng.uniform(0.1, 10, (Hk, D))).astype(np.float32)
    x[:, :, 1, 5] = 0.0                      # an all-zero column gets scale 1, never 0
    s = cupa.compute_scale(x, "PER_CHANNEL", cache_dtype)
    assert s.shape == (Hk, 1, D) and s.dtype == np.float32
    expect = np.abs(x.astype(np.float64)).reshape(-1, Hk, D).max(axis=0) / qmax
    expect[1, 5] = 1.0
    np.testing.assert_array_equal(s[:, 0, :], expect.astype(np.float32))


def test_compute_scale_all_zero_and_bad_type():
    assert cupa.compute_scale(np.zeros((4, 2, 8), np.float16), "PER_TENSOR")[0] == 1.0
    with pytest.raises(ValueError, match="quant_type"):
        cupa.compute_scale(np.ones((4, 2, 8)), "NONE")
    with pytest.raises(ValueError, match="cache_dtype"):
        cupa.compute_scale(np.ones((4, 2, 8)), "PER_TENSOR", "uint8")


@pytest.mark.parametrize("qt", ["PER_TENSOR", "PER_CHANNEL"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_compute_scale_rejects_non_finite_data(rng, qt, bad):
    x = rng.standard_normal((5, 2, 8)).astype(np.float32)
    index = tuple(int(rng.integers(n)) for n in x.shape)
    x[index] = bad
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        expected = rf"^x: got a non-finite value at index {re.escape(str(index))}"
        with pytest.raises(cupa.PagedAttentionError, match=expected):
            cupa.compute_scale(x, qt)


@pytest.mark.parametrize("cache_dtype", ["int8", "float8e4m3fn"])
def test_compute_scale_is_always_usable(cache_dtype):
    """All-zero data, empty data and data too small for a normal float32 scale: a scale check_scale
    accepts (1.0, or the smallest normal float32), never 0 and never a warning."""
    tiny = np.full((3, 2, 8), 1e-44, np.float32)          # float32 subnormals: max/qmax underflows
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for x in (np.zeros((4, 2, 8), np.float16), np.zeros((0, 2, 8), np.float32), tiny):
            for qt in ("PER_TENSOR", "PER_CHANNEL"):
                s = cupa.compute_scale(x, qt, cache_dtype)
                helpers.check_scale(s)
                codes = cupa.quantize(x, s, cache_dtype)
                assert np.all(np.isfinite(cupa.dequantize(codes, s, cache_dtype)))
        assert cupa.compute_scale(tiny, "PER_TENSOR", cache_dtype)[0] == np.float32(helpers.SCALE_MIN)
        assert cupa.compute_scale(np.zeros((0, 2, 8)), "PER_CHANNEL", cache_dtype).shape == (2, 1, 8)


BAD_SCALES = [0.0, -1.0, -0.0, np.nan, np.inf, -np.inf, 1e-40, 2e-39]


@pytest.mark.parametrize("bad", BAD_SCALES)
@pytest.mark.parametrize("per_channel", [False, True])
def test_quantize_and_dequantize_reject_bad_scales(rng, bad, per_channel):
    x = rng.standard_normal((3, 2, 8)).astype(np.float16)
    s = (rng.uniform(0.01, 0.1, (2, 1, 8)) if per_channel else np.array([0.05])).astype(np.float32)
    index = tuple(int(rng.integers(n)) for n in s.shape)
    s[index] = bad
    where = str(index[0]) if len(index) == 1 else str(index)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for cd in ("int8", "float8e4m3fn"):
            with pytest.raises(cupa.PagedAttentionError, match=rf"^scale: got .* at index {re.escape(where)};"):
                cupa.quantize(x, s, cd)
        with pytest.raises(cupa.PagedAttentionError, match=r"^scale: got "):
            cupa.dequantize(np.ones(x.shape, np.int8), s)
        with pytest.raises(cupa.PagedAttentionError, match=r"^k_scale: got "):
            helpers.check_scale(s, "k_scale")


def test_smallest_usable_scale():
    """The boundary of check_scale: a finite float32 reciprocal."""
    helpers.check_scale(np.array([helpers.SCALE_MIN], np.float32))
    helpers.check_scale(np.array([3e-39], np.float32))
    with pytest.raises(cupa.PagedAttentionError):
        helpers.check_scale(np.array([2.9e-39], np.float32))


def test_quantize_non_finite_values():
    """+-Inf saturates; NaN is the int8 code -128 (fmax/fmin saturation, as the kernels) or the fp8 NaN
    code; no warning either way."""
    x = np.array([np.inf, -np.inf, np.nan, 1.0], np.float32)
    s = np.array([1.0], np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        np.testing.assert_array_equal(cupa.quantize(x, s, "int8"), [127, -128, -128, 1])
        b = cupa.quantize(x, s, "float8e4m3fn", as_bytes=True)
        assert b[0] == 0x7E and b[1] == 0xFE and (b[2] & 0x7F) == 0x7F and b[3] == 0x38
        np.testing.assert_array_equal(helpers._fp8_bytes_from_f32(np.clip(x, -448, 448), np) & 0x7F, b & 0x7F)


@pytest.mark.parametrize("cache", ["int8", "fp8_bytes"])
@pytest.mark.parametrize("which", ["k_scale", "v_scale"])
def test_reference_rejects_bad_scale_before_writing(rng, cache, which):
    from tests import util

    case = util.make_case(rng, cache=cache, k_quant="PER_CHANNEL", v_quant="PER_TENSOR")
    case.inputs[which].flat[-1] = 0.0
    before = case.copy()
    with pytest.raises(cupa.PagedAttentionError, match=rf"^{which}: got 0.0 at index"):
        case.run()
    for name in ("key_cache", "value_cache"):
        util.assert_cache_close(case.inputs[name], before.inputs[name], what=name)


def test_scale_maps_max_to_qmax(rng):
    x = (rng.standard_normal((9, 2, 8)) * 5).astype(np.float32)
    for cd, qmax in (("int8", 127), ("float8e4m3fn", 448)):
        for qt in ("PER_TENSOR", "PER_CHANNEL"):
            s = cupa.compute_scale(x, qt, cd)
            codes = cupa.quantize(x, s, cd).astype(np.float32)
            assert np.abs(codes).max() == qmax


# ---------------------------------------------------------------------------------------------- int8

def test_quantize_int8_round_half_even_and_saturation():
    x = np.array([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, 127.5, 300, -127.5, -128.5, -1000, 3.4999],
                 dtype=np.float32)
    codes = cupa.quantize(x, np.array([1.0], np.float32), "int8")
    assert codes.dtype == np.int8
    np.testing.assert_array_equal(codes, [0, 2, 2, 0, -2, -2, 126, 127, 127, -128, -128, -128, 3])


def test_quantize_int8_float32_product_rule(rng):
    # float32(x) * float32(1/scale) in float32, not x / scale in float64: they round differently here
    s = np.array([0.3], np.float32)
    x = (np.arange(-2000, 2000, dtype=np.float32) / 64).astype(np.float16)
    codes = cupa.quantize(x, s, "int8")
    inv = np.float32(1) / s[0]
    expect = np.clip(np.rint(x.astype(np.float32) * inv), -128, 127).astype(np.int8)
    np.testing.assert_array_equal(codes, expect)
    f64 = np.clip(np.rint(x.astype(np.float64) / np.float64(s[0])), -128, 127).astype(np.int8)
    assert (f64 != expect).any()          # the rule is observable


def test_quantize_per_channel_broadcast(rng):
    Hk, D = 2, 16
    x = rng.standard_normal((3, 5, Hk, D)).astype(ml_dtypes.bfloat16)
    s = rng.uniform(0.005, 0.05, (Hk, 1, D)).astype(np.float32)
    codes = cupa.quantize(x, s, "int8")
    assert codes.shape == x.shape
    inv = (np.float32(1) / s[:, 0, :]).astype(np.float32)
    expect = np.clip(np.rint((x.astype(np.float32) * inv).astype(np.float32)), -128, 127).astype(np.int8)
    np.testing.assert_array_equal(codes, expect)
    with pytest.raises(ValueError, match="scale"):
        cupa.quantize(x, np.ones((Hk + 1, 1, D), np.float32))


# ---------------------------------------------------------------------------------------------- fp8

def _fp8_positive_values():
    v = np.arange(0, 0x7F, dtype=np.uint8).view(F8).astype(np.float32)   # 0x7F is NaN
    return v


def test_quantize_fp8_round_half_even_at_every_midpoint():
    v = _fp8_positive_values()
    mids = ((v[:-1].astype(np.float64) + v[1:]) / 2).astype(np.float32)
    assert np.all(mids.astype(np.float64) == (v[:-1].astype(np.float64) + v[1:]) / 2)   # exact
    codes = cupa.quantize(np.concatenate([mids, -mids]), np.array([1.0], np.float32), "float8e4m3fn",
                          as_bytes=True)
    lower = np.arange(0, 0x7E, dtype=np.uint8)
    even = np.where(lower % 2 == 0, lower, lower + 1).astype(np.uint8)     # tie -> even code
    np.testing.assert_array_equal(codes[:mids.size], even)
    np.testing.assert_array_equal(codes[mids.size:], even | 0x80)


def test_quantize_fp8_saturates_and_dtypes():
    x = np.array([448, 449, 470, 500, 1e6, -1e6, -460, 2 ** -10, 0.3], np.float32)
    s = np.array([1.0], np.float32)
    codes = cupa.quantize(x, s, "float8e4m3fn")
    assert codes.dtype == F8
    np.testing.assert_array_equal(codes.astype(np.float32)[:7], [448, 448, 448, 448, 448, -448, -448])
    assert codes.astype(np.float32)[7] == 0.0            # 2**-10: tie between 0 and 2**-9 -> even 0
    b = cupa.quantize(x, s, "float8e4m3fn", as_bytes=True)
    assert b.dtype == np.uint8
    np.testing.assert_array_equal(b, codes.view(np.uint8))
    assert b[0] == 0x7E and b[5] == 0xFE


def test_fp8_arithmetic_encoder_matches_ml_dtypes(rng):
    # the array-module-generic encoder (used for CuPy arrays) against ml_dtypes
    x = np.concatenate([rng.standard_normal(20000) * 10.0 ** rng.uniform(-4, 3, 20000),
                        np.arange(-448, 448.5, 0.125)]).astype(np.float32)
    x = np.clip(x, -448, 448).astype(np.float32)
    np.testing.assert_array_equal(helpers._fp8_bytes_from_f32(x, np), x.astype(F8).view(np.uint8))


# ---------------------------------------------------------------------------------------------- dequant

@pytest.mark.parametrize("qt", ["PER_TENSOR", "PER_CHANNEL"])
@pytest.mark.parametrize("cd", ["int8", "float8e4m3fn", "bytes"])
def test_dequantize_round_trip(rng, qt, cd):
    x = (rng.standard_normal((6, 2, 16)) * rng.uniform(0.1, 3, (2, 16))).astype(np.float16)
    kind = "float8e4m3fn" if cd == "bytes" else cd
    s = cupa.compute_scale(x, qt, kind)
    codes = cupa.quantize(x, s, kind, as_bytes=cd == "bytes")
    back = cupa.dequantize(codes, s, kind if cd == "bytes" else None)
    assert back.dtype == np.float32 and back.shape == x.shape
    sb = s.reshape(1) if qt == "PER_TENSOR" else s[:, 0, :]
    expect = codes.view(F8).astype(np.float32) if cd == "bytes" else codes.astype(np.float32)
    np.testing.assert_array_equal(back, (expect * sb).astype(np.float32))
    xf = x.astype(np.float64)
    if cd == "int8":   # half a step, plus the float32 roundings of x * (1/scale) and of code * scale
        assert np.all(np.abs(back - xf) <= sb * 0.5 + np.abs(xf) * 2.0 ** -22)
    else:   # 3 mantissa bits: relative error <= 2**-4 (normals), absolute <= 2**-10 * scale (subnormals)
        assert np.all(np.abs(back - xf) <= np.maximum(np.abs(xf) * 2 ** -4, sb * 2 ** -10) * (1 + 1e-6))


def test_dequantize_bytes_need_cache_dtype():
    codes = np.array([1, 2, 3], np.uint8)
    with pytest.raises(ValueError, match="cache_dtype"):
        cupa.dequantize(codes, np.array([1.0], np.float32))
    with pytest.raises(ValueError, match="codes"):
        cupa.dequantize(np.ones(3, np.float16), np.array([1.0], np.float32))
