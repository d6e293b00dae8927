"""What every CUDA backend does around its kernels: device inputs, stream, outputs, workspaces, launches.

Host time per call is most of the cost of a small decode step, so the steady state is kept short:

- :class:`Call` takes the all-CuPy and all-torch cases through :func:`cupa.arrays.fast_pointers`
  (no general machinery), reads every input's device pointer once (``Call.ptrs``), allocates the
  outputs (``output``; ``output_qk`` and ``lse`` when the call asks for them) in the library of
  ``query``, and enters the device or the stream only when they are not already current.
- :class:`Launcher` is one kernel launch built once per plan: the kernel, grid, block, shared memory
  and the scalar arguments (NumPy ``int32``/``float32``). A :class:`Sequence` of them (prologue, then
  attention) writes the scalars once into a per-thread buffer of 8-byte slots; a call writes only the
  pointers (one ``struct.pack_into``) and launches each kernel with ``cuLaunchKernel``, whose
  ``kernelParams`` is an array of pointers to each parameter's bytes (8 for a pointer, 4 for an
  ``int``/``float``): no C struct layout is involved. The driver copies the parameters before
  ``cuLaunchKernel`` returns (a graph capture copies them into the kernel node), so the buffer is
  reused by the next call; each thread has its own.
- :func:`workspace` makes one allocation for all of a call's workspaces.
- A step of a :class:`Sequence` marked *programmatic* (the attention kernel after the prologue) is
  launched with programmatic dependent launch when the Sequence is built with ``pdl=True``
  (:func:`pdl_allowed`: ``Options.programmatic_launch`` on compute capability 9.0+;
  ``cuLaunchKernelEx``, :mod:`cupa.kernels.driver`): its CTAs are scheduled while the previous kernel
  runs (that kernel executes ``griddepcontrol.launch_dependents``) and run their preamble (token
  lookup, block-table reads) until ``griddepcontrol.wait``, which a CTA executes before reading
  anything the previous kernel writes; at least one CTA of the grid executes it (so the grid never
  completes ahead of the previous kernel).

``Options(launch="rawkernel")`` launches through ``cupy.RawKernel.__call__`` instead, with the same
argument values: the reference route for A/B comparisons.
"""

from __future__ import annotations

import ctypes
import functools
import math
import struct
import threading

import numpy as np

from .. import _capture, arrays
from ..contract import INPUT_NAMES, Problem
from ..errors import fail
from . import driver

_TENSORS = tuple(n for n in INPUT_NAMES if n != "attention_metadata")
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
#: index of each tensor input in :attr:`Call.ptrs`
PTR_INDEX = {name: i for i, name in enumerate(_TENSORS)}
# Inputs read with 16-byte vector loads (contract: head_size % 8 == 0 keeps rows aligned).
_VECTOR_READ = ("query", "key", "value", "key_cache", "value_cache")
_VECTOR_READ_INDEX = tuple(PTR_INDEX[n] for n in _VECTOR_READ)
if _VECTOR_READ_INDEX != (0, 1, 2, 3, 4):  # Call checks ptrs[0..4] with one expression
    raise ImportError("cupa.kernels.launch: the vector-read inputs must be the first five inputs")

#: Launch routes (``Options.launch``).
LAUNCH_ROUTES = ("fast", "rawkernel")

_cupy = None

# -- programmatic dependent launch ----------------------------------------------------------------------

def pdl_allowed(device, options) -> bool:
    """Whether programmatic steps launch with programmatic dependent launch for these Options on ``device``
    (a :class:`cupa.device.DeviceInfo`): the fast route, ``programmatic_launch``, compute capability 9.0+
    and a driver with ``cuLaunchKernelEx``."""
    return (options.launch == "fast" and options.programmatic_launch and device.capability >= (9, 0)
            and driver.launch_kernel_ex() is not None)


def _compiled_for_pdl(kernel) -> bool:
    """Whether ``kernel`` (a ``cupy.RawKernel``) was compiled for compute capability 9.0+, where
    ``grid_dependency_wait()`` is ``griddepcontrol.wait`` and not compiled out (an NVRTC that caps
    ``-arch`` below the device's would otherwise leave a programmatic launch without its wait)."""
    try:
        return int(kernel.attributes["ptx_version"]) >= 90
    except Exception:
        return False


def _cp():
    global _cupy
    if _cupy is None:
        import cupy

        _cupy = cupy
    return _cupy


def _reset_module_cache() -> None:
    """Forget the imported CuPy module (tests swap in a fake one)."""
    global _cupy
    _cupy = None
    arrays.reset_fast_types()


# -- one call ------------------------------------------------------------------------------------------

class Call:
    """Device views of one call's inputs, its stream and outputs.

    Attributes
    ----------
    dev : dict
        Input name -> CuPy array or None (built on first use where the inputs are not CuPy arrays).
    ptrs : list of int
        Device pointer of every tensor input in ``INPUT_NAMES`` order (attention_metadata left out;
        0 for an absent input); :data:`PTR_INDEX` maps names to positions.
    stream : CuPy stream
        The stream the call runs on; ``with call:`` makes it (and the call's device) current.
    output : CuPy array
        The output (a view of the user's ``out`` when given; built on first use for a torch ``out``).
    output_ptr : int
        The output's device pointer.
    qk_ptr, lse_ptr : int
        Device pointers of ``output_qk`` (H, N, kv_capacity) float32 and ``lse`` (N, H) float32 when the
        call asks for them (``qk_output != 0``, ``return_lse``), else 0. Their content is the kernels' to write.

    ``options`` (the plan's :class:`cupa.Options`) says whether interleaved K/V pages are allowed.

    Two fast cases skip :func:`arrays.device_arrays` (see :func:`arrays.fast_pointers`): every present
    input a C-contiguous ``cupy.ndarray`` on one device, and every present input a contiguous CUDA
    ``torch.Tensor`` on one device with ``stream=None`` (the call runs on PyTorch's current stream;
    pointers come from ``data_ptr()``, and no CuPy view is made unless a backend asks for ``dev`` or
    ``output``).
    """

    def __init__(self, problem: Problem, inputs: dict, out, stream, options=None):
        cupy = _cupy or _cp()
        self.cupy = cupy
        self.problem = problem
        query = self.query = inputs["query"]
        cuda = cupy.cuda
        current = cuda.get_current_stream()
        self._out = out
        fast = arrays.fast_pointers(inputs, stream is None)
        if fast is not None and fast[0] == "cupy":
            self.stream = current if stream is None else arrays.resolve_stream(stream, query)
        else:
            self.stream = arrays.resolve_stream(stream, query)
        if fast is None:  # other libraries, several devices, a violation: the general path (and its errors)
            dev, device_id = arrays.device_arrays({n: inputs[n] for n in _TENSORS}, self.stream)
            self._dev = dev
            self._lazy = None
            ptrs = [0 if dev[n] is None else dev[n].data.ptr for n in _TENSORS]
        else:
            self._dev = None  # built on first use from inputs
            self._inputs = inputs
            self._lazy, device_id, ptrs = fast
        self._all_cupy = self._lazy == "cupy"
        self.device_id, self.ptrs = device_id, ptrs
        if (ptrs[0] | ptrs[1] | ptrs[2] | ptrs[3] | ptrs[4]) & 15:
            for i in _VECTOR_READ_INDEX:
                if ptrs[i] % 16:
                    raise fail(_TENSORS[i], f"a device pointer at {ptrs[i]:#x}", "16-byte alignment (vector loads)")
        nbytes = problem.input_nbytes
        if not problem.latent:
            n, nv, k, v = nbytes["key_cache"], nbytes["value_cache"], ptrs[3], ptrs[4]
            if n and nv and k < v + nv and v < k + n:
                arrays.check_disjoint(nbytes, lambda name: ptrs[PTR_INDEX[name]],
                                      interleaved_block_bytes=problem.cache_block_bytes
                                      if options is not None and options.kv_pages_interleaved else 0)
        self._device = None
        set_device = self._set_device = cuda.runtime.getDevice() != device_id
        # Another device: its own current stream; enter both. Same device: enter the stream if not current.
        self._set_stream = set_device or self.stream.ptr != current.ptr
        self._output = None
        shape = problem.output_shape
        if out is None:
            output = self._new(shape, problem.dtype)
            self._output, self.output_ptr = output, output.data.ptr
        elif (self._all_cupy and type(out) is type(query) and out._c_contiguous and out.dtype == query.dtype
              and out.data.device_id == device_id and out.shape == shape):
            self._output, self.output_ptr = out, out.data.ptr  # what arrays.check_out returns here
        elif (self._lazy == "torch" and type(out) is type(query) and out.is_cuda and out.is_contiguous()
              and out.dtype == query.dtype and out.get_device() == device_id and out.shape == shape):
            self.output_ptr = out.data_ptr()  # the CuPy view (output) is made only if a backend asks
        else:
            self._output = arrays.check_out(out, shape, problem.dtype, query, device_id)
            self.output_ptr = self._output.data.ptr
        if out is not None:
            arrays.check_disjoint(nbytes, lambda name: ptrs[PTR_INDEX[name]], self.output_ptr,
                                  math.prod(shape) * _ITEMSIZE[problem.dtype], layout_separate=False)
        a = problem.attrs
        self._qk = self._new(problem.output_qk_shape, "float32") if a.qk_output else None
        self._lse = self._new(problem.lse_shape, "float32") if a.return_lse else None
        self.qk_ptr = 0 if self._qk is None else self._qk.data.ptr
        self.lse_ptr = 0 if self._lse is None else self._lse.data.ptr

    def _new(self, shape: tuple, dtype: str):
        """A new output of the call (CuPy view), allocated by the library of ``query`` on the call's device."""
        with self:
            if self._all_cupy:
                arr = self.cupy.empty(shape, dtype=arrays.numpy_dtype(dtype))
            else:
                arr = arrays.empty_output(shape, dtype, self.query, self.device_id)
        if _capture.ACTIVE[0]:
            _capture.keep_alive(arr)  # a captured graph writes it at every replay
        return arr

    @property
    def output(self):
        """The output as a CuPy array (a view of the user's ``out`` when given)."""
        if self._output is None:
            self._output = arrays.check_out(self._out, self.problem.output_shape, self.problem.dtype, self.query,
                                            self.device_id)
        return self._output

    @property
    def output_qk(self):
        """``output_qk`` as a CuPy array (None unless the call asks for it)."""
        return self._qk

    @property
    def lse(self):
        """``lse`` as a CuPy array (None unless the call asks for it)."""
        return self._lse

    @property
    def dev(self) -> dict:
        """Input name -> CuPy array or None (attention_metadata left out)."""
        if self._dev is None:
            if self._lazy == "cupy":
                self._dev = {n: self._inputs[n] for n in _TENSORS}
            else:
                self._dev = arrays.device_arrays({n: self._inputs[n] for n in _TENSORS}, self.stream)[0]
        return self._dev

    @property
    def device(self):
        """The call's ``cupy.cuda.Device``."""
        if self._device is None:
            self._device = self.cupy.cuda.Device(self.device_id)
        return self._device

    def __enter__(self):
        if self._set_device:
            self.device.__enter__()
        if self._set_stream:
            self.stream.__enter__()
        return self

    def __exit__(self, *exc):
        if self._set_stream:
            self.stream.__exit__(*exc)
        if self._set_device:
            self._device.__exit__(*exc)

    def finish(self):
        """The outputs in the library of ``query``: ``output`` (the user's ``out`` itself when given), then
        ``output_qk`` and ``lse`` when the call asks for them, as a tuple in that order."""
        if self._all_cupy:
            output = self._output
        elif self._lazy == "torch" and self._out is not None:
            output = self._out  # on PyTorch's current stream already: nothing to order
        else:
            output = arrays.wrap_output(self.output, like=self.query, stream=self.stream)
        if self._qk is None and self._lse is None:
            return output
        extra = tuple(x if self._all_cupy else arrays.wrap_output(x, like=self.query, stream=self.stream)
                      for x in (self._qk, self._lse) if x is not None)
        return (output, *extra)


#: ``prepare(problem, inputs, out, stream) -> Call``: the :class:`Call` of one backend run (the class
#: itself, so a call costs no extra frame).
prepare = Call


# -- workspaces ------------------------------------------------------------------------------------------

WORKSPACE_ALIGN = 256


def align(nbytes: int, to: int = WORKSPACE_ALIGN) -> int:
    return -(-nbytes // to) * to


class Workspace:
    """One device allocation of a call (``ptr``, ``nbytes``); carved into the call's workspaces."""

    __slots__ = ("memptr", "ptr", "nbytes")

    def __init__(self, memptr, nbytes: int):
        self.memptr, self.ptr, self.nbytes = memptr, memptr.ptr, nbytes

    def __repr__(self) -> str:
        return f"Workspace(ptr={self.ptr:#x}, nbytes={self.nbytes})"


def workspace(nbytes: int) -> Workspace:
    """``nbytes`` of device memory from CuPy's current allocator, on the current device and stream.

    Run it inside ``with call:`` (CuPy's pool hands a freed block back only on the stream it was
    allocated on). Registered with :func:`cupa._capture.keep_alive`, as every allocation of a call.
    """
    ws = Workspace((_cupy or _cp()).cuda.alloc(nbytes), nbytes)
    if _capture.ACTIVE[0]:   # what keep_alive() tests first, without the call when no capture is active
        _capture.keep_alive(ws)
    return ws


# -- launches --------------------------------------------------------------------------------------------

class _Pointer:
    __slots__ = ()

    def __repr__(self) -> str:
        return "POINTER"


#: A pointer argument of a :class:`Launcher`, given at each launch.
POINTER = _Pointer()


class _TensorMap:
    __slots__ = ()

    def __repr__(self) -> str:
        return "TENSOR_MAP"


#: A 128-byte by-value argument of a :class:`Launcher` (a ``const __grid_constant__`` tensor map,
#: :mod:`cupa.kernels.tma`), given at each launch as ``bytes``.
TENSOR_MAP = _TensorMap()
#: Its size in bytes (CUtensorMap).
TENSOR_MAP_BYTES = 128

_SCALAR_TYPES = (np.int32, np.uint32, np.float32, np.int64, np.uint64)


class Launcher:
    """One kernel launch with fixed geometry and scalar arguments; pointers are given per launch.

    Parameters
    ----------
    kernel : cupy.RawKernel
        The compiled kernel (from :func:`cupa.jit.get_kernel` on the device the launcher serves).
    grid, block : tuple of int
    args : tuple
        The kernel's parameters in order: :data:`POINTER` where a device pointer goes (given at each
        launch, in order), :data:`TENSOR_MAP` where a 128-byte tensor map goes (given at each launch,
        in order), else a NumPy ``int32``/``uint32``/``float32`` (4 bytes) or ``int64``/``uint64``
        (8 bytes) scalar matching the C parameter type.
    shared_mem : int
        Dynamic shared memory in bytes (raise the kernel's limit first above 48 KB).
    """

    __slots__ = ("kernel", "grid", "block", "shared_mem", "args", "pointer_positions", "map_positions", "_single")

    def __init__(self, kernel, grid: tuple, block: tuple, args: tuple, shared_mem: int = 0):
        # CuPy's Function launches max(1, n) along every axis; both routes do the same.
        grid = tuple(max(1, int(g)) for g in tuple(grid) + (1,) * (3 - len(grid)))
        block = tuple(max(1, int(b)) for b in tuple(block) + (1,) * (3 - len(block)))
        for i, a in enumerate(args):
            if a is not POINTER and a is not TENSOR_MAP and type(a) not in _SCALAR_TYPES:
                raise TypeError(f"Launcher argument {i}: got {type(a).__name__}; expected POINTER, TENSOR_MAP or "
                                "a NumPy int32/uint32/float32/int64/uint64 scalar (its size must match the C "
                                "parameter)")
        self.kernel = kernel
        self.grid, self.block, self.shared_mem = grid, block, int(shared_mem)
        self.args = tuple(args)
        self.pointer_positions = tuple(i for i, a in enumerate(args) if a is POINTER)
        self.map_positions = tuple(i for i, a in enumerate(args) if a is TENSOR_MAP)
        self._single = None

    def __call__(self, pointers, stream_ptr: int, maps=()) -> None:
        """Launch with ``pointers`` (ints, one per :data:`POINTER`, 0 for null) and ``maps`` (128-byte
        ``bytes``, one per :data:`TENSOR_MAP`) on ``stream_ptr`` (the rawkernel route launches on
        CuPy's current stream: make it the same)."""
        if self._single is None:
            self._single = Sequence([(self, range(len(self.pointer_positions)))], len(self.pointer_positions))
        self._single(pointers, stream_ptr, maps)

    def rawkernel_args(self, pointers, maps=(), keep=None) -> tuple:
        """The argument tuple of ``cupy.RawKernel.__call__``: pointers as NumPy ``uint64`` (8 bytes), tensor
        maps as ``cupy.cuda.function.CPointer`` to a copy of their bytes, which is appended to ``keep`` (a
        list the caller holds until the launch is made)."""
        args = list(self.args)
        for i, p in zip(self.pointer_positions, pointers):
            args[i] = np.uint64(p)
        if self.map_positions:
            if len(maps) != len(self.map_positions) or keep is None:
                raise ValueError(f"Launcher: {len(self.map_positions)} tensor maps and a keep list expected")
            function = _cp().cuda.function
            for i, m in zip(self.map_positions, maps):
                held = np.frombuffer(bytes(m), dtype=np.uint8).copy()
                keep.append(held)
                args[i] = function.CPointer(held.ctypes.data)
        return tuple(args)


class Sequence:
    """Kernels launched back to back on one stream, their pointer arguments drawn from one list.

    Parameters
    ----------
    steps : list of (Launcher, indices) or (Launcher, indices, programmatic)
        ``indices[j]``: the position in the pointer list of the launcher's j-th :data:`POINTER`.
        ``programmatic`` (default False): the kernel executes ``grid_dependency_wait()`` (common.cuh)
        in every CTA that reads what the previous step writes, before it does, and in at least one
        CTA, so it may be launched with programmatic dependent launch (see the module docstring).
    npointers : int
        Length of the pointer list given at each launch.
    route : {"fast", "rawkernel"}
        ``Options.launch``.
    pdl : bool
        Launch the programmatic steps with programmatic dependent launch (:func:`pdl_allowed`).

    The fast route keeps, per thread, one buffer of 8-byte slots: the pointer list first (written at
    each launch with one ``struct.pack_into``), then every launcher's scalars (written once), then
    128 bytes (64-byte aligned) per :data:`TENSOR_MAP` argument, in order over the steps (written at
    each launch, from the ``maps`` given); each launcher's ``kernelParams`` table points at its
    parameters' slots (a pointer used by several kernels is one slot).
    """

    __slots__ = ("steps", "programmatic", "npointers", "nmaps", "fast", "pdl", "_pack", "_tls")

    def __init__(self, steps, npointers: int, route: str = "fast", pdl: bool = False):
        if route not in LAUNCH_ROUTES:
            raise ValueError(f"Sequence: route {route!r} is not one of {LAUNCH_ROUTES}")
        self.fast = route == "fast"
        self.pdl = bool(pdl) and self.fast
        self.steps = [(step[0], tuple(int(i) for i in step[1])) for step in steps]
        self.programmatic = tuple(len(step) > 2 and bool(step[2]) for step in steps)
        for launcher, indices in self.steps:
            if len(indices) != len(launcher.pointer_positions) or any(not 0 <= i < npointers for i in indices):
                raise ValueError("Sequence: each launcher needs one index in [0, npointers) per POINTER")
        self.npointers = int(npointers)
        self.nmaps = sum(len(launcher.map_positions) for launcher, _ in self.steps)
        self._pack = struct.Struct(f"={self.npointers}Q").pack_into
        self._tls = threading.local()

    def _thread_buffers(self):
        cp = _cp()
        # CuPy's RawKernel makes the device's context current on a new thread (a runtime call) before its
        # first driver launch; do the same where no context is current yet.
        if cp.cuda.driver.ctxGetCurrent() == 0:
            cp.cuda.runtime.memGetInfo()
        nscalars = sum(len(launcher.args) - len(launcher.pointer_positions) - len(launcher.map_positions)
                       for launcher, _ in self.steps)
        map_slots = TENSOR_MAP_BYTES // 8
        values = np.zeros(max(1, self.npointers + nscalars + (self.nmaps + 1) * map_slots), dtype=np.uint64)
        raw = values.view(np.uint8)
        base = values.ctypes.data
        slot = self.npointers
        maps_at = base + 8 * (self.npointers + nscalars)
        maps_at += -maps_at % 64  # (the driver copies each parameter's bytes; aligned like a CUtensorMap anyway)
        next_map = 0
        launches, tables = [], []
        check = getattr(cp.cuda.driver, "check_status", None)
        for (launcher, indices), programmatic in zip(self.steps, self.programmatic):
            table = np.zeros(max(1, len(launcher.args)), dtype=np.uint64)
            pointer = iter(indices)
            for i, a in enumerate(launcher.args):
                if a is POINTER:
                    table[i] = base + 8 * next(pointer)
                elif a is TENSOR_MAP:
                    table[i] = maps_at + TENSOR_MAP_BYTES * next_map
                    next_map += 1
                else:
                    raw[8 * slot:8 * slot + a.itemsize] = np.frombuffer(a.tobytes(), dtype=np.uint8)
                    table[i] = base + 8 * slot
                    slot += 1
            tables.append(table)
            if self.pdl and programmatic and _compiled_for_pdl(launcher.kernel):
                fn = driver.programmatic_launcher(launcher.kernel.kernel.ptr, launcher.grid, launcher.block,
                                                  launcher.shared_mem, table.ctypes.data, check)
            else:
                fn = functools.partial(cp.cuda.driver.launchKernel, launcher.kernel.kernel.ptr, *launcher.grid,
                                       *launcher.block, launcher.shared_mem)
            launches.append((fn, table.ctypes.data))
        buffers = (values, tuple(launches), tables, maps_at)  # tables: kept alive with the values
        self._tls.buffers = buffers
        return buffers

    def __call__(self, pointers, stream_ptr: int, maps=()) -> None:
        """Launch every step in order; ``pointers``: the pointer list (ints, 0 for null); ``maps``: one
        128-byte ``bytes`` per :data:`TENSOR_MAP` argument, in order over the steps."""
        if len(maps) != self.nmaps:
            raise ValueError(f"Sequence: {self.nmaps} tensor maps expected, got {len(maps)}")
        if self.fast:
            try:
                values, launches, _, maps_at = self._tls.buffers
            except AttributeError:
                values, launches, _, maps_at = self._thread_buffers()
            self._pack(values, 0, *pointers)
            for j, m in enumerate(maps):
                if len(m) != TENSOR_MAP_BYTES:
                    raise ValueError(f"Sequence: tensor map {j} has {len(m)} bytes; expected {TENSOR_MAP_BYTES}")
                ctypes.memmove(maps_at + TENSOR_MAP_BYTES * j, m, TENSOR_MAP_BYTES)
            for fn, table in launches:
                fn(stream_ptr, table, 0)
        else:
            keep, first = [], 0
            for launcher, indices in self.steps:
                k = len(launcher.map_positions)
                launcher.kernel(launcher.grid, launcher.block,
                                launcher.rawkernel_args([pointers[i] for i in indices], maps[first:first + k], keep),
                                shared_mem=launcher.shared_mem)
                first += k


_SHARED_CONFIGURED: dict = {}


def ensure_shared_memory(kernel, nbytes: int) -> None:
    """Raise a kernel's dynamic shared-memory limit once (needed above 48 KB)."""
    key = id(kernel)
    if _SHARED_CONFIGURED.get(key, 0) < nbytes:
        kernel.max_dynamic_shared_size_bytes = nbytes
        _SHARED_CONFIGURED[key] = nbytes
