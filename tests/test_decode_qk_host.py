"""output_qk on the decode backend, without a GPU: its choice, its specializations and its launches.

The launches go through :class:`tests.test_launch_fastpath.FakeCupy` (kernels that know their C signatures),
so every parameter's size is checked against cuda_src, and both launch routes must pass the same bytes.
The results themselves are checked on a GPU (tests/gpu/test_decode_qk.py).
"""

import pytest

import cupa
from cupa import dispatch
from cupa.device import describe_capability
from cupa.kernels import decode, general, registry
from tests.test_dispatch import problem_of
from tests.test_launch_fastpath import FakeCupy, fake_case, fake_cupy

H200 = describe_capability(9, 0)
DECODE = cupa.Options(backend="decode")
DECODE_SHAPED = dict(q_lens=[1, 1, 1], past=[300, 17, 4000])


@pytest.mark.parametrize("qk_output", [1, 2])
def test_choice_follows_verification_and_shape(rng, qk_output, monkeypatch):
    """Decode-shaped output_qk calls are the decode backend's once its output_qk is verified (before: the
    general backend's, and explain() says why); longer queries stay the general backend's."""
    p = problem_of(rng, qk_output=qk_output, **DECODE_SHAPED)
    assert decode.BACKEND.not_supported_reasons(p, H200, cupa.Options()) == []
    monkeypatch.setattr(decode.BACKEND, "unverified", frozenset({"output_qk"}))
    assert dispatch.choose(p, H200, cupa.Options()) is general.BACKEND
    assert ("decode: not eligible: output_qk (qk_output != 0): not yet verified on a GPU here (select it with "
            "cupa.Options(backend='decode'))") in dispatch.account(p, H200, cupa.Options())
    assert dispatch.choose(p, H200, DECODE) is decode.BACKEND
    text = dispatch.account(p, H200, DECODE)
    assert "decode: chosen (paged flash-decoding" in text and "paged_general_finish" in text, text
    monkeypatch.setattr(decode.BACKEND, "unverified", frozenset())
    assert dispatch.choose(p, H200, cupa.Options()) is decode.BACKEND
    prefill_shaped = problem_of(rng, qk_output=qk_output)
    assert not decode.BACKEND.preferred(prefill_shaped, H200, cupa.Options())
    assert dispatch.choose(prefill_shaped, H200, cupa.Options()) is general.BACKEND
    assert dispatch.choose(problem_of(rng, **DECODE_SHAPED), H200, cupa.Options()) is decode.BACKEND


@pytest.mark.parametrize("kw,why", [
    (dict(cache="int8"), "16-bit caches only"),
    (dict(dtype="float32"), "fp16/bf16 activations"),
    (dict(D=96), "head_size"),
])
def test_declines_what_its_qk_instances_do_not_cover(rng, kw, why):
    p = problem_of(rng, qk_output=2, **DECODE_SHAPED, **kw)
    reasons = decode.BACKEND.not_supported_reasons(p, H200, DECODE)
    assert any(why in r and "the general backend serves the rest" in r for r in reasons), reasons
    assert dispatch.choose(p, H200, cupa.Options()) is general.BACKEND
    with pytest.raises(cupa.PagedAttentionError, match="options.backend: 'decode' cannot serve this call"):
        dispatch.choose(p, H200, DECODE)


def test_qk_specializations():
    spec = registry.decode_mma_spec("float16", "T", 128, 3, qk=True)
    assert str(spec).startswith("decode_mma:paged_decode_mma<__half, CacheSame<__half>, 128, 3, false, "
                                "CacheSame<__half>, true>")
    assert str(registry.decode_mma_spec("float16", "T", 128, 3)).startswith(
        "decode_mma:paged_decode_mma<__half, CacheSame<__half>, 128, 3, false>")
    with pytest.raises(ValueError, match="head-major"):
        registry.decode_mma_spec("float16", "int8", 128, 3, keys_as_m=True, qk=True)
    specs = {str(s) for s in decode.BACKEND.specializations()}
    for dtype in ("float16", "bfloat16"):
        for d in decode.MMA_HEAD_SIZES:
            for stages in decode.MMA_STAGES:
                assert str(registry.decode_mma_spec(dtype, "T", d, stages, qk=True)) in specs
        assert str(registry.general_finish_spec(dtype)) in specs


def _launches(qk_output, return_lse, mode="fast", md=None):
    fake = FakeCupy()
    with fake_cupy(fake):
        fake._heap[0] = 0x7F00_0000_0000
        x, attrs = fake_case(fake, B=8, L=4096)
        op = cupa.PagedAttention(**attrs, qk_output=qk_output, return_lse=return_lse,
                                 options=cupa.Options(backend="decode", launch=mode))
        result = op(**x, attention_metadata=md)
    return fake, result


def _ptr(param: bytes) -> int:
    return int.from_bytes(param, "little")


@pytest.mark.parametrize("qk_output", [1, 2])
@pytest.mark.parametrize("return_lse", [False, True])
def test_launches_decode_then_finish(qk_output, return_lse):
    """paged_decode_mma's QK instance gets output_qk, qk_mode and the width; then paged_general_finish, in its
    one-split form, gets the same output_qk and the lse the decode kernel wrote (the call's, or under
    qk_output=2 a workspace's)."""
    fake, result = _launches(qk_output, return_lse)
    names = [launch_[1] for launch_ in fake.launches]
    assert names == ["paged_prologue", "paged_decode_mma", "paged_general_finish"], names
    dec, fin = fake.launches[1], fake.launches[2]
    params_d, params_f = dec[-1], fin[-1]
    qk = result[1]
    width = qk.shape[2]
    assert qk.shape == (32, 8, width)
    assert _ptr(params_d[-3]) == qk.data.ptr
    assert _ptr(params_d[-2]) == qk_output and _ptr(params_d[-1]) == width
    assert fin[2] == (8, 32 // general.FINISH_WARPS, -(-width // general.FINISH_KEYS))
    # finish pointers: cum, past, query_positions, head_sink, v_scale, bias, part_o, part_ml, out, output_qk, lse
    assert [_ptr(p) for p in params_f[5:8]] == [0, 0, 0]
    assert _ptr(params_f[9]) == qk.data.ptr
    lse_d, lse_f = _ptr(params_d[14]), _ptr(params_f[10])
    assert lse_d == lse_f
    if return_lse:
        assert lse_d == result[2].data.ptr
    elif qk_output == 2:
        assert lse_d != 0  # a workspace row per (token, head)
    else:
        assert lse_d == 0
    # the one-split form: num_splits (the finish's 9th scalar) is 1, qk_mode and the width last
    scalars = params_f[11:]
    assert _ptr(scalars[8]) == 1 and _ptr(scalars[-2]) == qk_output and _ptr(scalars[-1]) == width


def test_routes_pass_the_same_bytes():
    seen = {}
    for mode in ("rawkernel", "fast"):
        fake, _ = _launches(2, False, mode)
        seen[mode] = ([launch_[1:] for launch_ in fake.launches], fake.allocations)
    assert seen["fast"] == seen["rawkernel"]


def test_plain_calls_pass_null_output_qk():
    """Without output_qk the decode kernel's QK parameters are a null pointer and zeros, and no finish runs."""
    fake = FakeCupy()
    with fake_cupy(fake):
        x, attrs = fake_case(fake, B=8, L=4096)
        cupa.PagedAttention(**attrs)(**x)
    names = [launch_[1] for launch_ in fake.launches]
    assert names == ["paged_prologue", "paged_decode_mma"], names
    assert [_ptr(p) for p in fake.launches[1][-1][-3:]] == [0, 0, 0]

