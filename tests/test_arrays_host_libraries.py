"""Same library in, same library out on the CPU: PyTorch CPU tensors and JAX CPU arrays run the reference.

The caches are updated in place where they live (a torch CPU cache; a JAX cache is an error: JAX arrays
are immutable), ``out=`` follows the same rule, and a mix of CPU and GPU inputs names the input on the
other device.
"""

import numpy as np
import pytest

import cupa
from tests import util


def _numpy_result(inputs, attrs, **kw):
    x = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in inputs.items()}
    return cupa.paged_attention(**x, **attrs, **kw), x


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_torch_cpu_tensors_run_the_reference_and_come_back_as_torch(rng, dtype):
    torch = pytest.importorskip("torch")
    inputs, attrs = util.build(rng, q_lens=[3, 1], past=[5, 9], H=4, Hk=2, D=16, dtype=dtype)
    want, after = _numpy_result(inputs, attrs)
    t = {}
    for k, v in inputs.items():
        if v.dtype.name == "bfloat16":
            t[k] = torch.from_numpy(v.view(np.int16).copy()).view(torch.bfloat16)
        else:
            t[k] = torch.from_numpy(v.copy())
    got = cupa.paged_attention(**t, **attrs)
    assert isinstance(got, torch.Tensor) and got.device.type == "cpu" and str(got.dtype) == f"torch.{dtype}"
    as_np = got.view(torch.int16).numpy().view(want.dtype) if dtype == "bfloat16" else got.numpy()
    assert np.array_equal(as_np.view(np.uint8), want.view(np.uint8))
    kc = t["key_cache"].view(torch.int16).numpy() if dtype == "bfloat16" else t["key_cache"].numpy()
    assert np.array_equal(kc.view(np.uint8), after["key_cache"].view(np.uint8)), "the torch cache is written in place"
    out = torch.empty_like(got)
    assert cupa.paged_attention(**{**t, "key_cache": t["key_cache"].clone(), "value_cache": t["value_cache"].clone()},
                                **attrs, out=out) is out
    assert torch.equal(out, got)


def test_torch_cpu_extra_outputs_and_fp8_caches(rng):
    torch = pytest.importorskip("torch")
    inputs, attrs = util.build(rng, q_lens=[2, 1], past=[5, 9], H=4, Hk=2, D=16, cache="int8")
    want, _ = _numpy_result(inputs, attrs, return_lse=True, qk_output=1)
    t = {k: torch.from_numpy(v.copy()) for k, v in inputs.items()}
    out, qk, lse = cupa.paged_attention(**t, **attrs, return_lse=True, qk_output=1)
    assert all(isinstance(a, torch.Tensor) for a in (out, qk, lse))
    for a, b in zip((out, qk, lse), want):
        assert np.array_equal(a.numpy(), b)
    fp8 = torch.float8_e4m3fn
    inputs, attrs = util.build(rng, q_lens=[1, 1], past=[5, 9], H=4, Hk=2, D=16, cache="fp8")
    want, after = _numpy_result(inputs, attrs)
    t = {k: torch.from_numpy(v.copy()) for k, v in inputs.items()}
    t["key_cache"], t["value_cache"] = t["key_cache"].view(fp8), t["value_cache"].view(fp8)
    attrs = {k: v for k, v in attrs.items() if k not in ("k_cache_dtype", "v_cache_dtype")}
    got = cupa.paged_attention(**t, **attrs)
    assert np.array_equal(got.numpy(), want)
    assert np.array_equal(t["key_cache"].view(torch.uint8).numpy(), after["key_cache"])


def test_torch_errors_name_the_input(rng):
    torch = pytest.importorskip("torch")
    inputs, attrs = util.build(rng, q_lens=[2, 1], past=[5, 9], H=4, Hk=2, D=16)
    t = {k: torch.from_numpy(v.copy()) for k, v in inputs.items()}
    with pytest.raises(cupa.PagedAttentionError, match="key_cache: got a non-contiguous"):
        cupa.paged_attention(**{**t, "key_cache": torch.cat([t["key_cache"]] * 2, dim=-1)[..., ::2]}, **attrs)
    with pytest.raises(cupa.PagedAttentionError, match="out: got a numpy.ndarray|out: got a NumPy"):
        cupa.paged_attention(**t, **attrs, out=np.empty((3, 64), np.float16))
    with pytest.raises(cupa.PagedAttentionError, match=r"out: got shape \(3, 32\)"):
        cupa.paged_attention(**t, **attrs, out=torch.empty((3, 32), dtype=torch.float16))
    with pytest.raises(cupa.PagedAttentionError, match="options.backend: got 'decode'; expected 'auto' or "
                                                       "'reference' for host"):
        cupa.paged_attention(**t, **attrs, options=cupa.Options(backend="decode"))
    meta = {k: v.to("meta") if k == "query" else v for k, v in t.items()}
    with pytest.raises(cupa.PagedAttentionError, match="query: got a torch.Tensor on device .meta.; expected an array"):
        cupa.paged_attention(**meta, **attrs)


def test_mixed_numpy_and_torch_cpu_inputs_are_all_host(rng):
    torch = pytest.importorskip("torch")
    inputs, attrs = util.build(rng, q_lens=[2, 1], past=[5, 9], H=4, Hk=2, D=16)
    want, _ = _numpy_result(inputs, attrs)
    mixed = dict(inputs, query=torch.from_numpy(inputs["query"].copy()))
    got = cupa.paged_attention(**{k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in mixed.items()},
                               **attrs)
    assert isinstance(got, torch.Tensor) and np.array_equal(got.numpy(), want)


def test_jax_cpu_arrays_run_the_reference_and_a_jax_cache_is_an_error(rng):
    jnp = pytest.importorskip("jax.numpy")
    inputs, attrs = util.build(rng, q_lens=[2, 1], past=[5, 9], H=4, Hk=2, D=16)
    want, _ = _numpy_result(inputs, attrs)
    x = {k: (v if k.endswith("_cache") else jnp.asarray(v)) for k, v in inputs.items()}
    got = cupa.paged_attention(**x, **attrs)
    assert type(got).__module__.split(".")[0] in ("jax", "jaxlib")
    assert np.array_equal(np.asarray(got), want)
    with pytest.raises(cupa.PagedAttentionError, match="key_cache: got a JAX array; expected a mutable array"):
        cupa.paged_attention(**{**x, "key_cache": jnp.asarray(inputs["key_cache"])}, **attrs)


def test_a_device_input_among_host_inputs_is_named(rng):
    """A CUDA array among CPU arrays: the error names it (a DLPack producer claiming CUDA memory)."""
    inputs, attrs = util.build(rng, q_lens=[2, 1], past=[5, 9], H=4, Hk=2, D=16)

    class OnGpu:
        shape, dtype = inputs["past_seqlens"].shape, inputs["past_seqlens"].dtype

        def __dlpack__(self, stream=None):  # pragma: no cover - never imported
            raise AssertionError

        def __dlpack_device__(self):
            return (2, 0)

    with pytest.raises(cupa.PagedAttentionError, match="past_seqlens: got an array in CUDA device memory; "
                                                       "expected a CPU array like query"):
        cupa.paged_attention(**{**inputs, "past_seqlens": OnGpu()}, **attrs)
