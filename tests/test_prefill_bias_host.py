"""attention_bias on the tensor-core prefill backend, without a GPU: its choice, declines, tiles, specializations
and launches.

The launches go through :class:`tests.test_launch_fastpath.FakeCupy` (kernels that know their C signatures), so
every parameter's size is checked against cuda_src, and both launch routes must pass the same bytes. The
results themselves are checked on a GPU (tests/gpu/test_prefill_bias.py).
"""

import numpy as np
import pytest

import cupa
from cupa import dispatch
from cupa.device import describe_capability
from cupa.kernels import general, prefill, prefill_wgmma, registry, types
from tests.test_dispatch import problem_of
from tests.test_launch_fastpath import FakeCupy, fake_case, fake_cupy

H200 = describe_capability(9, 0)
RTX = describe_capability(8, 6)
PREFILL = cupa.Options(backend="prefill")


def test_choice_follows_verification_and_shape(rng, monkeypatch):
    """A prefill-shaped bias call is the prefill backend's once its bias instances are verified (before: the
    general backend's, and explain() says why); decode-shaped ones stay the general backend's."""
    p = problem_of(rng, bias=(False, False))
    assert prefill.BACKEND.not_supported_reasons(p, H200, cupa.Options()) == []
    assert any("attention_bias is not served here" in r for r in
               prefill_wgmma.BACKEND.not_supported_reasons(p, H200, cupa.Options()))
    monkeypatch.setattr(prefill.BACKEND, "unverified", frozenset({"bias"}))
    assert dispatch.choose(p, H200, cupa.Options()) is general.BACKEND
    assert ("prefill: not eligible: attention_bias: not yet verified on a GPU here (select it with "
            "cupa.Options(backend='prefill'))") in dispatch.account(p, H200, cupa.Options())
    assert dispatch.choose(p, H200, PREFILL) is prefill.BACKEND
    text = dispatch.account(p, H200, PREFILL)
    assert "prefill: chosen (paged prefill on tensor cores" in text and "attention_bias entries" in text, text
    monkeypatch.setattr(prefill.BACKEND, "unverified", frozenset())
    assert dispatch.choose(p, H200, cupa.Options()) is prefill.BACKEND
    decode_shaped = problem_of(rng, bias=(False, False), q_lens=[1, 1, 1], past=[300, 17, 4000])
    assert dispatch.choose(decode_shaped, H200, cupa.Options()) is general.BACKEND
    # output_qk is the general backend's, with or without a bias
    with_qk = problem_of(rng, bias=(False, False), qk_output=1)
    assert dispatch.choose(with_qk, H200, cupa.Options()) is general.BACKEND


@pytest.mark.parametrize("kw", [dict(cache="int8"), dict(cache="fp8", k_quant="PER_TENSOR"), dict(cache="int4"),
                                dict(cache="int4", v_cache="fp4")])
def test_quantized_and_packed_caches_take_the_bias_instances(rng, kw):
    """Every cache kind the prefill kernel reads has bias instances (packed 4-bit caches have no other backend
    for a bias)."""
    p = problem_of(rng, bias=(False, True), **kw)
    assert dispatch.choose(p, H200, cupa.Options()) is prefill.BACKEND
    spec = prefill.BACKEND._spec(p, H200, cupa.Options())
    assert spec.name_expression.endswith(", true>") and str(spec) in {str(s) for s in prefill.BACKEND.specializations()}


@pytest.mark.parametrize("kw,device,why", [
    (dict(dtype="float32"), H200, "float16 or bfloat16"),
    (dict(D=96), H200, "head_size 96"),
    (dict(D=256), RTX, "paged_prefill with attention_bias needs"),
    (dict(D=64), RTX, "paged_prefill with attention_bias needs"),
    (dict(D=64, cache="int8"), RTX, "paged_prefill with attention_bias needs"),
])
def test_declines_what_its_bias_instances_do_not_cover(rng, kw, device, why):
    p = problem_of(rng, bias=(True, False), **kw)
    reasons = prefill.BACKEND.not_supported_reasons(p, device, PREFILL)
    assert any(why in r for r in reasons), reasons
    assert dispatch.choose(p, device, cupa.Options()) is general.BACKEND
    with pytest.raises(cupa.PagedAttentionError, match="options.backend: 'prefill' cannot serve this call"):
        dispatch.choose(p, device, PREFILL)


def test_bias_tiles_and_shared_memory():
    """The bias instances' tiles leave two CTAs per SM at head_size 128 on every GPU whose shared memory
    allows it (and fit one CTA of the 99 KB GPUs); their shared memory adds a stage of bias entries per
    K/V stage and each row's offset."""
    for cc in ((8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0)):
        assert prefill.tile_for(128, False, describe_capability(*cc), bias=True) == (128, 32)
    assert prefill.tile_for(64, False, H200, bias=True) == (128, 64)
    assert prefill.tile_for(256, False, H200, bias=True) == (128, 32)
    assert prefill.tile_for(64, False, RTX, bias=True) is None
    for d, tiles in prefill.BIAS_TILES.items():
        for rows, keys in tiles:
            stages = prefill.TILE_CONFIG[(d, rows, keys)][2]
            extra = prefill.shared_bytes(d, False, (rows, keys), bias=True) - prefill.shared_bytes(d, False, (rows, keys))
            assert extra == stages * rows * keys * 2 + rows * 8


def test_bias_specializations():
    spec = registry.prefill_spec("float16", "T", 128, (128, 32), bias=True)
    assert str(spec) == "prefill:paged_prefill<__half, CacheSame<__half>, 128, 128, 32, CacheSame<__half>, true>"
    assert str(registry.prefill_spec("float16", "T", 128, (128, 32))) == \
        "prefill:paged_prefill<__half, CacheSame<__half>, 128, 128, 32>"
    specs = {str(s) for s in prefill.BACKEND.specializations()}
    for dtype in prefill.PREFILL_DTYPES:
        for kind, v_kind in types.KV_KINDS:
            for d, tiles in prefill.BIAS_TILES.items():
                for tile in tiles:
                    assert str(registry.prefill_spec(dtype, kind, d, tile, v_kind, bias=True)) in specs
    assert str(registry.prefill_spec("float16", "int4", 128, (128, 32), "fp4", bias=True)) == (
        "prefill:paged_prefill<__half, CacheInt4, 128, 128, 32, CacheFp4, true>")
    # (the wgmma prefill serves no bias: none of its instances is a bias instance of paged_prefill)
    assert "bias" not in prefill_wgmma.BACKEND.serves
    assert all(s.family == "prefill_wgmma_ws" for s in prefill_wgmma.BACKEND.specializations())


def _ptr(param: bytes) -> int:
    return int.from_bytes(param, "little")


def _launches(mode="fast", bias_shape=(2, 32, 64, 100), dtype=np.float16):
    fake = FakeCupy()
    with fake_cupy(fake):
        x, attrs = fake_case(fake, B=2, L=100, N=128, dtype=dtype)
        x["cumulative_sequence_length"] = fake.empty((3,), np.int32)
        if bias_shape is not None:
            x["attention_bias"] = fake.empty(bias_shape, dtype)
        op = cupa.PagedAttention(**attrs, options=cupa.Options(backend="prefill", launch=mode))
        op(**x, attention_metadata=np.array([64, 100], np.int32))
    return fake, x


@pytest.mark.parametrize("bias_shape", [(2, 32, 64, 100), (1, 1, 64, 104), (2, 1, 70, 100)])
def test_launches_pass_the_bias_and_its_dims(bias_shape):
    fake, x = _launches(bias_shape=bias_shape)
    names = [launch_[1] for launch_ in fake.launches]
    assert names[-1] == "paged_prefill", names
    params = fake.launches[-1][-1]
    assert _ptr(params[-5]) == x["attention_bias"].data.ptr != 0
    assert [_ptr(p) for p in params[-4:]] == list(bias_shape)


def test_plain_prefill_passes_a_null_bias():
    fake, _ = _launches(bias_shape=None)
    params = fake.launches[-1][-1]
    assert [_ptr(p) for p in params[-5:]] == [0, 1, 1, 0, 0]


def test_routes_pass_the_same_bytes():
    seen = {}
    for mode in ("rawkernel", "fast"):
        fake, _ = _launches(mode)
        seen[mode] = ([launch_[1:] for launch_ in fake.launches], fake.allocations)
    assert seen["fast"] == seen["rawkernel"]
