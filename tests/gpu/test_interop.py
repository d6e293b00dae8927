"""Zero-copy interop on the device (contract §5): CuPy, PyTorch and JAX inputs, streams, outputs,
and the run-time compile route of cupa.jit (RawModule, KernelCompileError, cubin loading).

Every test needs a CUDA device (marker ``gpu``); PyTorch and JAX tests skip where they are absent.
"""

import time
from pathlib import Path

import numpy as np
import pytest

from cupa import PagedAttentionError, arrays, jit

pytestmark = pytest.mark.gpu

DATA = Path(__file__).resolve().parents[1] / "data"


@pytest.fixture
def torch(torch_cuda):
    return torch_cuda


@pytest.fixture
def jax():
    jax = pytest.importorskip("jax")
    try:
        if not jax.devices("gpu"):
            pytest.skip("JAX has no GPU device")
    except RuntimeError:
        pytest.skip("JAX has no GPU backend")
    return jax


# -- to_cupy / device_arrays --------------------------------------------------------------------------

def test_cupy_arrays_pass_through(cp):
    q = cp.ones((4, 8), dtype=cp.float16)
    assert arrays.to_cupy(q) is q
    dev, device = arrays.device_arrays({"query": q, "key": None, "attention_metadata": [1, 2]})
    assert dev["query"] is q and dev["key"] is None and dev["attention_metadata"] is None
    assert device == q.device.id


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "int32", "int8", "uint8"])
def test_torch_tensors_are_viewed_zero_copy(cp, torch, dtype):
    t = torch.arange(24, device="cuda").reshape(4, 6).to(getattr(torch, dtype))
    c = arrays.to_cupy(t, "query")
    assert c.data.ptr == t.data_ptr(), "to_cupy copied a torch tensor"
    assert c.shape == tuple(t.shape) and c.dtype.itemsize == t.element_size()
    assert arrays.dtype_name(t) == dtype
    np.testing.assert_array_equal(cp.asnumpy(c).astype(np.float64), t.cpu().double().numpy())


def test_torch_fp8_cache_is_viewed_as_its_bytes(cp, torch):
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("torch without float8_e4m3fn")
    cache = (torch.randn(3, 16, 2, 8, device="cuda") * 10).to(torch.float8_e4m3fn)
    assert arrays.dtype_name(cache) == "float8_e4m3fn"
    c = arrays.to_cupy(cache, "key_cache")
    assert c.dtype == cp.uint8 and c.shape == tuple(cache.shape)
    assert c.data.ptr == cache.data_ptr()
    np.testing.assert_array_equal(cp.asnumpy(c), cache.view(torch.uint8).cpu().numpy())
    c[0, 0, 0, 0] = 0x38  # e4m3 code of 1.0: writes land in the torch cache
    torch.cuda.synchronize()
    assert float(cache[0, 0, 0, 0]) == 1.0


def test_torch_tensor_requiring_grad_is_viewed(cp, torch):
    t = torch.ones(4, 8, device="cuda", requires_grad=True)
    assert arrays.to_cupy(t, "query").data.ptr == t.data_ptr()


def test_jax_arrays_are_viewed_zero_copy(cp, jax):
    import jax.numpy as jnp

    x = jnp.arange(32, dtype=jnp.float16).reshape(4, 8)
    c = arrays.to_cupy(x, "query")
    assert c.data.ptr == x.unsafe_buffer_pointer()
    np.testing.assert_array_equal(cp.asnumpy(c), np.asarray(x))
    assert arrays.dtype_name(x) == "float16"


def test_host_inputs_are_errors_naming_the_input(cp, torch):
    q = torch.ones(4, 8, device="cuda")
    with pytest.raises(PagedAttentionError, match=r"^key: got a torch tensor on device 'cpu'"):
        arrays.device_arrays({"query": q, "key": torch.ones(4, 8)})
    with pytest.raises(PagedAttentionError, match=r"^value: got a NumPy \(host\) array"):
        arrays.device_arrays({"query": q, "value": np.ones((4, 8))})
    with pytest.raises(PagedAttentionError, match="^query: got a torch tensor on device 'cpu'"):
        arrays.to_cupy(torch.ones(3), "query")


def test_mixed_devices_are_errors_naming_the_input(cp, torch):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    q = torch.ones(4, 8, device="cuda:0")
    k = torch.ones(4, 8, device="cuda:1")
    with pytest.raises(PagedAttentionError, match=r"^key: got an array on CUDA device 1; expected CUDA device 0"):
        arrays.device_arrays({"query": q, "key": k})


def test_libraries_may_mix_on_one_device(cp, torch):
    q = torch.ones(4, 8, device="cuda", dtype=torch.float16)
    kc = cp.zeros((2, 4, 1, 8), dtype=cp.float16)
    dev, device = arrays.device_arrays({"query": q, "key_cache": kc})
    assert dev["key_cache"] is kc and dev["query"].data.ptr == q.data_ptr() and device == q.device.index


def test_non_contiguous_inputs_and_caches_are_rejected(cp, torch):
    q = torch.ones(4, 16, device="cuda")[:, ::2]
    with pytest.raises(PagedAttentionError, match=r"^query: got a non-contiguous array.*C-contiguous"):
        arrays.device_arrays({"query": q})
    kc = cp.zeros((2, 4, 2, 8), dtype=cp.float16)[:, :, :1]
    with pytest.raises(PagedAttentionError, match=r"^key_cache: got a non-contiguous.*written in place"):
        arrays.device_arrays({"query": torch.ones(4, 8, device="cuda"), "key_cache": kc})


def test_jax_cache_is_an_error(cp, jax):
    import jax.numpy as jnp

    with pytest.raises(PagedAttentionError, match=r"^value_cache: got a JAX array.*immutable"):
        arrays.device_arrays({"query": jnp.ones((4, 8)), "value_cache": jnp.zeros((2, 4, 1, 8))})


# -- streams ------------------------------------------------------------------------------------------

def test_resolve_stream_follows_torchs_current_stream(cp, torch):
    q = torch.ones(4, 8, device="cuda")
    default = arrays.resolve_stream(None, q)
    assert default.ptr == torch.cuda.current_stream().cuda_stream
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        got = arrays.resolve_stream(None, q)
        assert got.ptr == s.cuda_stream
        assert arrays.resolve_stream(None, q) is got, "the wrapper of a torch stream is cached by pointer"
    assert arrays.resolve_stream(s, q).ptr == s.cuda_stream
    assert arrays.resolve_stream(int(s.cuda_stream), q).ptr == s.cuda_stream


def test_resolve_stream_for_cupy_queries_and_explicit_streams(cp):
    q = cp.ones((4, 8), dtype=cp.float32)
    s = cp.cuda.Stream(non_blocking=True)
    assert arrays.resolve_stream(None, q) is cp.cuda.get_current_stream()
    with s:
        assert arrays.resolve_stream(None, q) is s
    assert arrays.resolve_stream(s, q) is s

    class Foreign:
        def __cuda_stream__(self):
            return (0, s.ptr)

    assert arrays.resolve_stream(Foreign(), q).ptr == s.ptr
    assert arrays.resolve_stream(0, q).ptr == 0
    with pytest.raises(PagedAttentionError, match="^stream: got"):
        arrays.resolve_stream("fast", q)
    with pytest.raises(PagedAttentionError, match="^stream: got"):
        arrays.resolve_stream(True, q)


def test_work_on_the_resolved_stream_is_ordered_after_torchs_pending_work(cp, torch):
    """A torch stream busy with a slow producer: reading its output on the resolved stream sees it."""
    x = torch.zeros(1 << 20, device="cuda")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda._sleep(50_000_000)  # ~tens of ms of GPU time before the producer writes
        x.fill_(3.0)
        stream = arrays.resolve_stream(None, x)
        dev, _ = arrays.device_arrays({"query": x}, stream)
        with stream:
            y = dev["query"] * 2
        out = arrays.wrap_output(y, x, stream)
    s.synchronize()
    assert float(out.min()) == 6.0 and float(out.max()) == 6.0


# -- outputs ------------------------------------------------------------------------------------------

def test_wrap_output_round_trips(cp, torch):
    q = torch.ones(4, 8, device="cuda", dtype=torch.bfloat16)
    c = cp.arange(32, dtype=cp.float32).reshape(4, 8)
    t = arrays.wrap_output(c, q, arrays.resolve_stream(None, q))
    assert isinstance(t, torch.Tensor) and t.data_ptr() == c.data.ptr and t.dtype == torch.float32
    assert arrays.wrap_output(c, cp.ones(1)) is c
    bf = arrays.to_cupy(q, "query")
    back = arrays.wrap_output(bf, q)
    assert back.dtype == torch.bfloat16 and back.data_ptr() == q.data_ptr()


def test_wrap_output_to_jax(cp, jax):
    import jax.numpy as jnp

    c = cp.arange(8, dtype=cp.float32)
    j = arrays.wrap_output(c, jnp.ones(2))
    np.testing.assert_array_equal(np.asarray(j), cp.asnumpy(c))


def test_check_out(cp, torch):
    q = torch.ones(4, 16, device="cuda", dtype=torch.float16)
    out = torch.empty(4, 16, device="cuda", dtype=torch.float16)
    view = arrays.check_out(out, (4, 16), "float16", q)
    assert view.data.ptr == out.data_ptr()
    assert arrays.check_out(None, (4, 16), "float16", q) is None
    with pytest.raises(PagedAttentionError, match=r"^out: got shape \(4, 16\); expected shape \(4, 8\)"):
        arrays.check_out(out, (4, 8), "float16", q)
    with pytest.raises(PagedAttentionError, match=r"^out: got dtype float16; expected dtype bfloat16"):
        arrays.check_out(out, (4, 16), "bfloat16", q)
    with pytest.raises(PagedAttentionError, match=r"^out: got a cupy array; expected a torch array"):
        arrays.check_out(cp.empty((4, 16), cp.float16), (4, 16), "float16", q)
    with pytest.raises(PagedAttentionError, match=r"^out: got a torch tensor on device 'cpu'"):
        arrays.check_out(torch.empty(4, 16, dtype=torch.float16), (4, 16), "float16", q)
    wide = torch.empty(4, 32, device="cuda", dtype=torch.float16)[:, :16]
    with pytest.raises(PagedAttentionError, match=r"^out: got a non-contiguous"):
        arrays.check_out(wide, (4, 16), "float16", q)


def test_empty_output_is_allocated_by_torch_and_returned(cp, torch):
    q = torch.ones(4, 16, device="cuda", dtype=torch.bfloat16)
    stream = arrays.resolve_stream(None, q)
    view = arrays.empty_output((4, 16), "bfloat16", q, 0)
    assert view.shape == (4, 16) and view.flags.c_contiguous and arrays.dtype_name(view) == "bfloat16"
    with stream:
        view.fill(2)
    t = arrays.wrap_output(view, q, stream)
    assert isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 and t.data_ptr() == view.data.ptr
    assert float(t.float().sum()) == 128.0
    empty = arrays.wrap_output(arrays.empty_output((0, 16), "float16", q, 0), q, stream)
    assert tuple(empty.shape) == (0, 16) and empty.dtype == torch.float16
    c = arrays.empty_output((3, 5), "float32", cp.ones(1), 0)
    assert isinstance(c, cp.ndarray) and c.dtype == cp.float32


def test_out_is_returned_as_given(cp, torch):
    q = torch.ones(4, 16, device="cuda", dtype=torch.float16)
    out = torch.empty(4, 16, device="cuda", dtype=torch.float16)
    stream = arrays.resolve_stream(None, q)
    assert arrays.wrap_output(arrays.check_out(out, (4, 16), "float16", q), q, stream) is out


def test_explicit_stream_waits_for_torch_and_torch_waits_for_it(cp, torch):
    """Inputs produced on torch's stream, the call on another stream, the result read by torch."""
    x = torch.zeros(1 << 20, device="cuda")
    torch.cuda._sleep(50_000_000)  # torch's current stream is busy, then writes x
    x.fill_(3.0)
    s = cp.cuda.Stream(non_blocking=True)
    stream = arrays.resolve_stream(s, x)
    assert stream is s
    dev, device = arrays.device_arrays({"query": x}, stream)
    out = arrays.empty_output(tuple(x.shape), "float32", x, device)
    with torch.cuda.stream(torch.cuda.ExternalStream(s.ptr)):
        torch.cuda._sleep(50_000_000)  # the call's stream is slow too: torch must wait for it
    with stream:
        cp.multiply(dev["query"], 2, out=out)
    result = arrays.wrap_output(out, x, stream)
    assert float(result.min()) == 6.0 and float(result.max()) == 6.0  # on torch's current stream


def test_per_call_overhead(cp, torch):
    """Report the Python cost of the interop steps of one call (8 torch inputs); bound it loosely."""
    names = ["query", "key", "value", "key_cache", "value_cache", "cumulative_sequence_length",
             "past_seqlens", "block_table"]
    inputs = {n: torch.ones(64, 128, device="cuda", dtype=torch.float16) for n in names}
    inputs["attention_metadata"] = [1, 64]
    out = torch.empty(64, 128, device="cuda", dtype=torch.float16)
    q = inputs["query"]

    def new_output():
        stream = arrays.resolve_stream(None, q)
        dev, device = arrays.device_arrays(inputs, stream)
        view = arrays.empty_output((64, 128), "float16", q, device)
        return arrays.wrap_output(view, q, stream)

    def given_output():
        stream = arrays.resolve_stream(None, q)
        dev, device = arrays.device_arrays(inputs, stream)
        view = arrays.check_out(out, (64, 128), "float16", q, device)
        return arrays.wrap_output(view, q, stream)

    def cost(fn, n=500):
        for _ in range(50):
            fn()
        start = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - start) / n * 1e6

    parts = {
        "resolve_stream": lambda: arrays.resolve_stream(None, q),
        "device_arrays (8 torch)": lambda: arrays.device_arrays(inputs),
        "empty_output": lambda: arrays.empty_output((64, 128), "float16", q, 0),
        "check_out": lambda: arrays.check_out(out, (64, 128), "float16", q, 0),
    }
    for label, fn in parts.items():
        print(f"\n  {label}: {cost(fn):.1f} us", end="")
    a, b = cost(new_output), cost(given_output)
    print(f"\ninterop per call, 8 torch inputs: {a:.1f} us (new output), {b:.1f} us (out=)")
    assert a < 300 and b < 300


# -- cupa.jit on the device ---------------------------------------------------------------------------

def test_get_kernel_compiles_memoizes_and_runs(cp, monkeypatch):
    monkeypatch.setattr(jit, "SOURCE_DIR", DATA)
    spec = jit.Specialization("jit_smoke", "smoke_scale<__half, 128>")
    k = jit.get_kernel(spec)
    assert jit.get_kernel(spec) is k
    x = cp.arange(1000, dtype=cp.float16)
    y = cp.empty(1000, dtype=cp.float32)
    k((8,), (128,), (x, y, np.int32(1000), np.float32(0.5)))
    cp.testing.assert_allclose(y, x.astype(cp.float32) * 0.5)


def test_get_kernel_raises_kernel_compile_error(cp, monkeypatch, tmp_path):
    (tmp_path / "bad.cu").write_text("template <int N> __global__ void bad(float* p) { p[0] = N + nope; }\n")
    monkeypatch.setattr(jit, "SOURCE_DIR", tmp_path)
    with pytest.raises(jit.KernelCompileError) as info:
        jit.get_kernel(jit.Specialization("bad", "bad<2>"))
    assert info.value.name_expression == "bad<2>" and "nope" in info.value.log


def test_offline_cubin_loads_and_runs(cp):
    arch = f"sm_{cp.cuda.Device().compute_capability}"
    r = jit.compile_offline(jit.Specialization("jit_smoke", "smoke_scale<float, 64>"), arch, keep_cubin=True,
                            source_dir=DATA)
    assert r.ok, r.log
    k = jit.load_cubin(r.cubin, r.lowered_name)
    x = cp.arange(100, dtype=cp.float32)
    y = cp.empty(100, dtype=cp.float32)
    k((2,), (64,), (x, y, np.int32(100), np.float32(2.0)))
    cp.testing.assert_allclose(y, x * 2)
