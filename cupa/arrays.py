"""Array adapters: library and dtype of an input, zero-copy CuPy views, streams, outputs.

NumPy arrays run the reference backend; CuPy arrays and CUDA arrays exposing ``__dlpack__``
(PyTorch, JAX) run the CUDA backends. Canonical dtype names are NumPy's (``float16``,
``bfloat16``, ``float8_e4m3fn``, ``int32``, ...), whatever library the array comes from.

The CUDA backends see CuPy arrays only. One call goes::

    stream = arrays.resolve_stream(stream, query)          # the caller's current stream by default
    dev, device = arrays.device_arrays(inputs, stream)     # zero-copy CuPy views, contract §5 checks
    view = arrays.check_out(out, shape, dtype, query, device) if out is not None \\
        else arrays.empty_output(shape, dtype, query, device)
    ... launch on ``stream`` into ``view`` ...
    return arrays.wrap_output(view, query, stream)          # ``out`` itself, or a new array of query's library

Views: CuPy arrays are used as they are. A contiguous torch tensor is wrapped directly around its
``data_ptr()`` (``cupy.cuda.UnownedMemory`` holding the tensor; no DLPack capsule, a few
microseconds); a torch float8 tensor becomes its ``uint8`` bytes (CuPy has no float8 dtype).
JAX and other ``__dlpack__`` arrays go through ``cupy.from_dlpack`` with ``stream`` current.

Streams: the default is the caller's current stream (PyTorch's for a torch ``query``, else
CuPy's), so the call is ordered after the caller's own work with nothing added. When the call
runs on another stream than PyTorch's current one, that stream first waits for PyTorch's current
stream (one event, not per tensor), and :func:`wrap_output` makes PyTorch's current stream wait
for the call's results; the waits are skipped while a stream is being captured into a CUDA graph
(a capture orders its own work).
"""

from __future__ import annotations

import sys
import threading
import warnings
from typing import Any, Mapping, Optional

import numpy as np

from .contract import ArrayInfo
from .errors import fail

__all__ = [
    "library_of", "placement", "device_key", "dtype_name", "describe", "device_of", "to_cupy", "device_arrays",
    "fast_pointers", "resolve_stream", "check_out", "empty_output", "wrap_output", "numpy_dtype", "host_view",
    "host_out", "wrap_host", "CACHE_NAMES",
]

#: Inputs written in place: C-contiguous, mutable (not JAX).
CACHE_NAMES = ("key_cache", "value_cache")

# DLPack device types (dlpack.h).
_DL_CPU, _DL_CUDA, _DL_CUDA_HOST, _DL_CUDA_MANAGED = 1, 2, 3, 13

_LIB_BY_TYPE: dict = {np.ndarray: "numpy"}


def library_of(x) -> str:
    """'numpy', 'cupy', 'torch', 'jax' or 'dlpack' (another array with __dlpack__), else 'other'."""
    t = type(x)
    lib = _LIB_BY_TYPE.get(t)
    if lib is not None:
        return lib
    if isinstance(x, np.ndarray):
        lib = "numpy"
    else:
        mod = t.__module__.split(".")[0]
        if mod in ("cupy", "torch"):
            lib = mod
        elif mod in ("jax", "jaxlib"):
            lib = "jax"
        elif hasattr(x, "__dlpack__"):
            lib = "dlpack"
        else:
            return "other"  # not cached: an unknown type is an error path anyway
    _LIB_BY_TYPE[t] = lib
    return lib


def placement(x) -> str:
    """Where an array lives: ``"host"`` (NumPy, and CPU arrays NumPy can view without a copy: PyTorch,
    JAX, DLPack or ``__array__`` producers), ``"device"`` (CUDA memory), or ``"other"`` (not an array
    of a supported kind, or memory of another kind)."""
    lib = library_of(x)
    if lib == "numpy":
        return "host"
    if lib == "cupy":
        return "device"
    if lib == "torch":
        kind = x.device.type
        return "host" if kind == "cpu" else "device" if kind == "cuda" else "other"
    dl = getattr(x, "__dlpack_device__", None)
    if dl is not None:
        try:
            kind = int(dl()[0])
        except Exception:
            return "other"
        return "host" if kind == _DL_CPU else "device" if kind in (_DL_CUDA, _DL_CUDA_MANAGED) else "other"
    if hasattr(x, "__array__") or hasattr(x, "__array_interface__"):
        return "host"
    return "other"


def device_key(x):
    """A cheap hashable naming where ``x`` lives (part of the plan memo key): -1 for a NumPy array,
    the CUDA ordinal of a CuPy array, ``get_device()`` of a torch tensor (-1 on the CPU), else the
    ``__dlpack_device__`` pair."""
    t = type(x)
    if t is np.ndarray:
        return -1
    lib = _LIB_BY_TYPE.get(t) or library_of(x)
    if lib == "cupy":
        return x.data.device_id
    if lib == "torch":
        return x.get_device() if x.is_cuda else x.device.type
    dl = getattr(x, "__dlpack_device__", None)
    return tuple(int(v) for v in dl()) if dl is not None else -1


def dtype_name(x) -> str:
    """Canonical dtype name of an array from any supported library."""
    dt = x.dtype
    if library_of(x) == "torch":
        return str(dt).replace("torch.", "")
    return np.dtype(dt).name


def describe(x) -> Optional[ArrayInfo]:
    if x is None:
        return None
    return ArrayInfo(shape=tuple(int(d) for d in x.shape), dtype=dtype_name(x))


# -- module handles (imported once; these functions run on every call) ------------------------------

_cupy = None
_jax_convert = None


def _cp():
    global _cupy
    if _cupy is None:
        import cupy

        _cupy = cupy
    return _cupy


def _torch():
    return sys.modules["torch"]  # only reached with a torch object in hand, so torch is imported


def _jax_from_dlpack():
    global _jax_convert
    if _jax_convert is None:
        import jax.dlpack

        _jax_convert = jax.dlpack.from_dlpack
    return _jax_convert


def _what(x) -> str:
    lib = library_of(x)
    return {"numpy": "a NumPy (host) array", "torch": "a torch tensor",
            "other": f"a {type(x).__module__}.{type(x).__qualname__}"}.get(lib, f"a {lib} array")


# -- devices and zero-copy views --------------------------------------------------------------------

def device_of(x, name: str = "input") -> int:
    """The CUDA device ordinal of a device array; PagedAttentionError (naming ``name``) for a host array."""
    lib = library_of(x)
    if lib == "cupy":
        return x.data.device_id
    if lib == "torch":
        index = x.get_device()
        if index < 0:
            raise fail(name, f"a torch tensor on device '{x.device}'",
                       "a CUDA tensor (device inputs run on the GPU; NumPy inputs run the CPU reference)")
        return index
    if lib == "numpy":
        raise fail(name, "a NumPy (host) array",
                   "a device array like the other inputs: mixing CPU and GPU inputs is not allowed")
    dl = getattr(x, "__dlpack_device__", None)
    if dl is None:
        raise fail(name, _what(x), "a CuPy array or a CUDA array exposing __dlpack__ (PyTorch, JAX)")
    dev_type, dev_id = dl()
    if int(dev_type) not in (_DL_CUDA, _DL_CUDA_MANAGED):
        where = {_DL_CPU: "CPU", _DL_CUDA_HOST: "pinned host"}.get(int(dev_type), f"DLPack device type {int(dev_type)}")
        raise fail(name, f"a {lib} array in {where} memory", "an array in CUDA device memory")
    return int(dev_id)


_TORCH_TO_NUMPY: dict = {}


def _torch_numpy_dtype(tdt):
    """NumPy dtype of a CuPy view of a torch dtype (float8 -> uint8 bytes), or None if unmapped."""
    try:
        return _TORCH_TO_NUMPY[tdt]
    except KeyError:
        pass
    torch = _torch()
    if tdt.is_floating_point and tdt.itemsize == 1:
        npdt = np.dtype(np.uint8)
    elif tdt == torch.bfloat16:
        import ml_dtypes

        npdt = np.dtype(ml_dtypes.bfloat16)
    else:
        try:
            npdt = np.dtype(str(tdt).replace("torch.", ""))
        except TypeError:
            npdt = None
    _TORCH_TO_NUMPY[tdt] = npdt
    return npdt


_TorchMemory = None


def _torch_memory_class():
    global _TorchMemory
    if _TorchMemory is None:
        class TorchMemory(_cp().cuda.memory.UnownedMemory):
            """Device memory of a torch tensor (kept alive here); ``tensor`` is the tensor to give back."""

        _TorchMemory = TorchMemory
    return _TorchMemory


def _torch_view(t, device: int, owner=None):
    """A CuPy array over a contiguous torch tensor's memory (no DLPack, no copy).

    ``owner`` (default ``t``) is the tensor :func:`wrap_output` gives back for this view.
    """
    cp = _cupy or _cp()
    mem = (_TorchMemory or _torch_memory_class())(t.data_ptr(), t.nbytes, t, device)
    mem.tensor = t if owner is None else owner
    return cp.ndarray(t.shape, _torch_numpy_dtype(t.dtype), cp.cuda.MemoryPointer(mem, 0))


def _view(x, lib: str, name: str, device: int):
    """A zero-copy CuPy view of a device array already checked by device_of."""
    if lib == "cupy":
        return x
    if lib == "torch":
        given = x
        if x.requires_grad:
            x = x.detach()
        if x.is_contiguous() and _torch_numpy_dtype(x.dtype) is not None:
            return _torch_view(x, device, given)
        if x.dtype.is_floating_point and x.dtype.itemsize == 1:
            x = x.view(_torch().uint8)
    try:
        return _cp().from_dlpack(x)
    except (TypeError, BufferError, ValueError, RuntimeError) as exc:
        raise fail(name, f"{_what(x)} of dtype {x.dtype} that CuPy cannot view through DLPack ({exc})",
                   "a CUDA array CuPy can read zero-copy") from exc


def to_cupy(x, name: str = "input"):
    """A zero-copy CuPy view of one device array (None stays None; CuPy arrays are returned as they are).

    A torch float8 tensor is viewed as ``uint8`` (the e4m3 bytes); a tensor that requires grad is
    detached (same memory). Host arrays raise PagedAttentionError naming ``name``. Stream ordering
    is :func:`device_arrays`' job; this function adds none for torch tensors.
    """
    if x is None:
        return None
    lib = library_of(x)
    if lib == "cupy":
        return x
    return _view(x, lib, name, device_of(x, name))


# -- streams ----------------------------------------------------------------------------------------

class _StreamHandle:
    """A raw ``cudaStream_t`` presented through the CUDA stream protocol."""

    __slots__ = ("ptr", "owner")

    def __init__(self, ptr: int, owner=None):
        self.ptr = ptr
        self.owner = owner  # keeps a foreign stream object alive while its wrapper is cached

    def __cuda_stream__(self):
        return (0, self.ptr)


_STREAMS: dict = {}
_STREAMS_LOCK = threading.Lock()
_MAX_STREAMS = 256


def _wrap_stream(ptr: int, device_id: int, owner=None):
    """The cached CuPy stream object for a raw stream pointer on ``device_id``."""
    key = (ptr, device_id)
    s = _STREAMS.get(key)
    if s is not None:
        return s
    cp = _cp()
    if ptr == 0:
        s = cp.cuda.Stream.null
    elif ptr == 2:
        s = cp.cuda.Stream.ptds
    elif hasattr(cp.cuda.Stream, "from_external"):
        s = cp.cuda.Stream.from_external(_StreamHandle(ptr, owner))
    else:  # CuPy < 14
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            s = cp.cuda.ExternalStream(ptr, device_id)
    with _STREAMS_LOCK:
        if len(_STREAMS) >= _MAX_STREAMS:
            _STREAMS.clear()
        _STREAMS[key] = s
    return s


_raw_stream_fn = None


def _torch_stream_ptr(device: int) -> int:
    """PyTorch's current stream on ``device`` as a raw pointer (the fast private call when present)."""
    global _raw_stream_fn
    if _raw_stream_fn is None:
        torch = _torch()
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        _raw_stream_fn = raw if raw is not None else (lambda d: torch.cuda.current_stream(d).cuda_stream)
    return _raw_stream_fn(device)


_events = threading.local()


def _wait(consumer, producer, device: int) -> None:
    """Make ``consumer`` wait for the work queued so far on ``producer`` (no host sync; skipped in capture)."""
    if consumer.ptr == producer.ptr or consumer.is_capturing() or producer.is_capturing():
        return
    cache = getattr(_events, "by_device", None)
    if cache is None:
        cache = _events.by_device = {}
    ev = cache.get(device)
    if ev is None:
        cp = _cp()
        with cp.cuda.Device(device):
            ev = cache[device] = cp.cuda.Event(disable_timing=True)
    ev.record(producer)
    consumer.wait_event(ev)


def resolve_stream(stream=None, query=None):
    """The CuPy stream a call runs on.

    ``None``: PyTorch's current stream on the query's device for a torch ``query``, else CuPy's
    current stream. Otherwise a CuPy stream (returned as is), a ``torch.cuda.Stream``, any object
    with ``__cuda_stream__``, or an int ``cudaStream_t`` pointer (0 = the legacy default stream).
    Wrappers of foreign streams are cached by pointer, so a call creates no stream object.
    """
    cp = _cp()
    if stream is None:
        if query is not None and library_of(query) == "torch":
            index = device_of(query, "query")
            return _wrap_stream(_torch_stream_ptr(index), index)
        return cp.cuda.get_current_stream()
    if isinstance(stream, cp.cuda.stream._BaseStream):
        return stream
    if isinstance(stream, (bool, np.bool_)):
        raise fail("stream", repr(stream), "None, a CuPy or PyTorch stream, an object with __cuda_stream__, "
                   "or an int cudaStream_t pointer")
    device = device_of(query, "query") if query is not None and library_of(query) != "numpy" else None
    if device is None:
        device = cp.cuda.runtime.getDevice()
    if isinstance(stream, (int, np.integer)):
        if stream < 0:
            raise fail("stream", int(stream), "a cudaStream_t pointer >= 0")
        return _wrap_stream(int(stream), device)
    if type(stream).__module__.split(".")[0] == "torch" and hasattr(stream, "cuda_stream"):
        index = stream.device.index
        return _wrap_stream(int(stream.cuda_stream), device if index is None else index, owner=stream)
    protocol = getattr(stream, "__cuda_stream__", None)
    if protocol is not None:
        _, ptr = protocol()
        return _wrap_stream(int(ptr), device, owner=stream)
    raise fail("stream", f"a {type(stream).__module__}.{type(stream).__qualname__}",
               "None, a CuPy or PyTorch stream, an object with __cuda_stream__, or an int cudaStream_t pointer")


# -- inputs -----------------------------------------------------------------------------------------

def device_arrays(inputs: Mapping[str, Any], stream=None, *, skip=("attention_metadata",),
                  caches=CACHE_NAMES) -> tuple:
    """Zero-copy CuPy views of every device input, checked against contract §5.

    Parameters
    ----------
    inputs : mapping of input name to the user's object or None
        The first present input (``query``) fixes the device.
    stream : CuPy stream, optional
        The call's stream (from :func:`resolve_stream`); default CuPy's current stream. When torch
        tensors come in and it is not PyTorch's current stream, it first waits for that stream.
    skip : names left out (host inputs such as attention_metadata); they map to None.
    caches : names written in place: C-contiguous and not JAX arrays (immutable).

    Returns
    -------
    (dict, int)
        Input name -> ``cupy.ndarray`` or None, and the CUDA device ordinal of the call. Every
        returned array is C-contiguous and on that device. Violations raise PagedAttentionError
        naming the input.
    """
    dev = dict.fromkeys(inputs)
    present = [(n, x) for n, x in inputs.items() if x is not None and n not in skip]
    if not present:
        return dev, _cp().cuda.runtime.getDevice()
    first_name = present[0][0]
    device = None
    libs = []
    for name, x in present:
        lib = library_of(x)
        libs.append(lib)
        d = device_of(x, name)
        if device is None:
            device = d
        elif d != device:
            raise fail(name, f"an array on CUDA device {d}",
                       f"CUDA device {device} like {first_name}: all device inputs must be on one device")
        if lib == "jax" and name in caches:
            raise fail(name, "a JAX array", "a mutable array (CuPy or PyTorch): the cache is updated in place "
                       "and JAX arrays are immutable")
    has_torch = has_dlpack = False
    checked = set()  # views over contiguous torch tensors need no second look
    for (name, x), lib in zip(present, libs):
        if lib == "cupy":
            dev[name] = x
        elif lib == "torch":
            has_torch = True
            if x.is_contiguous():
                checked.add(name)
            dev[name] = _view(x, lib, name, device)
        else:
            has_dlpack = True
    if has_dlpack:  # JAX & co.: DLPack with the call's stream current, so the producer orders it
        cp = _cp()
        with cp.cuda.Device(device):
            if stream is not None:
                with stream:
                    for (name, x), lib in zip(present, libs):
                        if dev[name] is None:
                            dev[name] = _view(x, lib, name, device)
            else:
                for (name, x), lib in zip(present, libs):
                    if dev[name] is None:
                        dev[name] = _view(x, lib, name, device)
    for name, _ in present:
        a = dev[name]
        if name not in checked and not a.flags.c_contiguous:
            what = f"a non-contiguous array (shape {a.shape}, strides {a.strides})"
            if name in caches:
                raise fail(name, what, "a C-contiguous cache: it is written in place, where it lives")
            raise fail(name, what, "a C-contiguous array (make a contiguous copy first: .contiguous(), "
                       "ascontiguousarray)")
    if has_torch:
        consumer = stream if stream is not None else _cp().cuda.get_current_stream()
        torch_ptr = _torch_stream_ptr(device)
        if consumer.ptr != torch_ptr:
            _wait(consumer, _wrap_stream(torch_ptr, device), device)
    return dev, device


# -- outputs ----------------------------------------------------------------------------------------

_TORCH_DTYPES: dict = {}
_TORCH_DEVICES: dict = {}


def empty_output(shape: tuple, dtype: str, query, device_id: int):
    """A new, uninitialized C-contiguous output as a CuPy array, allocated by the library of ``query``.

    For a torch ``query`` the memory is a torch tensor (PyTorch's allocator and memory accounting;
    :func:`wrap_output` returns that tensor); otherwise CuPy's pool. ``dtype`` is a canonical name.
    """
    cp = _cp()
    if library_of(query) == "torch":
        torch = _torch()
        tdt = _TORCH_DTYPES.get(dtype)
        if tdt is None:
            tdt = _TORCH_DTYPES[dtype] = getattr(torch, dtype)
        tdev = _TORCH_DEVICES.get(device_id)
        if tdev is None:
            tdev = _TORCH_DEVICES[device_id] = torch.device("cuda", device_id)
        return _torch_view(torch.empty(shape, dtype=tdt, device=tdev), device_id)
    with cp.cuda.Device(device_id):
        return cp.empty(shape, dtype=numpy_dtype(dtype))


def numpy_dtype(name: str):
    """The NumPy dtype of a canonical dtype name (``"bfloat16"`` -> ml_dtypes.bfloat16)."""
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def check_out(out, shape: tuple, dtype, query, device_id: Optional[int] = None, name: str = "out"):
    """Check a preallocated ``out`` and return its zero-copy CuPy view (None stays None).

    ``out`` must be in the library of ``query`` (the call returns it as given), on the call's
    device, C-contiguous, of ``shape`` and of dtype ``dtype`` (a canonical name such as
    ``"float16"``, or a NumPy dtype). Every violation is a PagedAttentionError naming ``name``.
    """
    if out is None:
        return None
    want = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    lib, qlib = library_of(out), library_of(query)
    if lib == "jax":
        raise fail(name, "a JAX array", f"no {name}= with JAX inputs (JAX arrays are immutable)")
    if lib != qlib:
        raise fail(name, _what(out), f"a {qlib} array like query (the output is returned in query's library)")
    got_shape = tuple(int(d) for d in out.shape)
    if got_shape != tuple(shape):
        raise fail(name, f"shape {got_shape}", f"shape {tuple(shape)}")
    got = dtype_name(out)
    if got != want:
        raise fail(name, f"dtype {got}", f"dtype {want}")
    d = device_of(out, name)
    if device_id is None:
        device_id = device_of(query, "query")
    if d != device_id:
        raise fail(name, f"an array on CUDA device {d}", f"CUDA device {device_id} like the inputs")
    view = _view(out, lib, name, d)
    if not view.flags.c_contiguous:
        raise fail(name, f"a non-contiguous array (shape {view.shape}, strides {view.strides})",
                   "a C-contiguous array")
    return view


def wrap_output(arr, like, stream=None):
    """``arr`` (a CuPy array) in the library of ``like``: a torch tensor, a JAX array, or ``arr`` itself.

    A view made by :func:`empty_output` or :func:`check_out` over a torch tensor gives that tensor
    back (``out`` itself). ``stream`` is the stream the result was computed on: PyTorch's current
    stream waits for it when they differ; JAX's import runs with it current.
    """
    lib = library_of(like)
    if lib == "torch":
        mem = arr.data.mem
        tensor = getattr(mem, "tensor", None)
        if tensor is not None and arr.data.ptr == mem.ptr and arr.shape == tuple(tensor.shape):
            result = tensor
        elif stream is not None:
            with stream:
                result = _torch().from_dlpack(arr)
        else:
            result = _torch().from_dlpack(arr)
        if stream is not None:
            device = arr.data.device_id
            torch_ptr = _torch_stream_ptr(device)
            if stream.ptr != torch_ptr:
                _wait(_wrap_stream(torch_ptr, device), stream, device)
        return result
    if lib == "jax":
        if stream is None:
            return _jax_from_dlpack()(arr)
        with stream:
            return _jax_from_dlpack()(arr)
    return arr


# -- the per-call fast paths of the CUDA backends ---------------------------------------------------

_TENSOR_NAMES = None
_get_tensors = None
#: ``cupy.ndarray`` once seen to expose ``_c_contiguous`` (an identity test per call), else None.
_CUPY_NDARRAY = None
#: ``torch.Tensor`` once seen (an identity test per call), else None.
_TORCH_TENSOR = None


def reset_fast_types() -> None:
    """Forget the array types the fast paths recognized (tests swap in a fake CuPy)."""
    global _CUPY_NDARRAY, _TORCH_TENSOR
    _CUPY_NDARRAY = _TORCH_TENSOR = None


def _tensor_getter():
    global _TENSOR_NAMES, _get_tensors
    if _get_tensors is None:
        import operator

        from .contract import INPUT_NAMES

        _TENSOR_NAMES = tuple(n for n in INPUT_NAMES if n != "attention_metadata")
        _get_tensors = operator.itemgetter(*_TENSOR_NAMES)
    return _get_tensors


def fast_pointers(inputs: Mapping[str, Any], torch_ok: bool) -> Optional[tuple]:
    """``(library, device_id, ptrs)`` for the two cases a call takes without :func:`device_arrays`:

    - ``"cupy"``: every present input a C-contiguous ``cupy.ndarray`` (exactly that type) on one device;
    - ``"torch"`` (only when ``torch_ok``: the call runs on PyTorch's current stream): every present input
      a contiguous CUDA ``torch.Tensor`` (exactly that type) on one device.

    ``ptrs`` are the device pointers of the tensor inputs in ``INPUT_NAMES`` order (attention_metadata left
    out; 0 for an absent one). Anything else -- another library, a subclass, a second device, a
    non-contiguous array, no input at all -- returns None: the general path, which raises the errors.
    """
    global _CUPY_NDARRAY, _TORCH_TENSOR
    get = _get_tensors or _tensor_getter()
    qtype = type(inputs["query"])
    if qtype is _CUPY_NDARRAY or (_CUPY_NDARRAY is None and qtype.__name__ == "ndarray"
                                  and qtype.__module__.split(".")[0] == "cupy" and hasattr(qtype, "_c_contiguous")):
        _CUPY_NDARRAY = qtype
        ptrs, device = [], -1
        append = ptrs.append
        for x in get(inputs):
            if x is None:
                append(0)
                continue
            if type(x) is not qtype or not x._c_contiguous:  # flags.c_contiguous without a Flags object
                return None
            mem = x.data
            if mem.device_id != device:
                if device != -1:
                    return None
                device = mem.device_id
            append(mem.ptr)
        return None if device == -1 else ("cupy", device, ptrs)
    if torch_ok and (qtype is _TORCH_TENSOR or (qtype.__name__ == "Tensor" and qtype.__module__ == "torch")):
        _TORCH_TENSOR = qtype
        ptrs, device = [], -1
        append = ptrs.append
        for x in get(inputs):
            if x is None:
                append(0)
                continue
            if type(x) is not qtype or not x.is_cuda or not x.is_contiguous():
                return None
            d = x.get_device()
            if d != device:
                if device != -1:
                    return None
                device = d
            append(x.data_ptr())
        return None if device == -1 else ("torch", device, ptrs)
    return None


# -- host arrays of any library (the reference backend) ----------------------------------------------

def host_view(x, name: str, cache: bool = False) -> np.ndarray:
    """A zero-copy NumPy view of a CPU array of any supported library (None stays None).

    PyTorch CPU tensors (bfloat16 and float8 through same-size integer views), JAX CPU arrays, DLPack
    and ``__array__`` producers. ``cache``: the array is written in place, so it must be writeable
    (a JAX array is immutable: PagedAttentionError) and C-contiguous (checked by the reference).
    """
    if x is None:
        return None
    if type(x) is np.ndarray:
        return x
    lib = library_of(x)
    where = placement(x)
    if where == "device":
        raise fail(name, _what(x) + " in CUDA device memory",
                   "a CPU array like the other inputs: mixing CPU and GPU inputs is not allowed")
    if where != "host":
        raise fail(name, f"a {type(x).__module__}.{type(x).__qualname__}" + (
            f" on device '{x.device}'" if lib == "torch" else ""), "a CPU array NumPy can view, or a CUDA array")
    if lib == "torch":
        torch = _torch()
        t = x.detach()
        if t.dtype == torch.bfloat16:
            import ml_dtypes

            return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        if t.dtype.is_floating_point and t.dtype.itemsize == 1:
            import ml_dtypes

            fp8 = {torch.float8_e4m3fn: ml_dtypes.float8_e4m3fn}.get(t.dtype)
            if fp8 is None:
                raise fail(name, f"a torch tensor of dtype {t.dtype}", "float8_e4m3fn among the 8-bit floats")
            return t.view(torch.uint8).numpy().view(fp8)
        try:
            return t.numpy()
        except (TypeError, RuntimeError) as exc:
            raise fail(name, f"a torch tensor of dtype {t.dtype} NumPy cannot view ({exc})",
                       "a dtype NumPy can view zero-copy") from exc
    if lib == "jax" and cache:
        raise fail(name, "a JAX array", "a mutable array (NumPy or PyTorch): the cache is updated in place and "
                   "JAX arrays are immutable")
    if hasattr(x, "__dlpack__"):
        try:
            return np.from_dlpack(x)
        except (TypeError, BufferError, RuntimeError, ValueError):
            pass  # a producer NumPy's DLPack import refuses: its __array__ below
    view = np.asarray(x)
    if cache and not view.flags.writeable:
        raise fail(name, f"{_what(x)} NumPy sees read-only", "a writeable array: the cache is updated in place")
    return view


def to_host(x) -> Optional[np.ndarray]:
    """A NumPy copy (device arrays: copied back, which synchronizes) or view (host arrays) of ``x``;
    None stays None. For debugging checks only: never on a call's hot path."""
    if x is None:
        return None
    if placement(x) == "host":
        return host_view(x, "input")
    lib = library_of(x)
    if lib == "cupy":
        return x.get()
    if lib == "torch":
        return x.detach().cpu().numpy()
    return _cp().asnumpy(_cp().from_dlpack(x))


def host_out(out, like, shape: tuple, dtype: np.dtype, name: str = "out",
             shape_note: str = " (token_count, num_heads*v_head_size)") -> Optional[np.ndarray]:
    """The NumPy view of a preallocated CPU ``out`` in the library of ``like`` (None stays None),
    checked for library, shape, dtype, contiguity and writeability (PagedAttentionError naming ``name``;
    ``shape_note`` follows the expected shape in the message)."""
    if out is None:
        return None
    lib, qlib = library_of(out), library_of(like)
    if lib != qlib:
        raise fail(name, _what(out), f"a {qlib} array like query (the output is returned in query's library)")
    if lib == "jax":
        raise fail(name, "a JAX array", f"no {name}= with JAX inputs (JAX arrays are immutable)")
    view = host_view(out, name)
    if tuple(view.shape) != tuple(shape):
        raise fail(name, f"shape {tuple(view.shape)}", f"shape {tuple(shape)}{shape_note}")
    if view.dtype != dtype:
        like_query = " (the query's type)" if name == "out" else ""
        raise fail(name, f"dtype {dtype_name(out)}", f"dtype {np.dtype(dtype).name}{like_query}")
    if not view.flags.c_contiguous:
        raise fail(name, "a non-contiguous array", "a C-contiguous array")
    if not view.flags.writeable:
        raise fail(name, "a read-only array", "a writeable array")
    return view


def wrap_host(arr: np.ndarray, like, given=None):
    """``arr`` (a NumPy result) in the library of ``like``: ``given`` itself when it is the ``out`` the
    result was written into, a torch CPU tensor sharing ``arr``'s memory, a JAX array, or ``arr``."""
    if given is not None:
        return given
    lib = library_of(like)
    if lib == "torch":
        torch = _torch()
        if arr.dtype.name == "bfloat16":
            return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(arr)
    if lib == "jax":
        import jax.numpy as jnp

        return jnp.asarray(arr)
    return arr


# -- buffers that must not overlap ----------------------------------------------------------------------

def check_disjoint(input_nbytes: dict, pointer_of, out_ptr: int = 0, out_nbytes: int = 0, layout_separate=True,
                   interleaved_block_bytes: int = 0):
    """Raise PagedAttentionError when value_cache overlaps key_cache (SEPARATE layout: V would overwrite K),
    or when ``out`` (``out_ptr``/``out_nbytes``, 0 when not given) overlaps any input.

    ``input_nbytes``: :attr:`cupa.contract.Problem.input_nbytes`; ``pointer_of(name)``: the start address of
    an input (a device pointer, or a host address for NumPy views). ``interleaved_block_bytes`` (the bytes
    of one cache block, under ``Options(kv_pages_interleaved=True)``): caches whose starts differ by a
    non-zero whole number of blocks are accepted.
    """
    if layout_separate:
        n, nv = input_nbytes["key_cache"], input_nbytes.get("value_cache", input_nbytes["key_cache"])
        k, v = pointer_of("key_cache"), pointer_of("value_cache")
        if n and nv and k < v + nv and v < k + n and not (interleaved_block_bytes and k != v
                                                  and (v - k) % interleaved_block_bytes == 0):
            raise fail("value_cache", "memory overlapping key_cache" + (" (the same buffer)" if k == v else "")
                       + (" by a fraction of a block" if interleaved_block_bytes and k != v else ""),
                       "a cache of its own: K and V rows are written to separate caches (pages interleaved a whole "
                       "number of blocks apart: cupa.Options(kv_pages_interleaved=True))")
    if out_nbytes:
        for name, n in input_nbytes.items():
            p = pointer_of(name)
            if n and p < out_ptr + out_nbytes and out_ptr < p + n:
                raise fail("out", f"memory overlapping {name}", "an output buffer of its own (out= never aliases "
                           "an input)")
