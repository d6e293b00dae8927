"""Packed 4-bit caches on the CPU: the write and read rules of int4 and float4 e2m1 (contract §4.1).

The helpers (cupa.quantize / dequantize / pack_codes / unpack_codes) against the rules stated
plainly and against ml_dtypes; the kernels' own encoders and widenings (cuda_src/quant.cuh),
compiled for the host with nvcc, against the helpers and against CUDA's e2m1 conversion
(``__nv_cvt_float_to_fp4``). The reference against a dense float64 attention on the dequantized
values runs in tests/test_reference_dense.py (its int4 / fp4 rows).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import cupa
from tests import util

I4 = np.dtype(ml_dtypes.int4)
F4 = np.dtype(ml_dtypes.float4_e2m1fn)
ONE = np.array([1.0], dtype=np.float32)
#: every e2m1 value by code (sign bit 3)
FP4_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)
#: the e2m1 midpoints and where a tie goes (the even code)
FP4_TIES = {0.25: 0.0, 0.75: 1.0, 1.25: 1.0, 1.75: 2.0, 2.5: 2.0, 3.5: 4.0, 5.0: 4.0}


def nibbles_of(packed):
    packed = np.asarray(packed)
    return np.stack([packed & 15, packed >> 4], axis=-1).reshape(packed.shape[:-1] + (2 * packed.shape[-1],))


# ---------------------------------------------------------------------------------------------- packing

def test_packing_order_low_nibble_first():
    """Element 2i goes to the low nibble of byte i, element 2i+1 to the high nibble."""
    codes = np.array([[1, -2, 3, 7, -8, 0]], dtype=I4)
    packed = cupa.pack_codes(codes)
    assert packed.dtype == np.uint8 and packed.shape == (1, 3)
    assert packed.tolist() == [[(1 + 8) | ((-2 + 8) << 4), (3 + 8) | ((7 + 8) << 4), (-8 + 8) | ((0 + 8) << 4)]]
    fp4 = np.array([0.5, -6.0, 0.0, 1.5], dtype=np.float32).astype(F4)
    assert cupa.pack_codes(fp4).tolist() == [0x1 | (0xF << 4), 0x0 | (0x3 << 4)]


def test_int4_is_stored_with_a_bias_of_8():
    x = np.arange(-8, 8, dtype=np.float32)[None, :]
    packed = cupa.quantize(x, ONE, "int4", as_bytes=True)
    assert nibbles_of(packed).tolist() == [list(range(16))]          # q + 8: -8 -> 0, 0 -> 8, 7 -> 15
    zero = cupa.quantize(np.zeros((1, 2), np.float32), ONE, "int4", as_bytes=True)
    assert zero.tolist() == [[0x88]]                                  # the zero byte of int4 is 0x88, not 0


def test_every_nibble_value_round_trips():
    """All 256 bytes of each 4-bit type: unpack -> pack is the identity, the values are the table's, and
    quantizing a value (scale 1) gives back its nibble (e2m1 -0 included)."""
    every = np.arange(256, dtype=np.uint8).reshape(16, 16)
    for name, values in (("int4", np.arange(16, dtype=np.float32) - 8), ("float4e2m1", FP4_VALUES)):
        codes = cupa.unpack_codes(every, name)
        assert codes.dtype == (I4 if name == "int4" else F4) and codes.shape == (16, 32)
        np.testing.assert_array_equal(cupa.pack_codes(codes), every)
        vals = cupa.dequantize(every, ONE, name)
        expected = values[nibbles_of(every)]
        np.testing.assert_array_equal(vals, expected)
        np.testing.assert_array_equal(np.signbit(vals), np.signbit(expected))
        np.testing.assert_array_equal(cupa.dequantize(codes, ONE), expected)
        np.testing.assert_array_equal(cupa.quantize(vals, ONE, name, as_bytes=True), every)


def test_pack_rejects_odd_widths_and_other_types():
    with pytest.raises(cupa.PagedAttentionError, match=r"codes: got shape \(2, 3\); expected an even last dimension"):
        cupa.pack_codes(np.zeros((2, 3), dtype=I4))
    with pytest.raises(cupa.PagedAttentionError, match="expected an even last dimension"):
        cupa.quantize(np.zeros((2, 5), np.float32), ONE, "float4e2m1", as_bytes=True)
    with pytest.raises(cupa.PagedAttentionError, match="codes: got dtype int8"):
        cupa.pack_codes(np.zeros(4, dtype=np.int8))
    with pytest.raises(ValueError, match="cache_dtype: got 'int8'; expected 'int4' or 'float4e2m1'"):
        cupa.unpack_codes(np.zeros(2, np.uint8), "int8")
    with pytest.raises(ValueError, match="'float8e4m3fn' .*'int4' or 'float4e2m1'"):
        cupa.dequantize(np.zeros(2, np.uint8), ONE)


# ---------------------------------------------------------------------------------------------- write rule

def test_int4_round_half_even_and_saturation():
    x = np.array([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 6.5, 7.4, 7.5, 100, -8.4, -8.5, -1e9, np.inf, -np.inf, np.nan],
                 dtype=np.float32)
    q = cupa.quantize(x[None, :], ONE, "int4")[0]
    assert q.dtype == I4
    assert q.astype(int).tolist() == [0, 2, 2, 0, -2, -2, 6, 7, 7, 7, -8, -8, -8, 7, -8, -8]


def test_fp4_round_to_nearest_even_and_saturation():
    ties = np.array(list(FP4_TIES), dtype=np.float32)
    got = cupa.quantize(np.concatenate([ties, -ties])[None, :], ONE, "float4e2m1")[0].astype(np.float32)
    np.testing.assert_array_equal(got, np.concatenate([list(FP4_TIES.values()), [-v for v in FP4_TIES.values()]]))
    x = np.array([5.01, 6.0, 7.0, 1e30, np.inf, -7.0, -np.inf, np.nan, -np.nan, 0.2, -0.2, -0.0], dtype=np.float32)
    got = cupa.quantize(x[None, :], ONE, "float4e2m1", as_bytes=True)
    assert nibbles_of(got)[0].tolist() == [0x7, 0x7, 0x7, 0x7, 0x7, 0xF, 0xF, 0x7, 0x7, 0x0, 0x8, 0x8]


def test_write_rule_against_ml_dtypes(rng):
    """quantize == saturate(round_half_even(float32(x) * float32(1/scale))) written with ml_dtypes' casts:
    int4 after np.rint (ml_dtypes' int4 cast truncates), e2m1 after clipping to +-6 (NaN aside: +6 here,
    -0 in ml_dtypes). Random values, exact midpoints and their float32 neighbours, per-channel scales."""
    Hk, D = 3, 32
    scale = rng.uniform(0.05, 2.0, size=(Hk, 1, D)).astype(np.float32)
    mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1.5, 6.5, 7.5], dtype=np.float32)
    near = np.concatenate([mids, np.nextafter(mids, 0), np.nextafter(mids, 10)])
    near = np.concatenate([near, -near])
    for x_dtype in (np.float32, np.float16, ml_dtypes.bfloat16):
        x = (rng.standard_normal((40, Hk, D)) * rng.uniform(0.1, 8.0)).astype(x_dtype)
        y = x.astype(np.float32) * (np.float32(1) / scale).astype(np.float32).reshape(Hk, D)
        np.testing.assert_array_equal(cupa.quantize(x, scale, "int4").astype(np.int8),
                                      np.clip(np.rint(y), -8, 7).astype(I4).astype(np.int8))
        np.testing.assert_array_equal(cupa.quantize(x, scale, "float4e2m1").view(np.uint8) & 15,
                                      np.clip(y, -6, 6).astype(F4).view(np.uint8) & 15)
    y = np.broadcast_to(near, (2, near.size)).copy()
    np.testing.assert_array_equal(cupa.quantize(y, ONE, "int4").astype(np.int8),
                                  np.clip(np.rint(y), -8, 7).astype(I4).astype(np.int8))
    np.testing.assert_array_equal(cupa.quantize(y, ONE, "float4e2m1").view(np.uint8) & 15,
                                  np.clip(y, -6, 6).astype(F4).view(np.uint8) & 15)


@pytest.mark.parametrize("cache_dtype,qmax", [("int4", 7.0), ("float4e2m1", 6.0), (I4, 7.0), (F4, 6.0)])
def test_compute_scale_maps_the_largest_magnitude_to_the_largest_code(rng, cache_dtype, qmax):
    x = rng.standard_normal((50, 2, 16)).astype(np.float32)
    s = cupa.compute_scale(x, "PER_CHANNEL", cache_dtype)
    assert s.shape == (2, 1, 16) and s.dtype == np.float32
    np.testing.assert_allclose(s[:, 0, :], np.abs(x).max(axis=0) / qmax, rtol=1e-6)
    codes = cupa.quantize(x, s, cache_dtype).astype(np.float32)
    assert np.abs(codes).max(axis=0).min() == qmax      # every channel reaches the top code


@pytest.mark.parametrize("name", ["int4", "float4e2m1"])
@pytest.mark.parametrize("per_channel", [False, True])
def test_dequantize_round_trip(rng, name, per_channel):
    """dequantize(quantize(x)) is within half a step of x inside the range (e2m1's step grows with |x|)."""
    x = rng.standard_normal((30, 2, 16)).astype(np.float32)
    s = cupa.compute_scale(x, "PER_CHANNEL" if per_channel else "PER_TENSOR", name)
    back = cupa.dequantize(cupa.quantize(x, s, name, as_bytes=True), s, name)
    assert back.shape == x.shape and back.dtype == np.float32
    y = np.abs(x / s.reshape(s.shape[0], s.shape[-1]) if per_channel else x / s)
    step = np.ones_like(y) if name == "int4" else np.select([y < 2, y < 4], [0.5, 1.0], 2.0)
    bound = (0.5 * step + 1e-5) * (s.reshape(2, 16) if per_channel else s)
    assert (np.abs(back - x) <= bound).all()


def test_quantize_on_the_device_layout_is_packed_bytes(rng):
    """The bytes a cache holds: quantize(as_bytes=True) is pack_codes of the logical codes."""
    x = rng.standard_normal((5, 2, 8)).astype(np.float16)
    s = np.array([0.3], dtype=np.float32)
    for name in ("int4", "float4e2m1"):
        np.testing.assert_array_equal(cupa.quantize(x, s, name, as_bytes=True), cupa.pack_codes(cupa.quantize(x, s, name)))


# ---------------------------------------------------------------------------------------------- the kernels' code

@pytest.fixture(scope="module")
def host_quant(tmp_path_factory):
    """tests/data/subbyte_host.cu (cuda_src/quant.cuh's 4-bit paths) compiled for the host by nvcc."""
    return util.host_program(tmp_path_factory.mktemp("subbyte_host"), "subbyte_host.cu",
                             ("-Xcompiler", "-fno-strict-aliasing"))


def test_kernel_encoders_match_the_write_rule(host_quant, rng):
    """CacheInt4 / CacheFp4 ::encode_nibble (the prologue's write) against cupa.quantize on random values,
    exact midpoints and their neighbours, saturating values, Inf and NaN; CacheFp4 also against CUDA's
    own __nv_cvt_float_to_fp4 (round to nearest, satfinite)."""
    mids = np.array(list(FP4_TIES) + [0.5, 1.5, 2.5, 6.5, 7.5, 8.5], dtype=np.float32)
    special = np.concatenate([mids, np.nextafter(mids, 0), np.nextafter(mids, 10), [0, 6, 7, 1e30, np.inf, np.nan]])
    special = np.concatenate([special, -special]).astype(np.float32)
    x = np.concatenate([special, (rng.standard_normal(20000) * rng.uniform(0.5, 10, 20000)).astype(np.float32)])
    scale = np.where(np.arange(x.size) < special.size, 1.0, rng.uniform(0.2, 5.0, x.size)).astype(np.float32)
    inv = (np.float32(1) / scale).astype(np.float32)      # float32(1/scale), as the prologue computes it
    got = np.frombuffer(host_quant("encode", np.stack([x, inv], axis=1).astype(np.float32).tobytes()),
                        np.uint8).reshape(-1, 3)
    y = (x * inv).astype(np.float32)                      # the float32 product: quantize(y, 1) applies the rule to it
    for col, name in ((0, "int4"), (1, "float4e2m1")):
        expected = nibbles_of(cupa.quantize(y[None, :], ONE, name, as_bytes=True))[0]
        np.testing.assert_array_equal(got[:, col], expected, err_msg=name)
    np.testing.assert_array_equal(got[:, 1], got[:, 2])    # CUDA's conversion of the same float32 product
    # and per element with its own scale, through quantize's own float32(1/scale)
    pick = rng.choice(x.size, 200, replace=False)
    for i in pick:
        for col, name in ((0, "int4"), (1, "float4e2m1")):
            assert nibbles_of(cupa.quantize(np.array([[x[i], 0]], np.float32), scale[i:i + 1], name,
                                            as_bytes=True))[0, 0] == got[i, col]


def test_kernel_decoders_match_the_read_rule(host_quant):
    vals = np.frombuffer(host_quant("decode", b""), np.float32).reshape(16, 2)
    np.testing.assert_array_equal(vals[:, 0], np.arange(16) - 8)
    np.testing.assert_array_equal(vals[:, 1], FP4_VALUES)
    np.testing.assert_array_equal(np.signbit(vals[:, 1]), np.signbit(FP4_VALUES))


def _t_values(bits, dtype):
    return bits.astype(np.uint16).view(dtype).astype(np.float32)


def test_kernel_widening_into_mma_registers(host_quant, rng):
    """Widen8 (the decode kernel's nibbles -> fp16 / bf16 fragment registers): register i of a word holds
    codes i and i + 4 (low, high half), exactly their values; every code in every position."""
    words = np.concatenate([rng.integers(0, 1 << 32, size=4000, dtype=np.uint64).astype(np.uint32),
                            (np.arange(16, dtype=np.uint32)[:, None] << (4 * np.arange(8, dtype=np.uint32))).ravel()])
    regs = np.frombuffer(host_quant("widen", words.tobytes()), np.uint32).reshape(-1, 4, 4)
    nib = (words[:, None] >> (4 * np.arange(8, dtype=np.uint32))) & 15
    tables = {"int4": np.arange(16, dtype=np.float32) - 8, "fp4": FP4_VALUES}
    for k, (dtype, kind) in enumerate([(np.float16, "int4"), (np.float16, "fp4"), (ml_dtypes.bfloat16, "int4"),
                                       (ml_dtypes.bfloat16, "fp4")]):
        lo, hi = _t_values(regs[:, k] & 0xFFFF, dtype), _t_values(regs[:, k] >> 16, dtype)
        expected = tables[kind][nib]
        for got, want in ((lo, expected[:, :4]), (hi, expected[:, 4:])):
            np.testing.assert_array_equal(got, want, err_msg=f"{np.dtype(dtype).name} {kind}")
            np.testing.assert_array_equal(np.signbit(got), np.signbit(want))


def test_kernel_widening_in_order(host_quant, rng):
    """widen16_packed (the prefill kernel's widened tiles): 8 bytes -> the 16 values in code order."""
    groups = rng.integers(0, 256, size=(3000, 8)).astype(np.uint8)
    regs = np.frombuffer(host_quant("natural", groups.tobytes()), np.uint32).reshape(-1, 4, 8)
    for k, (dtype, name) in enumerate([(np.float16, "int4"), (np.float16, "float4e2m1"), (ml_dtypes.bfloat16, "int4"),
                                       (ml_dtypes.bfloat16, "float4e2m1")]):
        got = regs[:, k].copy().view(np.uint16).view(dtype).astype(np.float32)
        np.testing.assert_array_equal(got, cupa.dequantize(groups, ONE, name), err_msg=f"{np.dtype(dtype).name} {name}")


# ---------------------------------------------------------------------------------------------- dispatch

from cupa import dispatch  # noqa: E402
from cupa.device import describe_capability  # noqa: E402
from cupa.kernels import backend as kbackend, decode, prefill, registry  # noqa: E402
from tests import gpu_cases as gc  # noqa: E402

H200 = describe_capability(9, 0)
#: (K kind, V kind) of the packed caches the decode and prefill kernels read
PACKED_PAIRS = [("int4", None), ("fp4", None), ("int4", "fp4"), ("fp4", "int4")]
PREFILL_SHAPE = dict(q_lens=[40, 30], past=[10, 0])
DECODE_SHAPE = dict(q_lens=[1, 1, 1], past=[100, 7, 3000])
NOT_VERIFIED = "not yet verified on a GPU"


def packed_problem(rng, cache="int4", v_cache=None, **kw):
    args = dict(H=8, Hk=2, D=128, cache=cache, v_cache=v_cache, **PREFILL_SHAPE)
    args.update(kw)
    inputs, attrs = gc.build(rng, **args)
    op = cupa.PagedAttention(**attrs)
    return op._problem(op._bind((), inputs))


@pytest.mark.parametrize("shape", [PREFILL_SHAPE, DECODE_SHAPE], ids=["prefill", "decode"])
@pytest.mark.parametrize("cache,v_cache", PACKED_PAIRS)
def test_auto_never_chooses_unverified_packed_kernels(rng, shape, cache, v_cache, monkeypatch):
    """While a backend marks a feature unverified (CudaBackend.unverified), auto raises a PagedAttentionError
    naming the backends to select, and explain() says why for each."""
    monkeypatch.setattr(decode.BACKEND, "unverified", frozenset({"subbyte"}))
    monkeypatch.setattr(prefill.BACKEND, "unverified", frozenset({"subbyte"}))
    p = packed_problem(rng, cache, v_cache, **shape)
    assert p.sub_byte and p.packed
    with pytest.raises(cupa.PagedAttentionError, match="no CUDA backend serves this call") as info:
        dispatch.choose(p, H200, cupa.Options())
    for name in ("decode", "prefill"):
        assert f"select it with cupa.Options(backend={name!r})" in str(info.value)
    text = dispatch.account(p, H200, cupa.Options())
    for name in ("decode", "prefill"):
        line = next(s for s in text.splitlines() if s.startswith(f"{name}: "))
        assert f"not eligible: packed 4-bit caches (k/v_cache_dtype 'int4', 'float4e2m1'): {NOT_VERIFIED}" in line
    for name in ("prefill_wgmma", "mla", "general"):
        line = next(s for s in text.splitlines() if s.startswith(f"{name}: "))
        assert "packed 4-bit caches (k/v_cache_dtype 'int4', 'float4e2m1') is not served here (the decode and " \
               "prefill backends serve it)" in line, line


@pytest.mark.parametrize("cache,v_cache", PACKED_PAIRS)
@pytest.mark.parametrize("name", ["decode", "prefill"])
def test_named_backends_serve_packed_caches(rng, cache, v_cache, name):
    for shape in (PREFILL_SHAPE, DECODE_SHAPE):
        p = packed_problem(rng, cache, v_cache, **shape)
        options = cupa.Options(backend=name)
        assert dispatch.choose(p, H200, options).name == name
        chosen = next(s for s in dispatch.account(p, H200, options).splitlines() if s.startswith(f"{name}: "))
        assert chosen.startswith(f"{name}: chosen") and NOT_VERIFIED not in chosen, chosen


@pytest.mark.parametrize("name", ["prefill_wgmma", "mla", "general"])
def test_other_backends_decline_packed_caches(rng, name):
    p = packed_problem(rng, "fp4")
    with pytest.raises(cupa.PagedAttentionError, match=f"options.backend: {name!r} cannot serve this call: packed "
                                                       "4-bit caches .* is not served here"):
        dispatch.choose(p, H200, cupa.Options(backend=name))


def test_auto_chooses_decode_and_prefill(rng):
    """Verified on an H200 (tests/gpu/test_subbyte.py): auto picks as for any cache."""
    assert not decode.BACKEND.unverified and not prefill.BACKEND.unverified
    assert dispatch.choose(packed_problem(rng, **DECODE_SHAPE), H200, cupa.Options()).name == "decode"
    assert dispatch.choose(packed_problem(rng, **PREFILL_SHAPE), H200, cupa.Options()).name == "prefill"
    assert dispatch.choose(packed_problem(rng, dtype="float32"), H200, cupa.Options()).name == "decode"


def test_a_4bit_cache_beside_an_8bit_one_is_declined_with_its_reason(rng):
    """K int4 with V e4m3 bytes (one uint8 element type, rows of D/2 and D bytes): a valid call that the
    reference serves and the kernels decline (packed_cache_reasons)."""
    case = util.make_case(rng, cache="int4", v_cache="fp8_bytes", head_size=128, num_heads=8)
    op = cupa.PagedAttention(**case.attrs)
    p = op._problem(op._bind((), {k: v for k, v in case.inputs.items() if v is not None}))
    assert p.sub_byte and not p.packed
    assert kbackend.packed_cache_reasons(p) and not kbackend.packed_cache_reasons(packed_problem(rng))
    for name in ("decode", "prefill"):
        with pytest.raises(cupa.PagedAttentionError, match="k_cache_dtype='int4' with v_cache_dtype='float8e4m3fn': "
                                                           "the kernels read K and V rows of one width"):
            dispatch.choose(p, H200, cupa.Options(backend=name))
    out = case.run()   # the reference serves it
    assert np.isfinite(out.astype(np.float32)).all()


def test_packed_tiles_take_half_the_shared_memory_of_8bit_ones():
    """Stages of K and V rows of D/2 bytes (MmaDecodeSmem, PrefillSmem): the decode kernel's loop, or its
    combine area where that is larger; the prefill's stages (its widened tiles are as for 8-bit codes)."""
    for d in decode.MMA_HEAD_SIZES:
        for stages in decode.MMA_STAGES:
            q, keys = 16 * d * 2, decode.MMA_KEY_TILE
            loop = q + stages * 2 * keys * (d // 2) + (stages + 1) * keys * 4
            combine = q + 2 * 4 * 16 * 4 + 4 * 16 * (d + 4) * 4
            assert decode.mma_shared_bytes(d, True, stages, packed=True) == max(loop, combine)
    for d, tiles in prefill.TILES.items():
        for tile in tiles:
            stages = prefill.TILE_CONFIG[(d,) + tile][2]
            assert (prefill.shared_bytes(d, True, tile) - prefill.shared_bytes(d, True, tile, packed=True)
                    == stages * 2 * tile[1] * d // 2)


@pytest.mark.parametrize("cache,v_cache", PACKED_PAIRS)
def test_every_packed_launch_is_a_registered_specialization(rng, cache, v_cache):
    """What a plan launches (prologue and attention kernel) is in registry.all_specializations(), so
    ``python -m cupa.compile --check`` and ``--warm`` cover it: the tensor-core decode (both loops, D=64/128),
    the CUDA-core decode (fp32, D=256, other head sizes) and the prefill tiles."""
    specs = set(registry.all_specializations())
    options = cupa.Options()
    cases = [dict(DECODE_SHAPE, D=d, H=h, dtype=dt) for d in (64, 128) for h in (8, 32)
             for dt in ("float16", "bfloat16")]
    cases += [dict(DECODE_SHAPE, D=256), dict(DECODE_SHAPE, D=128, dtype="float32"), dict(DECODE_SHAPE, D=72)]
    cases += [dict(PREFILL_SHAPE, D=d, dtype=dt) for d in (64, 128, 256) for dt in ("float16", "bfloat16")]
    seen = set()
    for kw in cases:
        p = packed_problem(rng, cache, v_cache, **kw)
        for device in (H200, describe_capability(8, 0), describe_capability(8, 9)):
            launched = {registry.prologue_spec(p.dtype, p.cache_kind, v_cache_kind=p.v_cache_kind),
                        decode.BACKEND._spec(p, device, options)}
            if p.dtype in prefill.PREFILL_DTYPES and p.head_size in prefill.PREFILL_HEAD_SIZES:
                launched.add(prefill.BACKEND._spec(p, device, options))
            assert launched <= specs, launched - specs
            seen |= launched
    names = [s.name_expression for s in seen]
    for kernel in ("paged_prologue<", "paged_decode_mma<", "paged_decode<", "paged_prefill<"):
        assert any(n.startswith(kernel) for n in names), kernel
    if v_cache is not None:   # V's own trait, last
        assert all(n.endswith(f", {registry.types.cache(v_cache, 'float16')}>") for n in names), names
