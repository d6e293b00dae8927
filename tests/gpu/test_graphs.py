"""cupa.capture_graph on the device: a captured decode step replayed while every sequence grows.

Every replay is compared bit for bit with an eager call on an identical copy of the state (same
kernels, same launches: same bits) and with the NumPy reference (contract §6 tolerance). Inputs are
updated in place between replays -- past_seqlens += 1, the new token's q/k/v written into fixed
buffers, a new block appended to a block_table row when a sequence crosses a block boundary -- which
is how a server drives a captured step.
"""

import math

import numpy as np
import pytest

import cupa
from cupa import graphs, jit
from tests import util

pytestmark = pytest.mark.gpu

H, HK = 8, 2


@pytest.fixture
def torch(torch_cuda):
    return torch_cuda


# -- a growing decode batch -------------------------------------------------------------------------

class Growth:
    """The host plan of a decode batch that grows by one token per sequence and step.

    Shared by every copy of the state (graph, eager, reference), so all copies see the same tokens,
    the same block assignments and the same garbage in unassigned blocks.
    """

    def __init__(self, rng, *, past0, steps, D=128, block_size=16, dtype="float16", max_blocks=None, spare=3):
        T = util.T_DTYPES[dtype]
        self.dtype, self.D, self.block_size, self.steps = dtype, D, block_size, steps
        self.B = B = len(past0)
        self.past0 = np.asarray(past0, dtype=np.int32)
        final = [p + steps for p in past0]          # kv length at the last step
        self.max_len = max(final)
        need = [math.ceil(f / block_size) for f in final]
        self.max_blocks = max_blocks or max(need)
        assert self.max_blocks >= max(need)
        self.num_blocks = sum(need) + spare
        free = [int(x) for x in rng.permutation(self.num_blocks)]
        bt = np.full((B, self.max_blocks), -1, dtype=np.int32)
        for b, p in enumerate(past0):
            for j in range(math.ceil(p / block_size)):
                bt[b, j] = free.pop()
        self.bt0 = bt
        self.assign = []                            # per step: [(b, logical block, physical block)]
        past = list(past0)
        for _ in range(steps):
            adds = []
            for b in range(B):
                if past[b] % block_size == 0:       # the new token opens a block
                    adds.append((b, past[b] // block_size, free.pop()))
                past[b] += 1
            self.assign.append(adds)
        cshape = (self.num_blocks, block_size, HK, D)
        self.kc0 = rng.standard_normal(cshape).astype(T)   # unassigned blocks hold garbage never read
        self.vc0 = rng.standard_normal(cshape).astype(T)
        self.q = rng.standard_normal((steps, B, H * D)).astype(T)
        self.k = rng.standard_normal((steps, B, HK * D)).astype(T)
        self.v = rng.standard_normal((steps, B, HK * D)).astype(T)
        self.cum = np.arange(B + 1, dtype=np.int32)


class HostState:
    """The NumPy copy: runs the reference (which writes its own caches) one step at a time."""

    def __init__(self, gr: Growth):
        self.gr = gr
        self.kc, self.vc = gr.kc0.copy(), gr.vc0.copy()
        self.past, self.bt = gr.past0.copy(), gr.bt0.copy()

    def reference(self, s):
        gr = self.gr
        for b, j, blk in gr.assign[s]:
            self.bt[b, j] = blk
        out = cupa.paged_attention(gr.q[s], gr.k[s], gr.v[s], self.kc, self.vc, gr.cum, self.past, self.bt,
                                   num_heads=H, kv_num_heads=HK)
        self.past += 1
        return out


class DeviceState:
    """Fixed CuPy buffers, updated in place with CuPy operations on the current stream."""

    def __init__(self, cp, gr: Growth):
        self.gr = gr
        self.q = cp.asarray(gr.q[0])
        self.k = cp.asarray(gr.k[0])
        self.v = cp.asarray(gr.v[0])
        self.kc, self.vc = cp.asarray(gr.kc0), cp.asarray(gr.vc0)
        self.cum, self.past, self.bt = cp.asarray(gr.cum), cp.asarray(gr.past0), cp.asarray(gr.bt0)
        self.ptrs = self._ptrs()

    def _ptrs(self):
        return [a.data.ptr for a in self.inputs()]

    def inputs(self):
        return (self.q, self.k, self.v, self.kc, self.vc, self.cum, self.past, self.bt)

    def prepare(self, s):
        """Step s's new token into the fixed buffers; a new block where a sequence crosses a boundary."""
        gr = self.gr
        for b, j, blk in gr.assign[s]:
            self.bt[b, j] = blk                      # idempotent: prepare(s) may run twice
        self.q.set(gr.q[s])
        self.k.set(gr.k[s])
        self.v.set(gr.v[s])

    def advance(self):
        self.past += 1                               # in place: the graph reads this buffer
        assert self._ptrs() == self.ptrs, "an input buffer moved"


def bits(a):
    return np.ascontiguousarray(a).view(np.uint8)


def same_bits(a, b) -> bool:
    return np.array_equal(bits(a), bits(b))


def check_reference(got, ref, dtype):
    err = util.rel_err(got, ref)
    assert err < util.TOLERANCE[dtype], f"relative error {err:.3g} >= {util.TOLERANCE[dtype]}"


# -- 1. replay follows growing sequences ------------------------------------------------------------

@pytest.mark.parametrize("dtype,D,steps", [("float16", 128, 64), ("float32", 64, 64),
                                           pytest.param("float16", 128, 256, marks=pytest.mark.slow),
                                           pytest.param("bfloat16", 64, 256, marks=pytest.mark.slow)])
def test_replay_follows_growing_sequences(cp, rng, dtype, D, steps):
    # lengths 0..250+steps: sequence 0 starts empty, 1 crosses a boundary at step 1, every sequence
    # crosses several; the table is sized for the maximum length.
    gr = Growth(rng, past0=[0, 15, 97, 250], steps=steps, D=D, dtype=dtype)
    md = [1, gr.max_len]                                     # replay-wide bound
    op = cupa.PagedAttention(num_heads=H, kv_num_heads=HK)
    graph_state, eager_state, host = DeviceState(cp, gr), DeviceState(cp, gr), HostState(gr)
    graph_state.prepare(0)
    g = cupa.capture_graph(lambda: op(*graph_state.inputs(), attention_metadata=md))
    out_g = g.outputs
    assert isinstance(out_g, cp.ndarray) and out_g.shape == (gr.B, H * D)
    assert g.kept, "the backends registered no buffer with the capture"
    assert any(k is out_g for k in g.kept)
    with g.stream:                                           # updates, replays and eager calls in order
        for s in range(gr.steps):
            graph_state.prepare(s)
            eager_state.prepare(s)
            g.replay()
            out_e = op(*eager_state.inputs(), attention_metadata=md)
            ref = host.reference(s)
            got_g, got_e = cp.asnumpy(out_g), cp.asnumpy(out_e)
            assert same_bits(got_g, got_e), f"step {s}: replay and eager call differ"
            check_reference(got_g, ref, dtype)
            graph_state.advance()
            eager_state.advance()
        g.stream.synchronize()
    np.testing.assert_array_equal(cp.asnumpy(graph_state.past), gr.past0 + gr.steps)
    for name in ("kc", "vc"):
        got = cp.asnumpy(getattr(graph_state, name))
        assert same_bits(got, cp.asnumpy(getattr(eager_state, name))), f"{name}: graph and eager caches differ"
        util.assert_cache_close(got, getattr(host, name), steps=1, what=name, fp32_rows=True)
    g.close()
    assert g.closed


# -- 2. absent, tight and loose bounds: identical graphs ---------------------------------------------

def test_bounds_absent_tight_loose_give_identical_replays(cp, rng):
    # capacity 1024 >> lengths (<= 349): the three bounds launch different numbers of splits.
    gr = Growth(rng, past0=[5, 40, 200, 301], steps=48, max_blocks=64)
    bounds = {"absent": None, "tight": [1, gr.max_len], "loose": [4, 10**6]}
    op = cupa.PagedAttention(num_heads=H, kv_num_heads=HK)
    states, captured = {}, {}
    for name, md in bounds.items():
        st = states[name] = DeviceState(cp, gr)
        st.prepare(0)
        captured[name] = cupa.capture_graph(lambda st=st, md=md: op(*st.inputs(), attention_metadata=md))
    host = HostState(gr)
    # Driven from CuPy's current (default) stream: replay() orders itself after and before it.
    for s in range(gr.steps):
        for st in states.values():
            st.prepare(s)
        for g in captured.values():
            g.replay()
        outs = {name: cp.asnumpy(g.outputs) for name, g in captured.items()}
        ref = host.reference(s)
        for name in ("tight", "loose"):
            assert same_bits(outs[name], outs["absent"]), f"step {s}: bound {name} changed the bits"
        if s % 8 == 0 or s == gr.steps - 1:
            check_reference(outs["absent"], ref, "float16")
        for st in states.values():
            st.advance()
    for g in captured.values():
        g.close()


# -- 3. an undersized bound stays memory-safe ----------------------------------------------------------

@pytest.mark.slow
def test_undersized_bound_is_memory_safe(cp, rng):
    """A bound below the lengths breaks the contract (work is omitted) but never memory safety.

    compute-sanitizer checks the same thing at the byte level: benchmarks/sanitize_undersized_bound.py.
    """
    gr = Growth(rng, past0=[200, 300, 500, 700], steps=16, max_blocks=64)
    md = [1, 64]                                            # lengths reach 716
    op = cupa.PagedAttention(num_heads=H, kv_num_heads=HK)
    graph_state, eager_state, host = DeviceState(cp, gr), DeviceState(cp, gr), HostState(gr)
    graph_state.prepare(0)
    g = cupa.capture_graph(lambda: op(*graph_state.inputs(), attention_metadata=md))
    with g.stream:
        for s in range(gr.steps):
            graph_state.prepare(s)
            eager_state.prepare(s)
            g.replay()
            out_e = op(*eager_state.inputs(), attention_metadata=md)
            host.reference(s)                                # the writes do not depend on the bound
            assert same_bits(cp.asnumpy(g.outputs), cp.asnumpy(out_e)), f"step {s}: not deterministic"
            graph_state.advance()
            eager_state.advance()
    cp.cuda.runtime.deviceSynchronize()                     # a fault would surface here
    for name in ("kc", "vc"):                               # nothing but the new tokens was written
        util.assert_cache_close(cp.asnumpy(getattr(graph_state, name)), getattr(host, name), steps=1, what=name,
                                fp32_rows=True)
    g.close()


# -- many layers, and what keeps their buffers alive -----------------------------------------------------

@pytest.mark.parametrize("pool", ["private", "current"])
def test_layers_and_buffers_survive_allocation_churn(cp, rng, pool):
    """Four layers (separate caches) in one step; after capture the pool is churned with arrays of the
    sizes cupa's outputs and workspaces have. Were a captured buffer freed, a churn array would get
    its memory and every replay would overwrite it."""
    layers = 4
    grs = [Growth(rng, past0=[31, 64, 300, 511], steps=6, max_blocks=40) for _ in range(layers)]
    op = cupa.PagedAttention(num_heads=H, kv_num_heads=HK)
    graph_states = [DeviceState(cp, gr) for gr in grs]
    eager_states = [DeviceState(cp, gr) for gr in grs]
    md = [1, 640]
    for st in graph_states:
        st.prepare(0)
    g = cupa.capture_graph(lambda: [op(*st.inputs(), attention_metadata=md) for st in graph_states], pool=pool)
    if pool == "private":
        assert g.pool is not None and g.nbytes > 0
    else:
        assert g.pool is None
    sizes = sorted({k.nbytes for k in g.kept})
    with g.stream:
        # CuPy's pool reuses a freed block only on the stream it was allocated on: churn on that one.
        churn = [cp.full(n, 7, dtype=cp.uint8) for n in sizes for _ in range(2 * layers)]
        for s in range(grs[0].steps):
            for gs, es in zip(graph_states, eager_states):
                gs.prepare(s)
                es.prepare(s)
            g.replay()
            eager = [op(*st.inputs(), attention_metadata=md) for st in eager_states]
            for layer, (a, b) in enumerate(zip(g.outputs, eager)):
                assert same_bits(cp.asnumpy(a), cp.asnumpy(b)), f"step {s} layer {layer} differs"
            for st in graph_states + eager_states:
                st.advance()
    for c in churn:
        assert int((c != 7).sum()) == 0, "a replay wrote into memory handed to another array"
    g.close()


# -- 4. PyTorch tensors and streams ---------------------------------------------------------------------

class TorchState:
    """Fixed torch buffers, updated in place with torch operations on torch's current stream."""

    def __init__(self, torch, gr: Growth):
        self.torch, self.gr = torch, gr

        def t(x):
            return torch.from_numpy(np.ascontiguousarray(x)).to("cuda")

        self.q, self.k, self.v = t(gr.q[0]), t(gr.k[0]), t(gr.v[0])
        self.kc, self.vc = t(gr.kc0), t(gr.vc0)
        self.cum, self.past, self.bt = t(gr.cum), t(gr.past0), t(gr.bt0)

    def inputs(self):
        return (self.q, self.k, self.v, self.kc, self.vc, self.cum, self.past, self.bt)

    def prepare(self, s):
        gr, torch = self.gr, self.torch
        for b, j, blk in gr.assign[s]:
            self.bt[b, j] = blk
        self.q.copy_(torch.from_numpy(gr.q[s]))
        self.k.copy_(torch.from_numpy(gr.k[s]))
        self.v.copy_(torch.from_numpy(gr.v[s]))

    def advance(self):
        self.past += 1


def _torch_bits(torch, x):
    return x.contiguous().view(torch.uint8)


@pytest.mark.parametrize("own_stream,steps", [(False, 24), (True, 24),
                                              pytest.param(False, 256, marks=pytest.mark.slow),
                                              pytest.param(True, 256, marks=pytest.mark.slow)])
def test_capture_with_torch_tensors_and_streams(cp, torch, rng, own_stream, steps):
    gr = Growth(rng, past0=[3, 16, 70, 129], steps=steps)
    md = [1, gr.max_len]
    op = cupa.PagedAttention(num_heads=H, kv_num_heads=HK)
    graph_state, eager_state, host = TorchState(torch, gr), TorchState(torch, gr), HostState(gr)
    graph_state.prepare(0)

    def step():
        o = op(*graph_state.inputs(), attention_metadata=md)   # stream=None: PyTorch's current stream
        return o, o.float() * 0.5                             # torch work captured with it

    side = torch.cuda.Stream() if own_stream else None
    g = cupa.capture_graph(step, stream=side)
    if side is not None:
        assert g.stream.ptr == side.cuda_stream
    o, half = g.outputs
    assert isinstance(o, torch.Tensor) and o.is_cuda and o.dtype == torch.float16
    for s in range(gr.steps):
        graph_state.prepare(s)
        eager_state.prepare(s)
        if s % 2:
            g.replay()                                         # ordered with torch's current stream by events
        else:
            g.replay(torch.cuda.current_stream())              # or launched on it
        oe = op(*eager_state.inputs(), attention_metadata=md)
        ref = host.reference(s)
        torch.cuda.current_stream().synchronize()
        assert torch.equal(_torch_bits(torch, o), _torch_bits(torch, oe)), f"step {s}: replay and eager differ"
        assert torch.equal(half, o.float() * 0.5), f"step {s}: the captured torch op did not replay"
        check_reference(o.cpu().numpy(), ref, "float16")
        graph_state.advance()
        eager_state.advance()
    g.close()


def test_torch_cuda_graph_with_capture_scope(cp, torch, rng):
    """PyTorch drives the capture (torch.cuda.graph); capture_scope keeps cupa's buffers and refuses compiles."""
    gr = Growth(rng, past0=[3, 16, 70, 129], steps=12)
    md = [1, gr.max_len]
    op = cupa.PagedAttention(num_heads=H, kv_num_heads=HK)
    graph_state, eager_state, host = TorchState(torch, gr), TorchState(torch, gr), HostState(gr)
    graph_state.prepare(0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        op(*graph_state.inputs(), attention_metadata=md)      # warm-up: compiles every kernel
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    tg = torch.cuda.CUDAGraph()
    with graphs.capture_scope() as scope, torch.cuda.graph(tg, capture_error_mode="relaxed"):
        o = op(*graph_state.inputs(), attention_metadata=md)
    assert scope.kept and not graphs.capture_active()
    for s in range(gr.steps):
        graph_state.prepare(s)
        eager_state.prepare(s)
        tg.replay()
        oe = op(*eager_state.inputs(), attention_metadata=md)
        ref = host.reference(s)
        torch.cuda.synchronize()
        assert torch.equal(_torch_bits(torch, o), _torch_bits(torch, oe)), f"step {s}: replay and eager differ"
        check_reference(o.cpu().numpy(), ref, "float16")
        graph_state.advance()
        eager_state.advance()
    del tg, scope


# -- 5. errors: clear, and the stream stays usable ------------------------------------------------------

def _small(cp, rng):
    gr = Growth(rng, past0=[10, 20], steps=4)
    st = DeviceState(cp, gr)
    st.prepare(0)
    op = cupa.PagedAttention(num_heads=H, kv_num_heads=HK)
    return gr, st, op


def _stream_still_works(cp, stream):
    assert not stream.is_capturing()
    assert not graphs.capture_active()
    with stream:
        x = cp.arange(10, dtype=cp.int32)
        assert int(x.sum()) == 45
    stream.synchronize()


def test_memory_async_pool(cp, rng):
    gr, st, op = _small(cp, rng)
    eager_state = DeviceState(cp, gr)
    md = [1, gr.max_len]
    async_pool = cp.cuda.MemoryAsyncPool()
    with cp.cuda.using_allocator(async_pool.malloc):
        with pytest.raises(graphs.GraphCaptureError, match="MemoryAsyncPool"):
            cupa.capture_graph(lambda: op(*st.inputs(), attention_metadata=md), pool="current")
        assert not graphs.capture_active()
        # The default private pool makes the async allocator harmless: several replays stay right.
        g = cupa.capture_graph(lambda: op(*st.inputs(), attention_metadata=md))
        assert cp.cuda.get_allocator().__self__ is async_pool   # restored after the capture
        with g.stream:
            for s in range(gr.steps):
                st.prepare(s)
                eager_state.prepare(s)
                g.replay()
                out_e = op(*eager_state.inputs(), attention_metadata=md)
                assert same_bits(cp.asnumpy(g.outputs), cp.asnumpy(out_e)), f"replay {s} differs"
                st.advance()
                eager_state.advance()
        g.close()


@pytest.mark.parametrize("sync", ["item", "asnumpy", "synchronize"])
def test_host_sync_inside_step_is_a_clear_error(cp, rng, sync):
    gr, st, op = _small(cp, rng)
    md = [1, gr.max_len]
    stream = cp.cuda.Stream(non_blocking=True)
    allocator = cp.cuda.get_allocator()

    def step():
        out = op(*st.inputs(), attention_metadata=md)
        if sync == "item":
            out[0, 0].item()
        elif sync == "asnumpy":
            cp.asnumpy(out)
        else:
            cp.cuda.get_current_stream().synchronize()
        return out

    with pytest.raises(graphs.GraphCaptureError, match="synchroniz"):
        cupa.capture_graph(step, stream=stream)
    _stream_still_works(cp, stream)
    assert cp.cuda.get_allocator() == allocator
    graphs.keep_alive(object())                              # a no-op again
    # The same stream captures a correct step afterwards.
    g = cupa.capture_graph(lambda: op(*st.inputs(), attention_metadata=md), stream=stream)
    with g.stream:
        g.replay()
        expect = op(*DeviceState(cp, gr).inputs(), attention_metadata=md)
        assert same_bits(cp.asnumpy(g.outputs), cp.asnumpy(expect))
    g.close()


def test_compile_inside_capture_is_refused(cp, rng):
    gr, st, op = _small(cp, rng)
    md = [1, gr.max_len]
    op(*st.inputs(), attention_metadata=md)                  # compiled and memoized
    stream = cp.cuda.Stream(non_blocking=True)
    fresh_op = cupa.PagedAttention(num_heads=H, kv_num_heads=HK)   # nothing memoized for this op either
    saved = dict(jit._modules)
    jit._modules.clear()                                     # as if nothing had been compiled yet
    try:
        with pytest.raises(graphs.GraphCaptureError, match="warm"):
            cupa.capture_graph(lambda: fresh_op(*st.inputs(), attention_metadata=md), stream=stream, warmup=0)
    finally:
        jit._modules.update(saved)
    _stream_still_works(cp, stream)
    # warmup=0 is fine once the kernels are compiled.
    g = cupa.capture_graph(lambda: op(*st.inputs(), attention_metadata=md), stream=stream, warmup=0)
    with g.stream:
        g.replay()
    g.stream.synchronize()
    g.close()


def test_jit_guard_sees_raw_captures_and_scopes(cp):
    fresh = jit.Specialization("decode", "paged_decode<float, CacheSame<float>, 1>", options=("-DCUPA_TEST_GRAPH_GUARD=2",))
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        try:
            with pytest.raises(graphs.GraphCaptureError, match="warm"):
                jit.get_kernel(fresh)
        finally:
            stream.end_capture()
    with graphs.capture_scope():
        with pytest.raises(graphs.GraphCaptureError, match="warm"):
            jit.get_kernel(fresh)
    assert (fresh, cp.cuda.runtime.getDevice()) not in jit._modules
    _stream_still_works(cp, stream)


def test_other_errors_pass_through_and_misuse_is_refused(cp, rng):
    gr, st, op = _small(cp, rng)
    md = [1, gr.max_len]
    stream = cp.cuda.Stream(non_blocking=True)
    bad_table = st.bt.astype(cp.int64)                                   # made before the capture
    with pytest.raises(cupa.PagedAttentionError, match="block_table"):   # raised at capture (warmup=0)
        cupa.capture_graph(lambda: op(*st.inputs()[:-1], bad_table, attention_metadata=md),
                           stream=stream, warmup=0)
    _stream_still_works(cp, stream)
    with pytest.raises(graphs.GraphCaptureError, match="legacy default stream"):
        cupa.capture_graph(lambda: None, stream=cp.cuda.Stream.null)
    with pytest.raises(graphs.GraphCaptureError, match="nested"):
        cupa.capture_graph(lambda: cupa.capture_graph(lambda: None, warmup=0), warmup=0)
    assert not graphs.capture_active()
    g = cupa.capture_graph(lambda: op(*st.inputs(), attention_metadata=md))
    g.close()
    with pytest.raises(graphs.GraphCaptureError, match="closed"):
        g.replay()
