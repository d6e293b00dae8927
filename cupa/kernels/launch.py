"""What every CUDA backend does around its kernels: device inputs, stream, output, return value."""

from __future__ import annotations

import functools

from .. import arrays, graphs
from ..contract import INPUT_NAMES, Problem
from ..errors import fail

_TENSORS = tuple(n for n in INPUT_NAMES if n != "attention_metadata")
# Inputs read with 16-byte vector loads (SPEC: head_size % 8 == 0 keeps rows aligned).
_VECTOR_READ = ("query", "key", "value", "key_cache", "value_cache")


@functools.lru_cache(maxsize=None)
def sm_count(device_id: int) -> int:
    import cupy

    return cupy.cuda.Device(device_id).attributes["MultiProcessorCount"]


def sm_count_hint() -> int:
    """SM count of the current device (for explain()); 132 (H200) when none is usable."""
    try:
        import cupy

        return sm_count(cupy.cuda.Device().id)
    except Exception:
        return 132


class Call:
    """Device views of one call's inputs, its stream and output."""

    def __init__(self, problem: Problem, inputs: dict, out, stream):
        import cupy

        self.cupy = cupy
        self.problem = problem
        self.query = inputs["query"]
        self.stream = arrays.resolve_stream(stream, self.query)
        nd = cupy.ndarray
        fast = _cupy_inputs(nd, inputs)
        if fast is None:  # other libraries, several devices, a violation: the general path (and its errors)
            fast = arrays.device_arrays({n: inputs[n] for n in _TENSORS}, self.stream)
        self.dev, self.device_id = fast
        for name in _VECTOR_READ:
            a = self.dev.get(name)
            if a is not None and a.data.ptr % 16:
                raise fail(name, f"a device pointer at {a.data.ptr:#x}", "16-byte alignment (vector loads)")
        self.sm_count = sm_count(self.device_id)
        self.device = cupy.cuda.Device(self.device_id)
        if out is None:
            with self.stream:
                self.output = arrays.empty_output(problem.output_shape, problem.dtype, self.query, self.device_id)
            graphs.keep_alive(self.output)  # a captured graph writes it at every replay
        elif (type(out) is nd and type(self.query) is nd and out.shape == problem.output_shape
              and out.dtype == self.dev["query"].dtype and out.data.device_id == self.device_id
              and out.flags.c_contiguous):
            self.output = out  # what arrays.check_out returns for a valid CuPy out with a CuPy query
        else:
            self.output = arrays.check_out(out, problem.output_shape, problem.dtype, self.query, self.device_id)

    def __enter__(self):
        self.device.__enter__()
        self.stream.__enter__()
        return self

    def __exit__(self, *exc):
        self.stream.__exit__(*exc)
        self.device.__exit__(*exc)

    def finish(self):
        """The output in the library of ``query`` (the user's ``out`` itself when given)."""
        return arrays.wrap_output(self.output, like=self.query, stream=self.stream)


def _cupy_inputs(nd, inputs: dict):
    """``(dev, device_id)`` when every present input is a C-contiguous ``cupy.ndarray`` on one device.

    The common case of :func:`arrays.device_arrays` (which returns the same for such inputs) without
    its general machinery. Anything else -- another library, a subclass, a second device, a
    non-contiguous array, no input at all -- returns None for the general path, which raises the errors.
    """
    dev = {}
    device = None
    for name in _TENSORS:
        x = inputs[name]
        if x is not None:
            if type(x) is not nd:
                return None
            d = x.data.device_id
            if device is None:
                device = d
            elif d != device:
                return None
            if not x.flags.c_contiguous:
                return None
        dev[name] = x
    return None if device is None else (dev, device)


def prepare(problem: Problem, inputs: dict, out, stream) -> Call:
    return Call(problem, inputs, out, stream)


_SHARED_CONFIGURED: dict = {}


def ensure_shared_memory(kernel, nbytes: int) -> None:
    """Raise a kernel's dynamic shared-memory limit once (needed above 48 KB)."""
    key = id(kernel)
    if _SHARED_CONFIGURED.get(key, 0) < nbytes:
        kernel.max_dynamic_shared_size_bytes = nbytes
        _SHARED_CONFIGURED[key] = nbytes
