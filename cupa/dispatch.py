"""Backend choice from shapes, dtypes and attributes only (never device data), and explain().

A backend is an object with ``name``, ``not_supported_reasons(problem) -> list[str]`` and
``run(problem, inputs, out=None, stream=None)``. NumPy inputs go to the reference backend;
device inputs go to the first CUDA backend in priority order that supports the problem.
There is no silent fallback from the GPU to the CPU.
"""

from __future__ import annotations

import logging

from . import arrays
from .contract import Problem
from .errors import PagedAttentionError, fail

log = logging.getLogger("cupa")


def input_libraries(inputs: dict) -> dict:
    return {name: arrays.library_of(x) for name, x in inputs.items()
            if x is not None and name != "attention_metadata"}


def is_host_call(inputs: dict) -> bool:
    """True for an all-NumPy call; raises for a mix of host and device arrays."""
    libs = input_libraries(inputs)
    host = sorted(n for n, lib in libs.items() if lib == "numpy")
    other = sorted(n for n, lib in libs.items() if lib == "other")
    if other:
        raise fail(other[0], f"a {type(inputs[other[0]]).__name__}",
                   "a NumPy array, a CuPy array or a CUDA array exposing __dlpack__ (PyTorch, JAX)")
    if host and len(host) != len(libs):
        dev = sorted(set(libs) - set(host))
        raise fail(host[0], "a NumPy (host) array", f"a device array like {dev[0]}: mixing CPU and GPU inputs is not allowed")
    return bool(host)


def cuda_backends() -> list:
    """CUDA backends in priority order (first supported wins)."""
    from .kernels import registry

    return registry.backends()


def _prefers(backend, problem: Problem) -> bool:
    pref = getattr(backend, "preferred", None)
    return pref is None or pref(problem)


def select_backend(problem: Problem, inputs: dict, options=None):
    from .options import resolve

    options = resolve(options)
    if is_host_call(inputs):
        from .reference import BACKEND

        if options.backend not in ("auto", "reference"):
            raise fail("options.backend", repr(options.backend),
                       "'auto' or 'reference' for host (NumPy) inputs: CUDA backends take device arrays")
        return BACKEND
    if options.backend == "reference":
        raise fail("options.backend", "'reference'", "a CUDA backend or 'auto' for device inputs: cupa never "
                   "falls back to the CPU")
    backends = cuda_backends()
    if options.backend != "auto":
        named = [b for b in backends if b.name == options.backend]
        if not named:
            raise fail("options.backend", repr(options.backend), "a backend available here: "
                       + ", ".join(repr(b.name) for b in backends))
        reasons = named[0].not_supported_reasons(problem)
        if reasons:
            raise PagedAttentionError(f"options.backend: {options.backend!r} cannot serve this call: "
                                      + "; ".join(reasons))
        return named[0]
    supported = [b for b in backends if not b.not_supported_reasons(problem)]
    for b in supported:
        if _prefers(b, problem):
            log.info("cupa: %s backend for N=%d B=%d", b.name, problem.token_count, problem.batch_size)
            return b
    if supported:
        return supported[0]
    reasons = "; ".join(f"{b.name}: {', '.join(b.not_supported_reasons(problem))}" for b in backends)
    raise PagedAttentionError(f"no CUDA backend serves this call ({reasons}); "
                              "cupa never falls back to the CPU for device inputs")


def explain(problem: Problem, inputs: dict, options=None) -> str:
    """A human-readable account of the backend choice."""
    from .options import resolve

    options = resolve(options)
    lines = [f"options: {options!r}"]
    if is_host_call(inputs):
        lines.append("reference: chosen (NumPy inputs run the float64 NumPy reference on the CPU)")
        lines.append("CUDA backends: not considered (inputs are host arrays)")
        return "\n".join(lines)
    chosen = select_backend(problem, inputs, options)
    for b in cuda_backends():
        reasons = b.not_supported_reasons(problem)
        if b is chosen:
            lines.append(f"{b.name}: chosen ({b.describe(problem)})")
        elif reasons:
            lines.append(f"{b.name}: not eligible: {'; '.join(reasons)}")
        else:
            lines.append(f"{b.name}: eligible but not preferred ({b.describe(problem)})")
    lines.append("reference: not considered (device inputs never fall back to the CPU)")
    return "\n".join(lines)
