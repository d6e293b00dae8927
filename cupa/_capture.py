"""Which CUDA-graph capture is in progress on this thread: the hooks kernels and the JIT consult.

This module imports nothing of cupa's, so that low-level modules (``cupa.jit``, ``cupa.kernels``)
can ask it without importing the public graph helper (:mod:`cupa.graphs`), which drives captures
and re-exports these names.
"""

from __future__ import annotations

import sys
import threading

__all__ = ["GraphCaptureError", "capture_active", "keep_alive", "check_compile_allowed", "active_scope",
           "activate_scope", "deactivate_scope", "ACTIVE"]


class GraphCaptureError(RuntimeError):
    """A CUDA-graph capture could not produce a correct graph; the message names the cause and the fix.

    The capture has been ended and discarded and the stream is usable again. Errors of ``step()``
    that have nothing to do with the capture (a ``PagedAttentionError``, a ``TypeError``...) are
    re-raised as they are, after the capture has been discarded the same way.
    """


_local = threading.local()   # .scope: the CaptureScope active on this thread, or absent/None
_lock = threading.Lock()
#: ``ACTIVE[0]``: scopes active over all threads; keeps :func:`keep_alive` to one read when none is.
ACTIVE = [0]


def active_scope():
    """The CaptureScope active on this thread, or None."""
    return getattr(_local, "scope", None)


def activate_scope(scope) -> None:
    _local.scope = scope
    with _lock:
        ACTIVE[0] += 1


def deactivate_scope() -> None:
    _local.scope = None
    with _lock:
        ACTIVE[0] -= 1


def capture_active() -> bool:
    """True while a ``cupa.capture_graph`` capture (or a ``capture_scope``) is active on this thread."""
    return getattr(_local, "scope", None) is not None


def keep_alive(*arrays) -> None:
    """Keep ``arrays`` alive for the life of the graph being captured on this thread; no-op otherwise.

    cupa's CUDA backends call it for every buffer they allocate (outputs, workspaces), because a
    graph bakes in their addresses: freed and reused, they would be overwritten by each replay.
    """
    if ACTIVE[0]:
        scope = getattr(_local, "scope", None)
        if scope is not None:
            scope.keep(arrays)


def _compile_message(what) -> str:
    return (f"cupa: kernel {what} is not compiled yet and a CUDA graph capture is in progress on this "
            "thread; compiling (and loading a module) inside a capture is not supported. Run the step "
            "once eagerly before capturing -- cupa.capture_graph(step, warmup=1), the default, does it "
            "-- so that every kernel the step needs is compiled first")


def check_compile_allowed(what) -> None:
    """Raise :class:`GraphCaptureError` if a kernel compile would happen inside a capture on this thread.

    Called by ``cupa.jit.get_kernel`` on a memo miss only (compiled kernels cost nothing here). It
    sees captures made by ``capture_graph`` / ``capture_scope`` and raw captures on CuPy's current
    stream (``stream.begin_capture()``).
    """
    if getattr(_local, "scope", None) is not None:
        raise GraphCaptureError(_compile_message(what))
    cp = sys.modules.get("cupy")
    if cp is None:
        return
    try:
        capturing = cp.cuda.get_current_stream().is_capturing()
    except Exception:  # an invalidated capture or an illegal query: let the compile report it
        capturing = False
    if capturing:
        raise GraphCaptureError(_compile_message(what))
