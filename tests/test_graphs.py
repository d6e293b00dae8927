"""cupa.graphs without a GPU: import, clear errors, the keep-alive hook and the jit capture guard.

The device side (capture, replay, error recovery) is tests/gpu/test_graphs.py.
"""

import sys
import types

import pytest

import cupa
from cupa import _capture, graphs, jit


@pytest.fixture
def no_scope():
    """Leave the thread-local capture state as it was, whatever a test does to it."""
    before = (_capture.active_scope(), _capture.ACTIVE[0])
    yield
    _capture._local.scope, _capture.ACTIVE[0] = before


def test_import_without_gpu_and_lazy_export():
    assert cupa.capture_graph is graphs.capture_graph
    assert issubclass(graphs.GraphCaptureError, RuntimeError)
    assert "capture_graph" in cupa.__all__
    assert not graphs.capture_active()


def test_capture_graph_argument_checks():
    with pytest.raises(TypeError, match="step"):
        graphs.capture_graph(42)
    for bad in (-1, 1.5, True, "1"):
        with pytest.raises(ValueError, match="warmup"):
            graphs.capture_graph(lambda: None, warmup=bad)


def test_capture_graph_without_a_device_is_a_clear_error(monkeypatch):
    cupy = pytest.importorskip("cupy")
    monkeypatch.setattr(cupy.cuda, "is_available", lambda: False)
    with pytest.raises(graphs.GraphCaptureError, match="usable CUDA device"):
        graphs.capture_graph(lambda: None)
    with pytest.raises(graphs.GraphCaptureError, match="usable CUDA device"):
        with graphs.capture_scope():
            pass
    assert not graphs.capture_active()


def test_capture_graph_without_cupy_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # `import cupy` raises ImportError
    with pytest.raises(graphs.GraphCaptureError, match="CuPy is not installed"):
        graphs.capture_graph(lambda: None)


def test_keep_alive_is_a_noop_outside_capture(no_scope):
    assert _capture.ACTIVE[0] == 0 and not graphs.capture_active()
    obj = object()
    graphs.keep_alive(obj, None)
    graphs.keep_alive()
    assert not graphs.capture_active()


def test_keep_alive_registers_inside_an_active_scope(no_scope):
    scope = graphs.CaptureScope()
    _capture._local.scope, _capture.ACTIVE[0] = scope, 1   # what CaptureScope.__enter__ sets on this thread
    a, b = object(), object()
    graphs.keep_alive(a, None, b)
    assert scope.kept == [a, b]
    assert graphs.capture_active()


def test_keep_alive_ignores_scopes_of_other_threads(no_scope):
    import threading

    scope = graphs.CaptureScope()
    _capture._local.scope, _capture.ACTIVE[0] = scope, 1
    seen = []

    def other():
        graphs.keep_alive(object())
        seen.append(graphs.capture_active())

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert seen == [False] and scope.kept == []


class _FakeCupy:
    """Enough of CuPy for jit.get_kernel to reach its compile path without a device."""

    def __init__(self):
        self.compiled = []
        fake = self

        class RawModule:
            def __init__(self, **kwargs):
                fake.compiled.append(kwargs)

            def get_function(self, name):
                return ("kernel", name)

        self.RawModule = RawModule
        self.cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(getDevice=lambda: 0))


def test_jit_refuses_to_compile_inside_a_capture(monkeypatch, no_scope):
    fake = _FakeCupy()
    monkeypatch.setattr(jit, "_cupy_module", lambda: fake)
    spec = jit.Specialization("decode", "paged_decode<float, CacheSame<float>, 1>", options=("-DCUPA_TEST_GRAPH_GUARD=1",))
    monkeypatch.delitem(jit._modules, (spec, 0), raising=False)
    _capture._local.scope, _capture.ACTIVE[0] = graphs.CaptureScope(), 1
    with pytest.raises(graphs.GraphCaptureError, match="warm") as info:
        jit.get_kernel(spec)
    assert "paged_decode<float, CacheSame<float>, 1>" in str(info.value)
    assert fake.compiled == [], "the guard must refuse before NVRTC runs"
    assert (spec, 0) not in jit._modules
    # Outside a capture the same call compiles (through the fake) and memoizes.
    _capture._local.scope, _capture.ACTIVE[0] = None, 0
    try:
        assert jit.get_kernel(spec) == ("kernel", "paged_decode<float, CacheSame<float>, 1>")
        assert len(fake.compiled) == 1
        # A memoized kernel is free inside a capture: no guard on the hit path.
        _capture._local.scope, _capture.ACTIVE[0] = graphs.CaptureScope(), 1
        assert jit.get_kernel(spec) == ("kernel", "paged_decode<float, CacheSame<float>, 1>")
    finally:
        jit._modules.pop((spec, 0), None)


def test_check_compile_allowed_outside_capture_without_device(no_scope):
    graphs.check_compile_allowed("anything")   # no scope; CuPy's stream query fails without a driver: no error


def test_capture_error_classification():
    class CudaErr(RuntimeError):
        def __init__(self, status):
            super().__init__(f"status {status}")
            self.status = status

    assert graphs._is_capture_error(CudaErr(900))       # cudaErrorStreamCaptureUnsupported
    assert graphs._is_capture_error(CudaErr(901))       # cudaErrorStreamCaptureInvalidated
    assert not graphs._is_capture_error(CudaErr(2))     # cudaErrorMemoryAllocation
    assert graphs._is_capture_error(RuntimeError("CUDA error: operation not permitted when stream is capturing"))
    assert not graphs._is_capture_error(cupa.PagedAttentionError("query: got shape (3,); expected (N, H*D)"))
    assert not graphs._is_capture_error(ValueError("bad"))


def test_pool_choices_without_device():
    cupy = pytest.importorskip("cupy")
    pool = graphs._resolve_pool(cupy, "private")
    assert isinstance(pool, cupy.cuda.MemoryPool)
    mine = cupy.cuda.MemoryPool()
    assert graphs._resolve_pool(cupy, mine) is mine
    with cupy.cuda.using_allocator(mine.malloc):
        assert graphs._resolve_pool(cupy, "current") is None      # a MemoryPool: allowed
    with cupy.cuda.using_allocator(None):                          # the raw cudaMalloc allocator
        with pytest.raises(graphs.GraphCaptureError, match="not a cupy.cuda.MemoryPool"):
            graphs._resolve_pool(cupy, "current")
    with pytest.raises(TypeError, match="pool"):
        graphs._resolve_pool(cupy, "shared")


def test_pool_current_rejects_memory_async_pool(monkeypatch):
    cupy = pytest.importorskip("cupy")

    class FakeAsyncPool:
        def malloc(self, size):
            raise AssertionError("not called")

    monkeypatch.setattr(cupy.cuda, "MemoryAsyncPool", FakeAsyncPool)
    with cupy.cuda.using_allocator(FakeAsyncPool().malloc):
        with pytest.raises(graphs.GraphCaptureError, match="MemoryAsyncPool"):
            graphs._resolve_pool(cupy, "current")
    with pytest.raises(graphs.GraphCaptureError, match="MemoryAsyncPool"):
        graphs._resolve_pool(cupy, FakeAsyncPool())


def test_captured_graph_close_and_replay_after_close():
    class FakeGraph:
        launched = 0

        def launch(self, stream=None):
            FakeGraph.launched += 1

    class FakeStream:
        ptr = 0x1234
        synced = 0

        def synchronize(self):
            FakeStream.synced += 1

    scope = graphs.CaptureScope()
    scope.kept.append("buffer")
    g = graphs.CapturedGraph(FakeGraph(), FakeStream(), outputs=("out",), scope=scope, torch=None, device_id=0)
    assert not g.closed and g.outputs == ("out",) and g.kept == ["buffer"]
    assert "CapturedGraph(" in repr(g)
    with g:
        pass
    assert g.closed and g.outputs is None and g.kept == []
    assert repr(g) == "CapturedGraph(closed)"
    g.close()   # idempotent
    with pytest.raises(graphs.GraphCaptureError, match="closed"):
        g.replay()
    assert FakeGraph.launched == 0
