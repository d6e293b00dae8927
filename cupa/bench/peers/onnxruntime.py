"""ONNX Runtime's CUDA ``com.microsoft::PagedAttention``: a one-node model run with IO binding on cupa's
own buffers.

:func:`build_model` writes the node with ``onnx.helper`` -- the case's attributes, its present inputs
(0-16, symbolic dimensions) and the three outputs -- and :func:`binding_plan` lists what is bound to
each name: every input to cupa's device buffer, ``attention_metadata`` to host memory (the kernel
reads it there), ``output`` to a preallocated array, and ``key_cache_out`` / ``value_cache_out`` to
the input caches' own buffers (ONNX Runtime requires the cache outputs to alias the inputs). The
session runs on the benchmark's stream (``user_compute_stream``) and ``run_with_iobinding`` is told not
to synchronize at the end (``disable_synchronize_execution_providers``), so the CUDA events around it
time the GPU work as for every other peer. An e4m3 cache (uint8 bytes in cupa) is bound as
``FLOAT8E4M3FN``.
"""

from __future__ import annotations

import hashlib

import ml_dtypes
import numpy as np

from . import Peer, Prepared, Unsupported

__all__ = ["OnnxRuntimeCuda", "build_model", "binding_plan", "OPSET", "IR_VERSION"]

#: Opsets of the model: the default domain (required by every model) and com.microsoft 1.
OPSET = 21
IR_VERSION = 10
_OUTPUTS = ("output", "key_cache_out", "value_cache_out")


def _element_type(arr, name: str, case) -> int:
    from onnx import TensorProto

    dt = np.dtype(arr.dtype)
    if name in ("key_cache", "value_cache") and case.cache == "fp8":
        return TensorProto.FLOAT8E4M3FN
    table = {np.dtype(np.float16): TensorProto.FLOAT16, np.dtype(ml_dtypes.bfloat16): TensorProto.BFLOAT16,
             np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.int32): TensorProto.INT32,
             np.dtype(np.int8): TensorProto.INT8, np.dtype(np.uint8): TensorProto.UINT8,
             np.dtype(ml_dtypes.float8_e4m3fn): TensorProto.FLOAT8E4M3FN}
    return table[dt]


def _node_attributes(built) -> dict:
    a = dict(built.attributes)
    if built.case.cache == "fp8":
        # the cache tensors are typed FLOAT8E4M3FN, so the logical type is the tensor's own (the default)
        a.pop("k_cache_dtype", None)
        a.pop("v_cache_dtype", None)
    return a


def _dims(name: str, shape) -> list:
    """Symbolic dimensions (one session serves any size), the head widths fixed."""
    if name in ("key_cache", "value_cache"):
        return ["num_blocks", "block_size", int(shape[2]), int(shape[3])]
    if name in ("query", "key", "value"):
        return ["tokens", int(shape[1])]
    if name == "cumulative_sequence_length":
        return ["batch_plus_1"]
    if name == "past_seqlens":
        return ["batch"]
    if name == "block_table":
        return ["batch", "max_blocks"]
    return [int(d) for d in shape]


def binding_plan(built) -> list:
    """``[(kind, name, device, element_type, shape, array)]`` for IO binding: kind is "input" or
    "output", device "cuda" or "cpu"; ``array`` is None for ``output`` (the caller allocates it)."""
    case = built.case
    x = built.inputs
    plan = []
    for name in list(x)[:17]:
        arr = x[name]
        if arr is None:
            continue
        device = "cpu" if name == "attention_metadata" else "cuda"
        plan.append(("input", name, device, _element_type(arr, name, case), tuple(arr.shape), arr))
    q = x["query"]
    plan.append(("output", "output", "cuda", _element_type(q, "query", case),
                 (case.token_count, case.num_heads * case.out_head_size), None))
    plan.append(("output", "key_cache_out", "cuda", _element_type(x["key_cache"], "key_cache", case),
                 tuple(x["key_cache"].shape), x["key_cache"]))
    if x["value_cache"] is not None:
        plan.append(("output", "value_cache_out", "cuda", _element_type(x["value_cache"], "value_cache", case),
                     tuple(x["value_cache"].shape), x["value_cache"]))
    return plan


def build_model(built):
    """The one-node ``com.microsoft::PagedAttention`` model of a case (an ``onnx.ModelProto``)."""
    from onnx import helper

    names = list(built.inputs)[:17]
    plan = binding_plan(built)
    inputs = [helper.make_tensor_value_info(name, etype, _dims(name, shape))
              for kind, name, _, etype, shape, _ in plan if kind == "input"]
    outputs = []
    for kind, name, _, etype, shape, _ in plan:
        if kind != "output":
            continue
        dims = ["tokens", int(shape[1])] if name == "output" else _dims("key_cache", shape)
        outputs.append(helper.make_tensor_value_info(name, etype, dims))
    present = {name for kind, name, *_ in plan if kind == "input"}
    node_inputs = [n if n in present else "" for n in names]
    while node_inputs and node_inputs[-1] == "":
        node_inputs.pop()
    node_outputs = [n for n in _OUTPUTS if any(o.name == n for o in outputs)]
    node = helper.make_node("PagedAttention", node_inputs, node_outputs, domain="com.microsoft",
                            **_node_attributes(built))
    graph = helper.make_graph([node], "cupa_bench_paged_attention", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET),
                                                    helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = IR_VERSION
    return model


class OnnxRuntimeCuda(Peer):
    name = "onnxruntime"
    description = "ONNX Runtime CUDA com.microsoft::PagedAttention (IO binding)"
    suites = ("decode", "prefill", "chunked", "mixed", "mla", "subbyte")

    def __init__(self):
        self._sessions = {}

    def _probe(self) -> str:
        import onnx  # noqa: F401
        import onnxruntime as ort

        if hasattr(ort, "preload_dlls"):   # CUDA and cuDNN from the nvidia-* packages PyTorch brings
            ort.preload_dlls()
        if "CUDAExecutionProvider" not in ort.get_available_providers():
            raise RuntimeError(f"onnxruntime {ort.__version__} has no CUDAExecutionProvider "
                               "(install onnxruntime-gpu)")
        return ort.__version__

    def session(self, model, runtime):
        import onnxruntime as ort

        data = model.SerializeToString()
        key = (hashlib.sha1(data).hexdigest(), runtime.stream.ptr)
        sess = self._sessions.get(key)
        if sess is None:
            so = ort.SessionOptions()
            so.log_severity_level = 3
            provider = ("CUDAExecutionProvider", {"device_id": str(runtime.cp.cuda.Device().id),
                                                  "user_compute_stream": str(runtime.stream.ptr)})
            sess = self._sessions[key] = ort.InferenceSession(data, so, providers=[provider])
        return sess

    def prepare(self, built, runtime) -> Prepared:
        import onnxruntime as ort

        case = built.case
        if case.dtype not in ("float16", "bfloat16"):
            raise Unsupported(f"T={case.dtype} (the op takes float16 and bfloat16)")
        sess = self.session(build_model(built), runtime)
        io = sess.io_binding()
        dev = runtime.cp.cuda.Device().id
        out = runtime.xp.empty((case.token_count, case.num_heads * case.out_head_size), dtype=built.inputs["query"].dtype)
        for kind, name, device, etype, shape, arr in binding_plan(built):
            if kind == "input" and device == "cpu":
                io.bind_cpu_input(name, np.ascontiguousarray(arr))
            elif kind == "input":
                io.bind_input(name, "cuda", dev, etype, list(shape), arr.data.ptr)
            else:
                target = out if arr is None else arr
                io.bind_output(name, "cuda", dev, etype, list(shape), target.data.ptr)
        ro = ort.RunOptions()
        ro.add_run_config_entry("disable_synchronize_execution_providers", "1")
        return Prepared(lambda: sess.run_with_iobinding(io, ro), lambda: out, "one-node session, IO binding")
