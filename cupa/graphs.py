"""CUDA graphs: capture a decode step (cupa calls plus the caller's own CuPy/PyTorch work) and replay it.

``cupa.capture_graph(step)`` runs ``step()`` eagerly ``warmup`` times on a capture stream (so every
kernel is compiled and every launch configured), then captures one more ``step()`` into a
``cupy.cuda.Graph`` and returns a :class:`CapturedGraph`: ``g.replay()`` re-runs the whole step with
one ``cudaGraphLaunch``, reading whatever the input buffers hold at replay time.

What a graph freezes (see docs/graphs.md): every device pointer (inputs must be updated *in place*;
outputs allocated inside the capture are the same buffers at every replay), every shape, and every
host value read at capture -- in particular ``attention_metadata``, which must therefore be a
replay-wide bound (contract §4.5), e.g. ``[1, max_model_len]``, never the current step's lengths.

Memory: everything allocated while the capture runs comes from a private ``cupy.cuda.MemoryPool``
owned by the returned object (and, when PyTorch is in use, a private ``torch.cuda.MemPool``), so no
address the graph touches can be handed to another array while the graph lives, whatever ``step()``
allocated or freed. cupa's CUDA backends also register their own allocations through
:func:`keep_alive` (a no-op outside a capture), which is what keeps them alive when the caller's
allocator is used (``pool="current"``) or the capture is driven by someone else
(:func:`capture_scope` around ``torch.cuda.graph``).

Failures raise :class:`GraphCaptureError` (a ``RuntimeError``) and leave the stream usable: a host
synchronization inside ``step()`` (``.item()``, ``cupy.asnumpy``, ``stream.synchronize()``...), a
kernel that would be compiled inside the capture (run a warm-up first), a ``MemoryAsyncPool`` as the
capture's allocator, capturing on the legacy default stream, or no usable CUDA device.

This module imports without CuPy or a GPU; CuPy is imported when a capture starts.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from typing import Any, Callable, Optional

__all__ = [
    "capture_graph", "CapturedGraph", "GraphCaptureError", "capture_scope", "CaptureScope",
    "keep_alive", "capture_active", "check_compile_allowed",
]


from ._capture import (GraphCaptureError, activate_scope, active_scope, capture_active, check_compile_allowed,
                       deactivate_scope, keep_alive)


# -- helpers ------------------------------------------------------------------------------------------

def _cupy():
    """CuPy with a usable device, or GraphCaptureError saying why not."""
    try:
        import cupy
    except ImportError as exc:
        raise GraphCaptureError("cupa.capture_graph needs CuPy and a CUDA device; CuPy is not installed "
                                "(pip install 'cupa[cuda13]' or 'cupa[cuda12]')") from exc
    try:
        ok = cupy.cuda.is_available()
    except Exception:  # a broken driver install
        ok = False
    if not ok:
        raise GraphCaptureError("cupa.capture_graph needs a usable CUDA device; cupy.cuda.is_available() is "
                                "False (no GPU or no driver). CUDA graphs exist only on the GPU: the NumPy "
                                "reference backend has nothing to capture")
    return cupy


def _torch_module(use_torch, stream_arg):
    """The torch module when the capture should also drive PyTorch's current stream, else None."""
    if use_torch is False:
        return None
    torch = sys.modules.get("torch")
    from_torch_stream = stream_arg is not None and type(stream_arg).__module__.split(".")[0] == "torch"
    if torch is None:
        if use_torch:
            raise GraphCaptureError("use_torch=True but PyTorch is not imported")
        return None
    if use_torch is None and not from_torch_stream:
        try:
            ok = torch.cuda.is_available()
        except Exception:
            ok = False
        if not ok:
            return None
    return torch


_CAPTURE_STATUS = range(900, 909)  # cudaErrorStreamCapture* and cudaErrorCapturedEvent, WrongThread


def _is_capture_error(exc: BaseException) -> bool:
    """Did the CUDA runtime refuse an operation because of the capture (a host sync, an illegal call)?"""
    status = getattr(exc, "status", None)
    if isinstance(status, int) and status in _CAPTURE_STATUS:
        return True
    text = str(exc).lower()
    return ("capture" in text or "capturing" in text) and ("stream" in text or "cuda" in text)


def _abandon(stream) -> None:
    """End a capture that failed (or that step() left by raising) and drop its graph; never raises."""
    try:
        stream.end_capture()  # an invalidated capture raises here; a valid partial graph is discarded
    except Exception:
        pass


def _resolve_pool(cp, pool):
    """The MemoryPool the capture allocates from, or None for the caller's current allocator."""
    async_pool = getattr(cp.cuda, "MemoryAsyncPool", None)
    if isinstance(pool, str) and pool == "private":
        return cp.cuda.MemoryPool()
    if isinstance(pool, str) and pool == "current":
        alloc = cp.cuda.get_allocator()
        owner = getattr(alloc, "__self__", None)
        if (async_pool is not None and isinstance(owner, async_pool)) or \
                alloc is getattr(cp.cuda.memory, "malloc_async", object()):
            raise GraphCaptureError(
                "pool='current': CuPy's current allocator is a cupy.cuda.MemoryAsyncPool (cudaMallocAsync). "
                "Allocations captured from it become graph memory nodes that the second replay rejects "
                "(cudaErrorInvalidValue). Use pool='private' (the default: a cupy.cuda.MemoryPool owned by "
                "the graph) or make a cupy.cuda.MemoryPool the allocator for the capture")
        if isinstance(owner, cp.cuda.MemoryPool):
            return None
        raise GraphCaptureError(
            f"pool='current': CuPy's current allocator is {alloc!r}, not a cupy.cuda.MemoryPool: memory a "
            "capture frees would go back to the driver (or to an allocator cupa cannot reason about) while "
            "the graph still uses it. Use pool='private' (the default)")
    if async_pool is not None and isinstance(pool, async_pool):
        raise GraphCaptureError("pool: got a cupy.cuda.MemoryAsyncPool; captured cudaMallocAsync allocations "
                                "break on the second replay. Give a cupy.cuda.MemoryPool or 'private'")
    if isinstance(pool, cp.cuda.MemoryPool):
        return pool
    raise TypeError(f"pool: got {pool!r}; expected 'private', 'current' or a cupy.cuda.MemoryPool")


# -- the scope: what is active while a capture runs ------------------------------------------------------

class CaptureScope:
    """What is in force on this thread while a capture runs (see :func:`capture_scope`).

    Attributes
    ----------
    kept : list
        Every buffer cupa allocated inside the scope (outputs and workspaces); keep the scope alive
        as long as the graph.
    pool : cupy.cuda.MemoryPool or None
        The pool CuPy allocations were routed to (None: the caller's allocator was left in place).
    torch_pool : torch.cuda.MemPool or None
        The pool PyTorch allocations on this thread were routed to, when PyTorch was in use.
    """

    def __init__(self, pool="private", use_torch: Optional[bool] = None):
        self._pool_arg = pool
        self._use_torch = use_torch
        self.kept: list = []
        self.pool = None
        self.torch_pool = None
        self._stack: Optional[contextlib.ExitStack] = None

    def keep(self, objs) -> None:
        self.kept.extend(o for o in objs if o is not None)

    def __enter__(self) -> "CaptureScope":
        if active_scope() is not None:
            raise GraphCaptureError("a capture is already active on this thread (capture_graph or capture_scope "
                                    "called from inside step() of another capture): nested captures are not "
                                    "supported")
        if self._stack is not None:
            raise GraphCaptureError("this CaptureScope is already in use")
        cp = _cupy()
        stack = contextlib.ExitStack()
        try:
            self.pool = _resolve_pool(cp, self._pool_arg)
            if self.pool is not None:
                stack.enter_context(cp.cuda.using_allocator(self.pool.malloc))
            torch = _torch_module(self._use_torch, None)
            if torch is not None:
                mem_pool = getattr(torch.cuda, "MemPool", None)
                use_pool = getattr(torch.cuda, "use_mem_pool", None)
                if mem_pool is not None and use_pool is not None:
                    self.torch_pool = mem_pool()
                    stack.enter_context(use_pool(self.torch_pool))
                else:
                    warnings.warn("cupa.capture_graph: this PyTorch has no torch.cuda.MemPool/use_mem_pool; "
                                  "PyTorch temporaries freed inside step() go back to PyTorch's shared cache "
                                  "while the graph still uses them. Keep step()'s torch work allocation-free "
                                  "(in-place ops, out=) or capture with torch.cuda.graph and capture_scope()",
                                  RuntimeWarning, stacklevel=3)
            activate_scope(self)
            stack.callback(deactivate_scope)
        except BaseException:
            stack.close()
            raise
        self._stack = stack
        return self

    def __exit__(self, *exc) -> bool:
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()
        return False


def capture_scope(pool="private", use_torch: Optional[bool] = False) -> CaptureScope:
    """A context in which a CUDA-graph capture made by someone else is safe for cupa calls.

    For captures that :func:`capture_graph` does not drive -- ``torch.cuda.graph``, or a raw
    ``stream.begin_capture()``. Inside it, on this thread: cupa registers every buffer it allocates
    in ``scope.kept``; CuPy allocations come from ``scope.pool`` (a private ``cupy.cuda.MemoryPool``
    with the default ``pool="private"``); a kernel that is not compiled yet raises
    :class:`GraphCaptureError` instead of compiling. Keep the scope object alive as long as the graph.
    ``use_torch=True`` also routes this thread's PyTorch allocations to a private ``torch.cuda.MemPool``
    (leave it False under ``torch.cuda.graph``, which routes them to its own graph pool).

    Examples
    --------
    PyTorch drives the capture (its own memory pool and RNG bookkeeping); warm up first, and use
    ``capture_error_mode="relaxed"`` so that CuPy may grow its pool inside the capture::

        op(q, k, v, kc, vc, cum, past, bt, attention_metadata=[1, max_len])      # warm-up (compiles)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with cupa.graphs.capture_scope() as scope, \\
                torch.cuda.graph(graph, capture_error_mode="relaxed"):
            out = op(q, k, v, kc, vc, cum, past, bt, attention_metadata=[1, max_len])
        graph.replay()   # keep `scope` (and `out`) alive as long as `graph`
    """
    return CaptureScope(pool=pool, use_torch=use_torch)


# -- the captured graph ---------------------------------------------------------------------------------

class CapturedGraph:
    """One captured step. Returned by :func:`capture_graph`; replay it with :meth:`replay`.

    Attributes
    ----------
    graph : cupy.cuda.Graph
        The instantiated graph (None after :meth:`close`).
    stream : cupy.cuda.Stream
        The capture stream; :meth:`replay` launches there by default.
    outputs : object
        What the captured ``step()`` returned (for example each layer's output array): the same
        buffers at every replay, overwritten by each one.
    kept : list
        Buffers cupa allocated during the capture (outputs and workspaces), held for the graph.
    pool : cupy.cuda.MemoryPool or None
        The private pool the capture allocated from (None with ``pool="current"``).
    device_id : int
        The CUDA device of the capture.
    """

    def __init__(self, graph, stream, outputs, scope: CaptureScope, torch, device_id: int):
        self.graph = graph
        self.stream = stream
        self.outputs = outputs
        self.kept = scope.kept
        self.pool = scope.pool
        self.torch_pool = scope.torch_pool
        self.device_id = device_id
        self._torch = torch
        self._events = None

    @property
    def closed(self) -> bool:
        return self.graph is None

    @property
    def nbytes(self) -> int:
        """Bytes held by the private CuPy pool (0 with ``pool="current"``)."""
        return 0 if self.pool is None else int(self.pool.total_bytes())

    def __repr__(self) -> str:
        if self.graph is None:
            return "CapturedGraph(closed)"
        return (f"CapturedGraph(stream={self.stream.ptr:#x}, device={self.device_id}, kept={len(self.kept)} "
                f"buffers, private pool {self.nbytes / 2**20:.1f} MiB)")

    def _caller_streams(self, launch_stream) -> list:
        """The caller's current streams (CuPy's; PyTorch's too for a torch capture) other than ``launch_stream``."""
        import cupy

        from . import arrays

        found = []
        cur = cupy.cuda.get_current_stream()
        if cur.ptr != launch_stream.ptr:
            found.append(cur)
        if self._torch is not None:
            tptr = arrays._torch_stream_ptr(self.device_id)
            if tptr != launch_stream.ptr and tptr != cur.ptr:
                found.append(arrays._wrap_stream(tptr, self.device_id))
        return found

    def replay(self, stream=None) -> None:
        """Launch the graph; no host synchronization.

        Parameters
        ----------
        stream : optional
            ``None`` (default): the capture stream, ordered after the work already queued on the
            caller's current stream (CuPy's, and PyTorch's when the capture used PyTorch) and before
            the work queued there afterwards, through two events -- or nothing at all when the caller
            runs on the capture stream (``with g.stream:``, the fastest loop). A CuPy or PyTorch
            stream, an object with ``__cuda_stream__`` or an int pointer: launch there, ordered by that
            stream alone.
        """
        graph = self.graph
        if graph is None:
            raise GraphCaptureError("replay() on a closed CapturedGraph")
        if stream is not None:
            from . import arrays

            graph.launch(arrays.resolve_stream(stream))
            return
        s = self.stream
        callers = self._caller_streams(s)
        if not callers:
            graph.launch(s)
            return
        events = self._events
        if events is None:
            import cupy

            with cupy.cuda.Device(self.device_id):
                events = self._events = (cupy.cuda.Event(disable_timing=True), cupy.cuda.Event(disable_timing=True))
        before, after = events
        for c in callers:
            before.record(c)
            s.wait_event(before)
        graph.launch(s)
        after.record(s)
        for c in callers:
            c.wait_event(after)

    def close(self) -> None:
        """Release the graph and every buffer it holds (waits for the device to finish first)."""
        if self.graph is None:
            return
        try:
            import cupy

            with cupy.cuda.Device(self.device_id):
                cupy.cuda.runtime.deviceSynchronize()
        except Exception:  # interpreter shutdown, or a capture elsewhere forbids the sync
            try:
                self.stream.synchronize()
            except Exception:
                pass
        self.graph = None
        self.outputs = None
        self.kept = []
        self.pool = None
        self.torch_pool = None
        self._events = None

    def __enter__(self) -> "CapturedGraph":
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False


def _capture_stream(cp, stream):
    from . import arrays

    if stream is None:
        return cp.cuda.Stream(non_blocking=True)
    s = arrays.resolve_stream(stream)
    if s.ptr in (0, 1):
        raise GraphCaptureError(
            "stream: the legacy default stream cannot be captured. Pass None (cupa creates a non-blocking "
            "stream), a cupy.cuda.Stream(non_blocking=True) or a torch.cuda.Stream(); note that "
            "torch.cuda.current_stream() is the legacy default stream unless called inside "
            "`with torch.cuda.stream(s):`")
    try:
        busy = s.is_capturing()
    except Exception:
        busy = True
    if busy:
        raise GraphCaptureError(f"stream {s.ptr:#x} is already capturing: nested captures are not supported")
    return s


def _order_after_caller(cp, stream, torch, device_id) -> None:
    """Make ``stream`` wait for the work queued so far on the caller's current streams (no host sync)."""
    from . import arrays

    ptrs = {cp.cuda.get_current_stream().ptr: cp.cuda.get_current_stream()}
    if torch is not None:
        tptr = arrays._torch_stream_ptr(device_id)
        ptrs.setdefault(tptr, arrays._wrap_stream(tptr, device_id))
    for ptr, caller in ptrs.items():
        if ptr != stream.ptr:
            ev = cp.cuda.Event(disable_timing=True)
            ev.record(caller)
            stream.wait_event(ev)


def capture_graph(step: Callable[[], Any], *, stream=None, warmup: int = 1, pool="private",
                  use_torch: Optional[bool] = None) -> CapturedGraph:
    """Capture ``step()`` -- cupa calls plus the caller's own CuPy or PyTorch work -- into a CUDA graph.

    Parameters
    ----------
    step : callable with no arguments
        One decode step: any number of cupa calls (one per layer) and other GPU work, all on the
        current stream (cupa calls with ``stream=None`` do that). Whatever it returns becomes
        ``g.outputs``. It must not synchronize with the host (no ``.item()``, ``cupy.asnumpy``,
        ``bool(array)``, ``stream.synchronize()``) and must read no device value on the host.
    stream : optional
        The capture stream: None (a new ``cupy.cuda.Stream(non_blocking=True)``), a CuPy stream, a
        ``torch.cuda.Stream``, an object with ``__cuda_stream__`` or an int pointer. Not the legacy
        default stream (``torch.cuda.current_stream()`` outside ``with torch.cuda.stream(s):`` is
        that stream).
    warmup : int
        Eager runs of ``step()`` on the capture stream before the capture (default 1), so that every
        kernel is compiled before capture; their side effects (cache writes, any in-place update
        ``step()`` makes) happen. ``warmup=0`` is fine once the same step has run eagerly before;
        otherwise a kernel compile inside the capture raises :class:`GraphCaptureError`.
    pool : "private" (default), "current" or a cupy.cuda.MemoryPool
        Where CuPy allocations made during the capture come from. "private": a new MemoryPool owned
        by the returned graph, so no buffer the graph uses is ever handed to another array, whatever
        ``step()`` frees (this also makes a ``MemoryAsyncPool`` allocator harmless). "current": the
        caller's allocator, which must be a ``cupy.cuda.MemoryPool`` (a ``MemoryAsyncPool`` raises);
        cupa's own buffers are kept alive, but temporaries ``step()`` frees go back to the shared
        pool while the graph still writes them: keep ``step()``'s own work allocation-free. A
        MemoryPool object: that pool (share one between graphs that never run concurrently).
    use_torch : bool or None
        Also make the capture stream PyTorch's current stream during warm-up and capture (so torch
        work and cupa calls on torch tensors, which follow PyTorch's current stream, are captured),
        and route PyTorch allocations made during the capture to a private ``torch.cuda.MemPool``.
        None (default): when PyTorch is imported and has CUDA.

    Returns
    -------
    CapturedGraph
        ``g.replay(stream=None)``, ``g.outputs``, ``g.stream``, ``g.graph``, ``g.close()`` (also a
        context manager).

    Raises
    ------
    GraphCaptureError
        No usable CUDA device; a host synchronization inside ``step()``; a kernel compile inside the
        capture; ``pool="current"`` with a ``MemoryAsyncPool``; the legacy default stream. The
        capture is discarded and the stream is usable again.

    Notes
    -----
    A graph replays exactly what was launched at capture. Input buffers must be updated in place
    (``past_seqlens += 1``, ``query[...] = new_q``, ``block_table[b, j] = block``), never rebound to
    new arrays; shapes, dtypes and the batch size are fixed (capture one graph per batch-size bucket;
    a padded sequence with ``past_seqlens = -1`` writes nothing and outputs zeros).

    ``attention_metadata`` is read once, on the host, at capture, and frozen into the graph: pass a
    **replay-wide bound** -- the largest lengths the graph will ever serve, e.g.
    ``attention_metadata=[1, max_model_len]`` for decode -- never the current step's values. Any valid
    bound gives bit-identical results (contract §4.5); a bound smaller than a length reached during a replay
    breaks the contract (work is omitted; memory stays safe). Leaving it out is correct too, but sizes
    the launch for the block table's full capacity.

    Examples
    --------
    >>> op = cupa.PagedAttention(num_heads=32, kv_num_heads=8)
    >>> md = [1, max_model_len]                          # a bound for every replay, not this step's length
    >>> def step():
    ...     return [op(q[l], k[l], v[l], kc[l], vc[l], cum, past, bt, attention_metadata=md)
    ...             for l in range(num_layers)]
    >>> g = cupa.capture_graph(step)
    >>> with g.stream:                                   # updates and replays ordered on one stream
    ...     for _ in range(steps):
    ...         q[...] = next_q; ...                     # write new inputs in place
    ...         g.replay()
    ...         past += 1
    """
    if not callable(step):
        raise TypeError(f"step: got {type(step).__name__}; expected a callable taking no arguments")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup: got {warmup!r}; expected an int >= 0")
    cp = _cupy()
    if capture_active():
        raise GraphCaptureError("capture_graph called while a capture is active on this thread (from inside "
                                "step() of another capture?): nested captures are not supported")
    capture = _capture_stream(cp, stream)
    resolved = _resolve_pool(cp, pool)  # before the warm-up: a bad pool fails fast
    torch = _torch_module(use_torch, stream)
    device = cp.cuda.Device()
    device_id = device.id
    torch_stream = None
    if torch is not None:
        if stream is not None and type(stream).__module__.split(".")[0] == "torch":
            torch_stream = stream
        else:
            torch_stream = torch.cuda.ExternalStream(capture.ptr, device=torch.device("cuda", device_id))

    def on_capture_stream() -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        stack.enter_context(device)
        stack.enter_context(capture)
        if torch_stream is not None:
            stack.enter_context(torch.cuda.stream(torch_stream))
        return stack

    with device:
        _order_after_caller(cp, capture, torch, device_id)
    if warmup:
        with on_capture_stream():
            for _ in range(warmup):
                step()
        capture.synchronize()  # surfaces warm-up errors now, and orders the caller after its side effects

    scope = CaptureScope(pool="current" if resolved is None else resolved, use_torch=torch is not None)
    with on_capture_stream(), scope:
        capture.begin_capture()
        try:
            outputs = step()
        except GraphCaptureError:
            _abandon(capture)
            raise
        except BaseException as exc:
            _abandon(capture)
            if _is_capture_error(exc):
                raise GraphCaptureError(
                    f"step() synchronized with the host (or made another call CUDA forbids) during the capture: "
                    f"{type(exc).__name__}: {exc}. Inside a captured step nothing may wait for the GPU or read "
                    "device memory on the host (.item(), float(x), bool(x), cupy.asnumpy, x.get(), "
                    "stream.synchronize(), cupy.nonzero/where with one argument, torch .cpu()/.tolist()). "
                    "The capture was discarded; the stream is usable") from exc
            raise
        try:
            graph = capture.end_capture()
        except Exception as exc:
            _abandon(capture)
            raise GraphCaptureError(
                f"the capture was invalidated ({type(exc).__name__}: {exc}); an operation inside step() broke it "
                "-- typically an error swallowed by step() or a host synchronization from another thread. "
                "The capture was discarded; the stream is usable") from exc
    try:
        graph.upload(capture)  # instantiate device-side resources now, not at the first replay
    except Exception:
        pass
    return CapturedGraph(graph, capture, outputs, scope, torch, device_id)
