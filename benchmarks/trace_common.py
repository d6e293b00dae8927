"""What the kernel trace scripts (trace_decode.py, trace_prefill_ws.py) share: running the library on an
instrumented copy of ``cuda_src`` for this process only, finding the instrumented kernel's trace buffer,
and writing the summary."""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np

from cupa import jit


@contextlib.contextmanager
def instrumented(cp, instrument):
    """Within the block, the library compiles from ``instrument(tmp_dir)`` (a copy of cuda_src with probes;
    it returns the copy's directory: ``jit.SOURCE_DIR``) and every ``cupy.RawModule`` loaded is recorded in
    the list the block gets. Both are restored and the copy removed on exit."""
    tmp = tempfile.mkdtemp(prefix="cupa_trace_")
    source_dir, raw_module = jit.SOURCE_DIR, cp.RawModule
    modules = []

    def recording_module(*a, **k):
        m = raw_module(*a, **k)
        modules.append(m)
        return m

    try:
        jit.SOURCE_DIR = Path(instrument(tmp))
        cp.RawModule = recording_module
        yield modules
    finally:
        cp.RawModule, jit.SOURCE_DIR = raw_module, source_dir
        shutil.rmtree(tmp, ignore_errors=True)


def trace_buffer(cp, modules, name: str, size: int):
    """The uint64 ``__device__`` array ``name`` (``size`` entries) of the newest recorded module that has one,
    zeroed; None when no module has it (the call did not run the instrumented kernel)."""
    for m in reversed(modules):
        try:
            ptr = m.get_global(name)
        except Exception:  # noqa: BLE001 - another kernel's module
            continue
        trace = cp.ndarray((size,), cp.uint64, ptr)
        trace.fill(0)
        return trace
    return None


def quantiles(values) -> list:
    """0, 10, 50, 90 and 100% quantiles, rounded to 0.01 (an empty list when there are none)."""
    if len(values) == 0:
        return []
    return [round(float(np.quantile(values, q)), 2) for q in (0, 0.1, 0.5, 0.9, 1.0)]


def save_raw(path: str, t) -> None:
    """The rows of ``t`` up to the last one with an entry (column 0 non-zero), as .npy."""
    np.save(path, t[: int(np.flatnonzero(t[:, 0]).max(initial=-1)) + 1])


def report(res: dict, out: str) -> None:
    """Print the summary as one JSON line, and write it to ``out`` when given."""
    print(json.dumps(res))
    if out:
        with open(out, "w") as f:
            json.dump(res, f, indent=1)
