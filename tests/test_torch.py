"""The ``cupa::paged_attention`` PyTorch operator (cupa.torch): schema, fake implementation, torch.compile, CUDA graphs.

CPU tests run the NumPy reference through torch CPU tensors; the results must be the reference's bits.
GPU-marked tests run the same calls on CUDA tensors against the reference (SPEC section 6 tolerances).
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import cupa  # noqa: E402
import cupa.torch as ct  # noqa: E402
from cupa.contract import INPUT_NAMES  # noqa: E402

from .util import assert_matches_reference, make_case  # noqa: E402

#: make_case options of the opcheck cases: every kind of input the operator's schema carries
OPCHECK_CASES = {
    "fp32 qk_output lse metadata": dict(dtype="float32", qk_output=1, metadata="tight"),
    "bf16 sink window softcap": dict(dtype="bfloat16", sink=True, window=5, softcap=20.0),
    "fp16 rotary qk_norm positions": dict(dtype="float16", rotary="half", qk_norm=True, positions="explicit"),
    "int8 per-channel": dict(dtype="float32", cache="int8", k_quant="PER_CHANNEL", v_quant="PER_TENSOR"),
    "fp8 bytes slot_mapping": dict(dtype="bfloat16", cache="fp8_bytes", slot_mapping="skip"),
    "packed qkv": dict(dtype="float16", packed=True),
    "latent": dict(dtype="float32", latent=True, v_head_size=32, scale=0.125),
}
#: and torch's own float8 caches (opcheck's schema test multiplies tensors, which torch has no CPU float8 kernel for)
RESULT_CASES = dict(OPCHECK_CASES, **{"fp8 e4m3": dict(dtype="float16", cache="fp8")})


def to_torch(a, device="cpu"):
    """A torch tensor with the bits of a NumPy array (bfloat16 and float8 through their integer views)."""
    a = np.ascontiguousarray(a)
    name = a.dtype.name
    if name == "bfloat16":
        t = torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    elif name == "float8_e4m3fn":
        t = torch.from_numpy(a.view(np.uint8)).view(torch.float8_e4m3fn)
    else:
        t = torch.from_numpy(a)
    return t.to(device).clone()


def to_numpy(t):
    """Host NumPy array with the bits of a torch tensor."""
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    if t.dtype == torch.float8_e4m3fn:
        import ml_dtypes

        return t.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
    return t.numpy()


def torch_inputs(case, device="cpu") -> dict:
    """case.inputs as torch tensors on ``device``; attention_metadata as a list of ints."""
    out = {}
    for name, v in case.inputs.items():
        if v is None:
            out[name] = None
        elif name == "attention_metadata":
            out[name] = [int(x) for x in v]
        else:
            out[name] = to_torch(v, device)
    return out


def op_args(inputs: dict) -> tuple:
    return tuple(inputs[n] for n in INPUT_NAMES)


def check_result(ref_case, out, expected, inputs):
    """The operator's output ``out`` and caches (``inputs``, torch tensors) against a reference run: ``ref_case``
    after the call, ``expected`` its output."""
    caches = [(name, to_numpy(inputs[name]), ref_case.inputs[name]) for name in ("key_cache", "value_cache")
              if inputs[name] is not None]
    assert_matches_reference(out, expected, ref_case.dtype, caches, cache=ref_case.info["cache"])


def reference(case, **extra):
    """(case after the call, result) of the NumPy reference on a copy of ``case``."""
    ref = case.copy()
    return ref, ref.run(**extra)


# -- CPU ----------------------------------------------------------------------------------------------

def test_import_cupa_leaves_torch_alone():
    """torch is an optional extra: `import cupa` imports neither torch nor the operator module."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    probe = "import sys, cupa; print(sorted(m for m in ('torch', 'cupa.torch', 'transformers') if m in sys.modules))"
    repo = str(Path(__file__).resolve().parents[1])
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=repo, check=True,
                         env=dict(os.environ, PYTHONPATH=repo))
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


@pytest.mark.parametrize("kind", list(OPCHECK_CASES))
def test_opcheck(rng, kind):
    case = make_case(rng, **OPCHECK_CASES[kind])
    attrs = dict(case.attrs, return_lse=True)
    torch.library.opcheck(ct.OP, op_args(torch_inputs(case)), attrs)


@pytest.mark.parametrize("kind", list(RESULT_CASES))
def test_results_are_the_references_bits(rng, kind):
    case = make_case(rng, **RESULT_CASES[kind])
    qk = bool(case.attrs.get("qk_output"))
    ref, expected = reference(case, return_lse=True)
    inputs = torch_inputs(case)
    got = ct.paged_attention(**inputs, **case.attrs, return_lse=True)
    assert isinstance(got, tuple) and len(got) == 2 + qk
    assert all(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in got)
    for t, e in zip(got, expected):
        np.testing.assert_array_equal(to_numpy(t), e)
    for name in ("key_cache", "value_cache"):
        if ref.inputs[name] is not None:
            np.testing.assert_array_equal(to_numpy(inputs[name]), ref.inputs[name], err_msg=name)


def test_raw_operator_returns_three_tensors(rng):
    case = make_case(rng, dtype="float32")
    output, output_qk, lse = ct.OP(*op_args(torch_inputs(case)), **case.attrs)
    assert output.shape == case.run().shape
    assert output_qk.shape == (0,) and lse.shape == (0,) and output_qk.dtype == lse.dtype == torch.float32


@pytest.mark.parametrize("options", [None, cupa.Options(), cupa.Options(validate_data=True, backend="reference"),
                                     cupa.Options(output_qk_max_bytes=1 << 20,
                                                  _tuning=cupa.options._Tuning(decode_ctas_per_sm=3))])
def test_options_round_trip(options):
    key = ct.options_key(options)
    assert isinstance(key, str)
    assert ct.options_from_key(key) == (options or cupa.Options())
    assert (key == "") == (options is None or options == cupa.Options())


def test_options_key_rejects_garbage():
    with pytest.raises(cupa.PagedAttentionError, match="options: got"):
        ct.options_from_key("{not json")
    with pytest.raises(cupa.PagedAttentionError, match="options.backend"):
        ct.options_from_key('{"backend": "nope"}')


def test_options_reach_the_call(rng):
    case = make_case(rng, dtype="float32", qk_output=1)
    inputs = torch_inputs(case)
    ct.paged_attention(**inputs, **case.attrs)
    with pytest.raises(cupa.PagedAttentionError, match="output_qk"):
        ct.paged_attention(**inputs, **case.attrs, options=cupa.Options(output_qk_max_bytes=64))


def _step_function(attrs, md, options):
    def step(q, k, v, key_cache, value_cache, cum, past, block_table):
        out, lse = ct.paged_attention(q * 1.0, k, v, key_cache, value_cache, cum, past, block_table,
                                      attention_metadata=md, return_lse=True, options=options, **attrs)
        return out, out * 2.0 - 1.0, lse          # exact arithmetic around the op: equal bits on every backend
    return step


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_compiled_fullgraph_equals_eager(rng, backend):
    """Compiled with fullgraph=True (no graph break), repeated calls with new values: outputs and caches equal."""
    torch._dynamo.reset()
    H, Hk, D, bs = 4, 2, 32, 8
    case = make_case(rng, num_heads=H, kv_num_heads=Hk, head_size=D, block_size=bs, dtype="float32",
                     q_lens=(3, 1, 4), past=(5, 20, 0), extra_cols=3, unused_cols="neg", sink=True)
    attrs = dict(case.attrs)
    md = [4, case.inputs["block_table"].shape[1] * bs]
    options = cupa.Options(validate_data=True)
    step = _step_function(attrs, md, options)
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    inputs = torch_inputs(case)
    eager_caches = [inputs["key_cache"].clone(), inputs["value_cache"].clone()]
    past = inputs["past_seqlens"].clone()
    for _ in range(3):
        q, k, v = (torch.from_numpy(rng.standard_normal(inputs[n].shape).astype(np.float32))
                   for n in ("query", "key", "value"))
        args = (inputs["cumulative_sequence_length"], past, inputs["block_table"])
        got = compiled(q, k, v, inputs["key_cache"], inputs["value_cache"], *args)
        want = step(q, k, v, *eager_caches, *args)
        for g, w in zip(got, want):
            assert torch.equal(g, w)
        assert torch.equal(inputs["key_cache"], eager_caches[0]) and torch.equal(inputs["value_cache"], eager_caches[1])
        past = past + (inputs["cumulative_sequence_length"][1:] - inputs["cumulative_sequence_length"][:-1])


def test_compiled_dynamic_shapes(rng):
    """dynamic=True: the fake implementation sizes outputs from symbolic shapes (token_count varies)."""
    torch._dynamo.reset()
    attrs = dict(num_heads=4, kv_num_heads=2)

    def step(q, k, v, key_cache, value_cache, cum, past, block_table):
        out, qk = ct.paged_attention(q, k, v, key_cache, value_cache, cum, past, block_table, qk_output=1,
                                     attention_metadata=[8, 24], **attrs)
        return out + 1.0, qk

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager", dynamic=True)
    for q_lens in ((2, 3), (1, 5), (4, 4)):
        case = make_case(rng, dtype="float32", head_size=16, block_size=8, q_lens=q_lens, past=(6, 9),
                         extra_cols=2)
        inputs = torch_inputs(case)
        want_caches = [inputs["key_cache"].clone(), inputs["value_cache"].clone()]
        args = [inputs[n] for n in ("query", "key", "value", "key_cache", "value_cache",
                                    "cumulative_sequence_length", "past_seqlens", "block_table")]
        got = compiled(*args)
        want = step(*args[:3], *want_caches, *args[5:])
        for g, w in zip(got, want):
            assert g.shape == w.shape and torch.equal(g, w)
        assert torch.equal(inputs["key_cache"], want_caches[0])


def test_bad_input_fails_while_tracing(rng):
    case = make_case(rng, dtype="float32")
    inputs = torch_inputs(case)
    inputs["block_table"] = inputs["block_table"].to(torch.int64)
    attrs = case.attrs

    def step(q, k, v, key_cache, value_cache, cum, past, block_table):
        return ct.paged_attention(q, k, v, key_cache, value_cache, cum, past, block_table, **attrs)

    args = [inputs[n] for n in ("query", "key", "value", "key_cache", "value_cache",
                                "cumulative_sequence_length", "past_seqlens", "block_table")]
    with pytest.raises(cupa.PagedAttentionError, match="block_table: got dtype int64"):
        step(*args)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="block_table: got dtype int64"):
        torch.compile(step, fullgraph=True, backend="eager")(*args)


def test_non_contiguous_inputs_are_accepted_caches_are_not(rng):
    case = make_case(rng, dtype="float32")
    ref, expected = reference(case)
    inputs = torch_inputs(case)
    inputs["query"] = inputs["query"].t().contiguous().t()     # same values, column-major strides
    got = ct.paged_attention(**inputs, **case.attrs)
    np.testing.assert_array_equal(got.numpy(), expected)
    bad = torch_inputs(case)
    bad["key_cache"] = bad["key_cache"].transpose(1, 2).contiguous().transpose(1, 2)
    with pytest.raises(cupa.PagedAttentionError, match="key_cache"):
        ct.paged_attention(**bad, **case.attrs)


# -- GPU --------------------------------------------------------------------------------------------

@pytest.fixture
def cuda():
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    return torch.device("cuda", torch.cuda.current_device())


#: the cases CUDA backends serve (no output_qk, lse or LATENT there yet), with a head size the kernels take
GPU_CASES = {k: v for k, v in RESULT_CASES.items() if k in ("bf16 sink window softcap", "fp16 rotary qk_norm positions",
                                                            "int8 per-channel", "fp8 bytes slot_mapping", "fp8 e4m3",
                                                            "packed qkv")}
GPU_OPCHECK_CASES = [k for k in GPU_CASES if k in OPCHECK_CASES]


@pytest.mark.gpu
@pytest.mark.parametrize("kind", GPU_OPCHECK_CASES)
def test_opcheck_gpu(rng, cuda, kind):
    case = make_case(rng, head_size=64, **GPU_CASES[kind])
    torch.library.opcheck(ct.OP, op_args(torch_inputs(case, cuda)), case.attrs)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", list(GPU_CASES))
def test_results_match_the_reference_gpu(rng, cuda, kind):
    case = make_case(rng, head_size=64, **GPU_CASES[kind])
    ref, expected = reference(case)
    inputs = torch_inputs(case, cuda)
    got = ct.paged_attention(**inputs, **case.attrs)
    assert got.device == cuda
    check_result(ref, to_numpy(got), expected, inputs)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_compiled_fullgraph_equals_eager_gpu(rng, cuda, backend):
    torch._dynamo.reset()
    case = make_case(rng, num_heads=8, kv_num_heads=2, head_size=128, block_size=16, dtype="bfloat16",
                     q_lens=(3, 1, 9), past=(40, 200, 0), sink=True)
    attrs = dict(case.attrs)
    md = [9, case.inputs["block_table"].shape[1] * 16]

    def step(q, k, v, key_cache, value_cache, cum, past, block_table):
        out = ct.paged_attention(q * 1.0, k, v, key_cache, value_cache, cum, past, block_table,
                                 attention_metadata=md, **attrs)
        return torch.tanh(out.float()) * 2.0 + 1.0

    compiled = torch.compile(step, fullgraph=True, backend=backend)
    inputs = torch_inputs(case, cuda)
    eager_caches = [inputs["key_cache"].clone(), inputs["value_cache"].clone()]
    past = inputs["past_seqlens"].clone()
    for _ in range(3):
        q, k, v = (torch.randn(inputs[n].shape, device=cuda).to(torch.bfloat16) for n in ("query", "key", "value"))
        args = (inputs["cumulative_sequence_length"], past, inputs["block_table"])
        got = compiled(q, k, v, inputs["key_cache"], inputs["value_cache"], *args)
        want = step(q, k, v, *eager_caches, *args)
        assert torch.equal(got, want)   # one backend, same inputs: the same bits (SPEC 4.5)
        assert torch.equal(inputs["key_cache"], eager_caches[0]) and torch.equal(inputs["value_cache"], eager_caches[1])
        past = past + 1 * (inputs["cumulative_sequence_length"][1:] - inputs["cumulative_sequence_length"][:-1])


@pytest.mark.gpu
def test_torch_cuda_graph_capture_and_replay(rng, cuda):
    """torch.cuda.graph records the operator's kernels; replays read the inputs' new values."""
    import cupa.graphs

    B, H, Hk, D, bs, max_blocks = 4, 8, 2, 128, 16, 8
    case = make_case(rng, num_heads=H, kv_num_heads=Hk, head_size=D, block_size=bs, dtype="float16",
                     q_lens=(1,) * B, past=(10, 33, 70, 5), extra_cols=max_blocks - 5, unused_cols="neg")
    inputs = torch_inputs(case, cuda)
    md = [1, inputs["block_table"].shape[1] * bs]
    names = ("query", "key", "value", "key_cache", "value_cache", "cumulative_sequence_length", "past_seqlens",
             "block_table")

    def step():
        return ct.paged_attention(*[inputs[n] for n in names], attention_metadata=md, **case.attrs)

    step()                                    # warm-up: compiles every kernel
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with cupa.graphs.capture_scope() as scope, torch.cuda.graph(graph, capture_error_mode="relaxed"):
        out = step()
    for _ in range(3):
        for n in ("query", "key", "value"):
            inputs[n].copy_(torch.randn(inputs[n].shape, device=cuda).to(torch.float16))
        inputs["past_seqlens"].add_(1)
        snapshot = {n: (None if v is None or n == "attention_metadata" else to_numpy(v)) for n, v in inputs.items()}
        ref_case = case.copy()
        ref_case.inputs.update({n: v for n, v in snapshot.items() if v is not None})
        ref_case.inputs["attention_metadata"] = np.array(md, dtype=np.int32)
        expected = ref_case.run()
        graph.replay()
        torch.cuda.synchronize()
        check_result(ref_case, to_numpy(out), expected, inputs)
    del scope
