"""Attention states on the device: the merge kernel, return_lse of every CUDA backend, key shards,
cascade attention, and CUDA-graph capture of steps that merge.

The merge-kernel tests need only CuPy and a GPU. The others need the CUDA backends to serve
return_lse (each backend's ``serves``); every run draws fresh random data and checks every element.
"""

import numpy as np
import pytest

import cupa
from cupa import dispatch, states
from cupa.kernels import launch
from tests import util
from tests.util import T_DTYPES, assert_within_ulp, rel_err, shard_block_tables, ulp

pytestmark = pytest.mark.gpu


def _states(rng, S, N=37, H=4, Dv=128, dtype="float16"):
    T = T_DTYPES[dtype]
    outs = [rng.standard_normal((N, H * Dv)).astype(T) for _ in range(S)]
    lses = [(rng.standard_normal((N, H)) * 6).astype(np.float32) for _ in range(S)]
    for s in range(S):
        empty = rng.random((N, H)) < 0.25
        lses[s][empty] = -np.inf
        rows = outs[s].reshape(N, H, Dv)
        rows[empty] = np.nan                      # an empty state's row is never read
    lses[0][0, :] = -np.inf
    for x in lses:
        x[0, :] = -np.inf                         # token 0: every state empty
    return outs, lses


# -- the merge kernel -----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("S", [1, 3, 16, 17, 40])
@pytest.mark.parametrize("stacked", [False, True])
@pytest.mark.parametrize("Dv", [128, 20])
@pytest.mark.parametrize("sink", [None, "T", "float32"])
def test_merge_kernel_matches_the_float64_merge(cp, rng, dtype, S, stacked, Dv, sink):
    outs, lses = _states(rng, S, Dv=Dv, dtype=dtype)
    N, H = lses[0].shape
    head_sink = None if sink is None else (rng.standard_normal(H) * 3).astype(
        T_DTYPES[dtype] if sink == "T" else np.float32)
    o64, lse64 = states.merge_host(np.stack(outs).reshape(S, N, H, Dv), np.stack(lses), head_sink)
    dev_outs = cp.asarray(np.stack(outs)) if stacked else [cp.asarray(o) for o in outs]
    dev_lses = cp.asarray(np.stack(lses)) if stacked else [cp.asarray(x) for x in lses]
    out = cp.full((N, H * Dv), np.nan, dtype=T_DTYPES[dtype])
    got, got_lse = cupa.merge_states(dev_outs, dev_lses, head_sink=None if head_sink is None else cp.asarray(head_sink),
                                     out=out)
    assert got is out and got_lse.dtype == np.float32
    host = cp.asnumpy(got)
    if dtype == "float32":
        assert rel_err(host, o64.reshape(N, -1)) < 1e-6
    else:
        # one rounding to T, plus the fp32 arithmetic of a sum whose terms may cancel (bounded by the same
        # merge of |outputs|): within 1 ulp of T wherever the terms do not cancel below T's precision
        magnitude, _ = states.merge_host(np.abs(np.stack(outs).astype(np.float64)).reshape(S, N, H, Dv),
                                         np.stack(lses), head_sink)
        ref = o64.reshape(N, -1)
        allowed = ulp(ref, dtype) + 16 * 2.0 ** -24 * magnitude.reshape(N, -1)
        bad = ~(np.abs(host.astype(np.float64) - ref) <= allowed)
        assert not bad.any(), (f"merged output: {int(bad.sum())} elements beyond 1 ulp + fp32 rounding; first at "
                               f"{np.argwhere(bad)[0].tolist()}")
    util.assert_lse_close(cp.asnumpy(got_lse), lse64, tol=1e-5)
    again = cupa.merge_states(dev_outs, dev_lses, head_sink=None if head_sink is None else cp.asarray(head_sink))
    assert np.array_equal(cp.asnumpy(again[0]).view(np.uint8), host.view(np.uint8)), "not deterministic"


def test_merge_kernel_in_place(cp, rng):
    outs, lses = _states(rng, 4)
    d_outs, d_lses = [cp.asarray(o) for o in outs], [cp.asarray(x) for x in lses]
    want, want_lse = (cp.asnumpy(a) for a in cupa.merge_states(d_outs, d_lses))
    got, got_lse = cupa.merge_states(d_outs, d_lses, out=d_outs[0], out_lse=d_lses[0])
    assert got is d_outs[0] and got_lse is d_lses[0]
    assert np.array_equal(cp.asnumpy(got).view(np.uint8), want.view(np.uint8))
    assert np.array_equal(cp.asnumpy(got_lse), want_lse)


def test_merge_torch_cuda_tensors_on_a_side_stream(cp, torch_cuda, rng):
    torch = torch_cuda
    outs, lses = _states(rng, 3, dtype="bfloat16")
    want = cupa.merge_states([cp.asarray(o) for o in outs], [cp.asarray(x) for x in lses])
    t_outs = [torch.from_numpy(o.view(np.int16)).view(torch.bfloat16).cuda() for o in outs]
    t_lses = [torch.from_numpy(x).cuda() for x in lses]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got, got_lse = cupa.merge_states(t_outs, t_lses)
    torch.cuda.current_stream().wait_stream(side)
    assert isinstance(got, torch.Tensor) and got.dtype == torch.bfloat16 and got.is_cuda
    assert np.array_equal(got.view(torch.int16).cpu().numpy(), cp.asnumpy(want[0]).view(np.int16))
    assert np.array_equal(got_lse.cpu().numpy(), cp.asnumpy(want[1]))


def test_merge_is_capturable(cp, rng):
    outs, lses = _states(rng, 5)
    d_outs, d_lses = [cp.asarray(o) for o in outs], [cp.asarray(x) for x in lses]
    out, out_lse = cp.empty_like(d_outs[0]), cp.empty_like(d_lses[0])
    with cupa.capture_graph(lambda: cupa.merge_states(d_outs, d_lses, out=out, out_lse=out_lse)) as g:
        new_outs, new_lses = _states(rng, 5)
        with g.stream:
            for d, h in zip(d_outs + d_lses, new_outs + new_lses):
                d.set(h)
            g.replay()
            g.stream.synchronize()
        want = cupa.merge_states(new_outs, new_lses)
        assert rel_err(cp.asnumpy(out), want[0]) < 2e-3
        util.assert_lse_close(cp.asnumpy(out_lse), want[1], tol=1e-5)


# -- return_lse on every CUDA backend (needs the backends to serve it) ---------------------------------

LSE_CASES = {
    "decode_fp16": dict(B=5, H=8, Hk=2, D=128, sink=True),
    "decode_fp32_cuda_cores": dict(B=4, H=8, Hk=2, D=64, dtype="float32", softcap=20.0),
    "decode_int8_window": dict(B=3, H=16, Hk=2, D=128, cache="int8", window=200, past=[900, 40, 2500]),
    "decode_long_splits": dict(B=2, H=8, Hk=1, D=128, past=[6000, 17], sink=True),
    "prefill_fp16": dict(q_lens=[40, 0, 70], past=[0, 9, 130], H=8, Hk=2, D=128, sink=True),
    "prefill_bf16_d64": dict(q_lens=[33, 64], past=[100, 0], H=8, Hk=4, D=64, dtype="bfloat16", window=50),
    "prefill_fp8": dict(q_lens=[50, 20], past=[10, 300], H=8, Hk=2, D=128, cache="fp8"),
}


def _lse_reference(inputs, attrs):
    ref_in = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in inputs.items()}
    return cupa.paged_attention(**ref_in, **util.host_attrs(attrs), return_lse=True)


@pytest.mark.parametrize("case", sorted(LSE_CASES))
@pytest.mark.parametrize("backend", dispatch.CUDA_BACKENDS)
def test_return_lse_on_every_backend(cp, rng, case, backend):
    inputs, attrs = util.build(rng, **LSE_CASES[case])
    attrs = util.with_options(attrs, backend=backend)
    dev = util.to_device(cp, inputs)
    op = cupa.PagedAttention(**attrs, return_lse=True)
    problem = op._problem(op._bind((), dev))
    device = dispatch.device_info(dev["query"].data.device_id)
    served = next(b for b in dispatch.cuda_backends() if b.name == backend)
    if served.not_supported_reasons(problem, device, cupa.Options(backend=backend)):
        pytest.skip(f"{backend} does not serve {case}")
    want_out, _ = _lse_reference(inputs, attrs)  # (the lse is checked over the caches as written)
    out, lse = op(**dev)
    host = cp.asnumpy(out)
    assert util.rel_err(host, want_out) < util.TOLERANCE[problem.dtype]
    written = util.reference_over_written_caches(inputs, dict(util.host_attrs(attrs), return_lse=True),
                                                 cp.asnumpy(dev["key_cache"]), cp.asnumpy(dev["value_cache"]))[1]
    # A per-channel K scale is folded into Q, rounded to T (cuda_src/prefill.cu and decode_mma.cu; the
    # general backend's lse agrees with theirs): each product of a score carries T's rounding (2^-11
    # relative for fp16, as the output's 2e-3 of contract §6 does), so a score, and the lse it
    # dominates, moves by up to about 1e-3 of its size.
    per_channel = problem.quantized and problem.k_quant == "PER_CHANNEL"
    util.assert_lse_close(cp.asnumpy(lse), written, tol=1e-3 if per_channel else 1e-4)
    again_out, again_lse = cupa.PagedAttention(**attrs, return_lse=True)(**util.to_device(cp, inputs))
    assert np.array_equal(cp.asnumpy(again_lse), cp.asnumpy(lse)), "lse not deterministic"


@pytest.mark.parametrize("backend", dispatch.CUDA_BACKENDS)
def test_return_lse_of_invalid_and_unowned_tokens(cp, rng, backend):
    """Tokens of an invalid sequence, and tokens no sequence owns (the prefill zero pass), get -inf."""
    inputs, attrs = util.build(rng, q_lens=[40, 9, 30], past=[5, 3, 0], H=8, Hk=2, D=128, sink=True)
    inputs["past_seqlens"][1] = -1
    inputs["cumulative_sequence_length"][-1] -= 7
    attrs = util.with_options(attrs, backend=backend)
    dev = util.to_device(cp, inputs)
    op = cupa.PagedAttention(**attrs, return_lse=True)
    problem = op._problem(op._bind((), dev))
    served = next(b for b in dispatch.cuda_backends() if b.name == backend)
    if served.not_supported_reasons(problem, dispatch.device_info(dev["query"].data.device_id),
                                    cupa.Options(backend=backend)):
        pytest.skip(f"{backend} does not serve this call")
    want_out, want_lse = _lse_reference(inputs, attrs)
    assert np.isneginf(want_lse[40:49]).all() and np.isneginf(want_lse[-7:]).all()
    out, lse = op(**dev)
    util.assert_lse_close(cp.asnumpy(lse), want_lse, tol=1e-4)
    assert util.rel_err(cp.asnumpy(out), want_out) < util.TOLERANCE["float16"]


def test_return_lse_costs_no_other_bits(cp, rng):
    """The output with return_lse is the output without it, bit for bit (same launches, one more store)."""
    for case in ("decode_fp16", "prefill_fp16"):
        inputs, attrs = util.build(rng, **LSE_CASES[case])
        plain = cupa.paged_attention(**util.to_device(cp, inputs), **attrs)
        with_lse, _ = cupa.paged_attention(**util.to_device(cp, inputs), **attrs, return_lse=True)
        assert np.array_equal(cp.asnumpy(plain).view(np.uint16), cp.asnumpy(with_lse).view(np.uint16)), case


# -- key shards and cascade on the device ----------------------------------------------------------

@pytest.mark.parametrize("case", ["decode_fp16", "decode_int8_window", "prefill_fp16"])
def test_key_shards_merge_to_the_unsplit_call_on_the_device(cp, rng, case):
    inputs, attrs = util.build(rng, **LSE_CASES[case])
    want_out, want_lse = _lse_reference(inputs, attrs)
    tables = shard_block_tables(rng, inputs["block_table"], 3, how="ranges")
    dev = util.to_device(cp, inputs)
    sink = dev.pop("head_sink", None)
    parts = [cupa.paged_attention(**dict(dev, block_table=cp.asarray(t)), **attrs, return_lse=True) for t in tables]
    out, lse = cupa.merge_states([p[0] for p in parts], [p[1] for p in parts], head_sink=sink)
    assert util.rel_err(cp.asnumpy(out), want_out) < util.TOLERANCE[np.dtype(inputs["query"].dtype).name]
    util.assert_lse_close(cp.asnumpy(lse), want_lse, tol=1e-4)


def _shared_prefix(rng, B=16, prefix=512, own=(0, 100), **kw):
    past = [prefix + int(x) for x in rng.integers(own[0], own[1] + 1, size=B)]
    inputs, attrs = util.build(rng, q_lens=[1] * B, past=past, H=32, Hk=8, D=128, **kw)
    bt = inputs["block_table"]
    bt[:, :prefix // 16] = bt[0, :prefix // 16]
    return inputs, attrs


def _check_cascade(cp, inputs, attrs, prefix, **cascade):
    """A cascade step on the device against the reference and the plain call: output, lse, cache bytes."""
    want_out, want_lse = _lse_reference(inputs, attrs)
    plain = util.to_device(cp, inputs)
    plain_out = cupa.paged_attention(**plain, **attrs)
    dev = util.to_device(cp, inputs)
    op = cupa.CascadeAttention(prefix_len=prefix, return_lse=True, **cascade, **attrs)
    out, lse = op(**dev)
    dtype = np.dtype(inputs["query"].dtype).name
    assert util.rel_err(cp.asnumpy(out), want_out) < util.TOLERANCE[dtype]
    assert util.rel_err(cp.asnumpy(out), cp.asnumpy(plain_out)) < util.TOLERANCE[dtype]
    util.assert_lse_close(cp.asnumpy(lse), want_lse, tol=1e-4)
    for name in ("key_cache", "value_cache"):
        assert np.array_equal(cp.asnumpy(dev[name]).view(np.uint8), cp.asnumpy(plain[name]).view(np.uint8)), name


@pytest.mark.parametrize("mode", ["heads", "tokens"])
@pytest.mark.parametrize("features", [dict(), dict(sink=True, softcap=30.0), dict(cache="int8"),
                                      dict(rotary=True), dict(window=300, sink=True)])
def test_cascade_equals_the_plain_call_on_the_device(cp, rng, mode, features):
    if mode == "heads" and (features.get("rotary") or features.get("window", -1) > 0):
        mode = "auto"
    inputs, attrs = _shared_prefix(rng, **features)
    _check_cascade(cp, inputs, attrs, 512, prefix_mode=mode)


@pytest.mark.parametrize("splits, prefix, features", [(3, 512, dict()), (3, 512, dict(cache="int8", sink=True)),
                                                     (2, 4096, dict(sink=True, softcap=30.0)),
                                                     (15, 4096, dict(dtype="bfloat16"))])
def test_cascade_heads_prefix_split_by_keys_on_the_device(cp, rng, splits, prefix, features):
    """The heads form with its shared keys in runs (one prefix-call sequence each), the merge reading the
    prefix's KV-head-major rows: equal to the reference and the plain call."""
    inputs, attrs = _shared_prefix(rng, prefix=prefix, **features)
    _check_cascade(cp, inputs, attrs, prefix, prefix_mode="heads", prefix_splits=splits)


@pytest.mark.parametrize("dtype, D, width_extra, offset", [("float16", 128, 0, 0), ("bfloat16", 64, 16 * 64, 0),
                                                          ("float32", 20, 4, 0), ("float16", 128, 0, 3)])
def test_cascade_inputs_stacks_the_heads_form_queries(cp, rng, dtype, D, width_extra, offset):
    """cascade_inputs' copy of the heads form's queries: S copies, KV-head major, from rows of any 16-byte
    stride (packed QKV rows are wider than the query heads); rows it cannot copy (stack_units None: a
    start or head row off 16 bytes) are left to the host's broadcast copy, which the step takes then."""
    from cupa.kernels import states as kernels

    N, Hk, G, S = 9, 2, 4, 3
    width = Hk * G * D + width_extra
    base = cp.asarray(rng.standard_normal((N * width + offset,)).astype(T_DTYPES[dtype]))
    query = base[offset:].reshape(N, width)
    units = kernels.stack_units(query, D)
    if offset or (D * query.dtype.itemsize) % 16:
        assert units is None
        return
    want = cp.ascontiguousarray(cp.broadcast_to(
        query[:, :Hk * G * D].reshape(N, Hk, G, D).transpose(1, 0, 2, 3)[None], (S, Hk, N, G, D))).reshape(S, -1)
    stacked = cp.full(want.shape, np.nan, want.dtype)
    idx = lambda *shape: cp.zeros(shape, np.int32)   # noqa: E731
    kernels.cascade_inputs(cp.arange(N + 1, dtype=np.int32), cp.full(N, 40, np.int32), idx(N, 8), None,
                           kv_capacity=128, rotary_max_pos=0, prefix_len=32, prefix_blocks=2, prefix_rows=S,
                           prefix_cols=1, prefix_split=True, prefix_positions=idx(N), suffix_past=idx(N),
                           suffix_positions=None, suffix_table=idx(N, 6), prefix_table=idx(S, 1),
                           stream=cp.cuda.get_current_stream(), query=query, kv_num_heads=Hk, group=G, head_size=D,
                           stacked=stacked)
    assert np.array_equal(cp.asnumpy(stacked).view(np.uint8), cp.asnumpy(want).view(np.uint8))


@pytest.mark.parametrize("mode, B, prefix", [("heads", 16, 1024), ("heads", 64, 8192), ("tokens", 16, 1024),
                                            ("tokens", 40, 16)])
def test_cascade_inputs_writes_the_prefix_calls_constants(cp, rng, mode, B, prefix):
    """The prefix call's cumulative_sequence_length, past_seqlens, slot_mapping and zero key/value rows come
    from the index launch: equal to the host's (_host_constants)."""
    from cupa import cascade as cascade_mod
    from cupa.kernels import states as kernels

    inputs, attrs = _shared_prefix(rng, B=B, prefix=prefix, own=(0, 40))
    dev = util.to_device(cp, inputs)
    op = cupa.CascadeAttention(prefix_len=prefix, prefix_mode=mode, **attrs)
    step = op._step(op._plain.plan(**dev).problem, 0)
    x = dict(dev, query_positions=None)
    d = cascade_mod._derive_device(step, x, prefix, cp.cuda.get_current_stream(), kernels)
    want = cascade_mod._host_constants(step)
    for name, value in d["constants"].items():
        if want[name] is None:
            assert value is None, name
        else:
            assert np.array_equal(cp.asnumpy(value), want[name]), name


def test_cascade_heads_form_with_packed_queries(cp, rng):
    """The heads form from packed QKV rows (wider than the query heads; copied by cascade_inputs): equal
    to the reference and the plain call."""
    inputs, attrs = _shared_prefix(rng, B=8, packed=True)
    _check_cascade(cp, inputs, attrs, 512, prefix_mode="heads", prefix_splits=3)


def test_cascade_auto_splits_on_the_benchmark_shape(cp, rng):
    """64 decode tokens (GQA 32/8, D=128) over an 8192-key shared prefix: "auto" takes 8 runs of 1024 keys
    on an H200, the prefix call goes to a tensor-core prefill kernel, and the step equals the plain call."""
    inputs, attrs = _shared_prefix(rng, B=64, prefix=8192, own=(0, 64))
    plain = util.to_device(cp, inputs)
    plain_out, plain_lse = cupa.paged_attention(**plain, **attrs, return_lse=True)
    dev = util.to_device(cp, inputs)
    op = cupa.CascadeAttention(prefix_len=8192, return_lse=True, **attrs)
    text = op.describe(**dev)
    if cp.cuda.Device().attributes["MultiProcessorCount"] >= 128:   # half the SMs beside the suffix; all alone
        assert "in 4 run(s) of up to 2048 keys" in text, text
        assert "in 8 run(s) of up to 1024 keys" in cupa.CascadeAttention(prefix_len=8192, concurrent=False,
                                                                         **attrs).describe(**dev)
        assert op.backends(**dev)[0] in ("prefill_wgmma", "prefill"), text
    out, lse = op(**dev)
    assert util.rel_err(cp.asnumpy(out), cp.asnumpy(plain_out)) < util.TOLERANCE["float16"]
    util.assert_lse_close(cp.asnumpy(lse), cp.asnumpy(plain_lse), tol=1e-4)


@pytest.mark.parametrize("mode", ["heads", "tokens"])
def test_cascade_concurrent_equals_serial_bit_for_bit(cp, rng, mode):
    """The suffix on the side stream (concurrent) or after the prefix on the call's stream: the same kernels
    over the same inputs, so the same bits -- output, lse and the caches; and a second concurrent step on
    another stream (its own side stream) too."""
    inputs, attrs = _shared_prefix(rng, B=24, prefix=1024, own=(0, 300), sink=True)
    results = []
    for concurrent, stream in ((False, None), (True, None), (True, cp.cuda.Stream(non_blocking=True))):
        dev = util.to_device(cp, inputs)
        op = cupa.CascadeAttention(prefix_len=1024, prefix_mode=mode, prefix_splits=1 if mode == "tokens" else 3,
                                   concurrent=concurrent, return_lse=True, **attrs)
        out, lse = op(**dev, stream=stream)
        cp.cuda.Device().synchronize()
        results.append([cp.asnumpy(x).view(np.uint8) for x in (out, lse, dev["key_cache"], dev["value_cache"])])
    for got in results[1:]:
        for name, a, b in zip(("output", "lse", "key_cache", "value_cache"), results[0], got):
            assert np.array_equal(a, b), name


def test_cascade_concurrent_under_torch_cuda_graph(cp, torch_cuda, rng):
    """A concurrent cascade step on PyTorch's stream, captured by torch.cuda.graph inside capture_scope: the
    side stream joins the capture through the fork event and the replay equals the eager step."""
    from cupa import graphs

    torch = torch_cuda
    inputs, attrs = _shared_prefix(rng, B=16, prefix=1024, own=(0, 200), sink=True)
    t = {k: (torch.from_numpy(v).cuda() if isinstance(v, np.ndarray) else v) for k, v in inputs.items()}
    md = np.array([1, 2048], np.int32)
    op = cupa.CascadeAttention(prefix_len=1024, **attrs)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        eager = op(**t, attention_metadata=md).clone()      # warm-up: compiles every kernel
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    tg = torch.cuda.CUDAGraph()
    with graphs.capture_scope(), torch.cuda.graph(tg, capture_error_mode="relaxed"):
        o = op(**t, attention_metadata=md)
    o.fill_(float("nan"))
    tg.replay()
    torch.cuda.synchronize()
    assert torch.equal(o.view(torch.int16), eager.view(torch.int16))
    want = cupa.paged_attention(**{k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in inputs.items()},
                                **util.host_attrs(attrs))
    assert util.rel_err(o.float().cpu().numpy(), want) < util.TOLERANCE["float16"]


@pytest.mark.parametrize("B", [64, 4])   # the prefix call on a tensor-core prefill kernel, and on decode
def test_cascade_prefix_call_launches_no_prologue(cp, rng, B):
    """The heads-form prefix call stores nothing (slot_mapping all -1) and its queries pass through: its plan
    launches the attention kernel alone, and the step still equals the reference and the plain call."""
    inputs, attrs = _shared_prefix(rng, B=B, prefix=2048, own=(0, 64))
    _check_cascade(cp, inputs, attrs, 2048, prefix_mode="heads")
    op = cupa.CascadeAttention(prefix_len=2048, prefix_mode="heads", **attrs)
    op(**util.to_device(cp, inputs))
    step = next(iter(op._steps.values()))
    plans = [e[1] for e in step.prefix_op._problems.values() if e[1] is not None and "recipe" in e[1].state]
    assert plans and all(not plan.writes for plan in plans)
    for plan in plans:
        steps = plan.state["recipe"].launches.steps
        if plan.backend.name.startswith("prefill") or not plan.state["recipe"].split:
            assert len(steps) == 1, (plan.backend.name, steps)


def test_cascade_suffix_beside_the_prefix_launches_plainly(cp, rng):
    """Concurrent, the suffix call's plans launch its attention kernel without programmatic dependent launch
    (its CTAs would wait resident while the prefix call needs the SMs); serial, with it where the device
    has it. Both give the plain call's results."""
    inputs, attrs = _shared_prefix(rng, B=16, prefix=1024, own=(0, 200), sink=True)
    for concurrent in (True, False):
        _check_cascade(cp, inputs, attrs, 1024, concurrent=concurrent)
        op = cupa.CascadeAttention(prefix_len=1024, concurrent=concurrent, **attrs)
        op(**util.to_device(cp, inputs))
        used = op._suffix_beside if concurrent else op._suffix
        plans = [e[1] for e in used._problems.values() if e[1] is not None and "recipe" in e[1].state]
        assert plans
        for plan in plans:
            sequence = plan.state["recipe"].launches
            assert any(sequence.programmatic), plan.backend.name   # a prologue, then the attention kernel
            assert sequence.pdl == (not concurrent and launch.pdl_allowed(plan.device, plan.options))


def test_cascade_graph_outlives_its_op(cp, rng):
    """A captured cascade step replays correctly after its op is gone and its memory reused: the graph keeps
    the prefix call's constant index arrays too."""
    import gc
    import weakref

    inputs, attrs = _shared_prefix(rng, B=16, prefix=1024, own=(0, 200), sink=True)
    md = np.array([1, 2048], np.int32)
    dev = util.to_device(cp, inputs)
    out = cp.empty((16, 32 * 128), np.float16)
    op = cupa.CascadeAttention(prefix_len=1024, prefix_mode="heads", prefix_splits=3, **attrs)
    op(**dev, attention_metadata=md, out=out)
    eager = cp.asnumpy(out)
    g = cupa.capture_graph(lambda op=op: op(**dev, attention_metadata=md, out=out), warmup=0)
    gone = weakref.ref(op)
    del op
    gc.collect()
    assert gone() is None
    junk = [cp.full(n, -7, np.int32) for n in (4, 5, 16, 1536, 4096, 1 << 16) for _ in range(8)]   # freed blocks
    with g:
        out.fill(np.nan)
        g.replay()
        g.stream.synchronize()
    assert np.array_equal(cp.asnumpy(out).view(np.uint16), eager.view(np.uint16))
    del junk


@pytest.mark.parametrize("mode", ["heads", "tokens"])
def test_cascade_attention_function_is_capturable(cp, rng, mode):
    """cupa.cascade_attention (a new op each call) inside a captured step: the capture copies the prefix
    call's constants from pinned memory it keeps, and the replay equals the eager call."""
    inputs, attrs = _shared_prefix(rng, B=16, prefix=1024, own=(0, 200), sink=True)
    md = np.array([1, 2048], np.int32)
    dev = util.to_device(cp, inputs)
    out = cp.empty((16, 32 * 128), np.float16)

    def step():
        cupa.cascade_attention(**dev, attention_metadata=md, out=out, prefix_len=1024, prefix_mode=mode, **attrs)

    step()
    eager = cp.asnumpy(out)
    with cupa.capture_graph(step) as g:
        for _ in range(2):
            out.fill(np.nan)
            g.replay()
            g.stream.synchronize()
            assert np.array_equal(cp.asnumpy(out).view(np.uint16), eager.view(np.uint16))
    want = cupa.paged_attention(**{k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in inputs.items()},
                                **util.host_attrs(attrs))
    assert util.rel_err(eager, want) < util.TOLERANCE["float16"]


def test_cascade_with_torch_tensors(cp, torch_cuda, rng):
    torch = torch_cuda
    inputs, attrs = _shared_prefix(rng, B=8, sink=True)
    want_out = cupa.paged_attention(**{k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in inputs.items()},
                                    **util.host_attrs(attrs))
    t = {k: (torch.from_numpy(v).cuda() if isinstance(v, np.ndarray) else v) for k, v in inputs.items()}
    out = cupa.CascadeAttention(prefix_len=512, **attrs)(**t)
    assert isinstance(out, torch.Tensor) and out.is_cuda
    assert util.rel_err(out.float().cpu().numpy(), want_out) < util.TOLERANCE["float16"]


def test_steps_that_merge_are_capturable(cp, rng):
    """Two shard calls + merge_states, and a cascade step, captured and replayed: the eager bits."""
    inputs, attrs = _shared_prefix(rng, B=8, sink=True)
    md = np.array([1, 2048], np.int32)
    dev = util.to_device(cp, inputs)
    sink = dev.pop("head_sink")
    tables = [cp.asarray(t) for t in shard_block_tables(rng, inputs["block_table"], 2)]
    out = cp.empty((8, 32 * 128), np.float16)
    cascade_out = cp.empty_like(out)
    cascade = cupa.CascadeAttention(prefix_len=512, **attrs)

    def step():
        parts = [cupa.paged_attention(**dict(dev, block_table=t), **attrs, attention_metadata=md, return_lse=True)
                 for t in tables]
        cupa.merge_states([p[0] for p in parts], [p[1] for p in parts], head_sink=sink, out=out)
        cascade(**dev, head_sink=sink, attention_metadata=md, out=cascade_out)

    step()
    eager, eager_cascade = cp.asnumpy(out), cp.asnumpy(cascade_out)
    with cupa.capture_graph(step, warmup=0) as g:
        out.fill(np.nan)
        cascade_out.fill(np.nan)
        g.replay()
        g.stream.synchronize()
        assert np.array_equal(cp.asnumpy(out).view(np.uint16), eager.view(np.uint16))
        assert np.array_equal(cp.asnumpy(cascade_out).view(np.uint16), eager_cascade.view(np.uint16))


@pytest.mark.slow
def test_cascade_benchmark_case_agrees_with_the_plain_call(tmp_path):
    """The cascade benchmark case (B=64 decode sequences sharing an 8192-token prefix, 256 own tokens, fp16
    GQA 32/8, D=128) runs through the cascade suite of python -m cupa.bench and agrees with the plain call;
    its speedup is a benchmark figure (the JSON's speedup_vs_plain), not a test."""
    import json

    from cupa.bench import cli

    out = tmp_path / "cascade.json"
    assert cli.main(["--only", "cascade:B=64 prefix=8192 suffix=256", "--no-peers", "--no-plots", "--reps", "10",
                     "--out", str(out)]) == 0
    rec = next(r for r in json.loads(out.read_text())["cases"] if r["suite"] == "cascade")
    assert rec["cupa"]["status"] == "ok", rec["cupa"]
    assert rec["cupa"]["rel_err_vs_plain"] < 2e-3
    assert rec["cupa"]["speedup_vs_plain"] > 0
