"""Backend choice: a function of the Problem, the device the inputs live on and the Options; explain().

A backend is an object with ``name``, ``verified`` (its kernels passed their GPU tests on a device;
``unverified``, the features it serves whose kernels have not yet),
``not_supported_reasons(problem, device, options) -> list[str]``, ``preferred(problem, device,
options) -> bool``, ``describe(problem, device, options) -> str`` and ``run(plan, inputs, out,
stream)``. Host inputs (NumPy, and CPU arrays of any library NumPy can view without a copy) go to
the reference backend; device inputs go to the first CUDA backend of :data:`CUDA_BACKENDS` that
serves the call, has been verified on a GPU and prefers the call (else the first that serves it).
``Options(backend=name)`` names one instead, verified or not. Device data is never read, and device
inputs never fall back to the CPU.

The plan memo of :class:`cupa.PagedAttention` keeps one :class:`Plan` per input signature (shapes,
dtypes, array types, the device of ``query``, attention_metadata's host values).
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass, field
from typing import Any, Optional

from . import arrays
from .contract import Problem
from .device import DeviceInfo, device_info
from .kernels.backend import describe_unverified, unverified_features
from .errors import PagedAttentionError, fail
from .options import Options

log = logging.getLogger("cupa")

__all__ = ["Plan", "CUDA_BACKENDS", "cuda_backends", "call_device", "choose", "account", "make_plan", "explain"]

#: CUDA backends in priority order, each the ``BACKEND`` of module ``cupa.kernels.<name>``.
CUDA_BACKENDS = ("prefill_wgmma", "prefill", "mla", "decode", "general")


@dataclass(eq=False)
class Plan:
    """What the plan memo keeps for one input signature.

    Attributes
    ----------
    problem : Problem
        Sizes and features of the call.
    backend
        The backend that runs it.
    device : DeviceInfo or None
        The device the inputs live on (None for a host call).
    options : Options
    state : dict
        The backend's launch state for this plan (kernels, launch sequences, workspace layout),
        built on its first run.
    writes : bool
        False when the caller guarantees that no call of this plan stores a cache row (every
        slot_mapping entry is -1, as in the prefix call of :class:`cupa.CascadeAttention`): a backend may
        then leave out a launch whose only effect would be storing rows.
    """

    problem: Problem
    backend: Any
    device: Optional[DeviceInfo]
    options: Options
    state: dict = field(default_factory=dict)
    writes: bool = True

    def run(self, inputs: dict, out=None, stream=None):
        return self.backend.run(self, inputs, out, stream)


def cuda_backends() -> list:
    """The CUDA backend objects in priority order."""
    return [importlib.import_module(f"cupa.kernels.{name}").BACKEND for name in CUDA_BACKENDS]


def call_device(inputs: dict) -> Optional[int]:
    """None for a host call (every input on the CPU), else the CUDA device ordinal of ``query``.

    A mix of host and device inputs raises PagedAttentionError naming the first input on the other
    side; so does an object that is not an array of a supported library.
    """
    host, device = [], []
    for name, x in inputs.items():
        if x is None or name == "attention_metadata":
            continue
        where = arrays.placement(x)
        if where == "other":
            where_is = f" on device '{x.device}'" if arrays.library_of(x) == "torch" else ""
            raise fail(name, f"a {type(x).__module__}.{type(x).__qualname__}{where_is}",
                       "an array: NumPy, CuPy, or a CPU or CUDA array of PyTorch, JAX or another DLPack library")
        (host if where == "host" else device).append(name)
    if host and device:
        first = inputs["query"] if "query" in inputs else None
        if arrays.placement(first) == "host":
            raise fail(device[0], "an array in CUDA device memory",
                       f"a CPU array like {host[0]}: mixing CPU and GPU inputs is not allowed")
        raise fail(host[0], "a CPU (host) array",
                   f"a device array like {device[0]}: mixing CPU and GPU inputs is not allowed")
    if not device:
        return None
    return arrays.device_of(inputs[device[0]], device[0])


def _eligible(backend, problem: Problem, device: DeviceInfo, options: Options) -> list:
    return backend.not_supported_reasons(problem, device, options)


def choose(problem: Problem, device: DeviceInfo, options: Options):
    """The CUDA backend for ``problem`` on ``device`` (a pure function of the three)."""
    backends = cuda_backends()
    if options.backend == "reference":
        raise fail("options.backend", "'reference'", "'auto' or a CUDA backend for device inputs: cupa never "
                   "falls back to the CPU")
    if options.backend != "auto":
        named = [b for b in backends if b.name == options.backend]
        if not named:
            raise fail("options.backend", repr(options.backend),
                       "a CUDA backend available here: " + ", ".join(repr(b.name) for b in backends))
        reasons = _eligible(named[0], problem, device, options)
        if reasons:
            raise PagedAttentionError(f"options.backend: {options.backend!r} cannot serve this call: "
                                      + "; ".join(reasons))
        return named[0]
    served = [b for b in backends if _verified_for(b, problem) and not _eligible(b, problem, device, options)]
    for b in served:
        if b.preferred(problem, device, options):
            return b
    if served:
        return served[0]
    reasons = "; ".join(f"{b.name}: {', '.join(_reasons_for_auto(b, problem, device, options))}" for b in backends)
    raise PagedAttentionError(f"no CUDA backend serves this call on {device} ({reasons}); "
                              "cupa never falls back to the CPU for device inputs")


def _verified_for(backend, problem: Problem) -> bool:
    """The backend's kernels for this call have passed their GPU tests: the backend and every feature it uses."""
    return backend.verified and not unverified_features(problem, backend)


def _reasons_for_auto(backend, problem, device, options) -> list:
    reasons = _eligible(backend, problem, device, options)
    if not reasons and not _verified_for(backend, problem):
        select = f"select it with cupa.Options(backend={backend.name!r})"
        if not backend.verified:
            reasons = [f"not yet verified on a GPU ({select})"]
        else:
            what = ", ".join(describe_unverified(f) for f in unverified_features(problem, backend))
            reasons = [f"{what}: not yet verified on a GPU here ({select})"]
    return reasons


def account(problem: Problem, device: DeviceInfo, options: Options) -> str:
    """explain()'s text for device inputs: the chosen backend and, for every other, why not."""
    lines = [f"device: {device}", f"options: {options!r}"]
    try:
        chosen = choose(problem, device, options)
    except PagedAttentionError as exc:
        chosen = None
        lines.append(f"no backend: {exc}")
    for b in cuda_backends():
        reasons = _reasons_for_auto(b, problem, device, options) if options.backend == "auto" else \
            _eligible(b, problem, device, options)
        if b is chosen:
            unverified = ", ".join(describe_unverified(f) for f in unverified_features(problem, b))
            note = f"; {unverified}: not yet verified on a GPU" if unverified else ""
            lines.append(f"{b.name}: chosen ({b.describe(problem, device, options)}{note})")
        elif options.backend != "auto" and b.name != options.backend:
            lines.append(f"{b.name}: not considered (options.backend={options.backend!r})")
        elif reasons:
            lines.append(f"{b.name}: not eligible: {'; '.join(reasons)}")
        else:
            lines.append(f"{b.name}: eligible but not preferred ({b.describe(problem, device, options)})")
    lines.append("reference: not considered (device inputs never fall back to the CPU)")
    return "\n".join(lines)


def _host_backend(options: Options):
    from .reference import BACKEND

    if options.backend not in ("auto", "reference"):
        raise fail("options.backend", repr(options.backend),
                   "'auto' or 'reference' for host (CPU) inputs: CUDA backends take device arrays")
    return BACKEND


def make_plan(problem: Problem, inputs: dict, options: Options, writes: bool = True) -> Plan:
    """The Plan of one call: the backend for these inputs (reference for host inputs); ``writes``:
    :attr:`Plan.writes`."""
    ordinal = call_device(inputs)
    if ordinal is None:
        return Plan(problem, _host_backend(options), None, options, writes=writes)
    device = device_info(ordinal)
    backend = choose(problem, device, options)
    log.info("cupa: %s backend for N=%d B=%d on device %d", backend.name, problem.token_count, problem.batch_size,
             ordinal)
    return Plan(problem, backend, device, options, writes=writes)


def explain(problem: Problem, inputs: dict, options: Options) -> str:
    """A human-readable account of the backend choice for these inputs."""
    ordinal = call_device(inputs)
    if ordinal is None:
        _host_backend(options)
        return "\n".join([f"options: {options!r}",
                          "reference: chosen (CPU inputs run the float64 NumPy reference)",
                          "CUDA backends: not considered (inputs are host arrays)"])
    return account(problem, device_info(ordinal), options)
