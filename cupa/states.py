"""Attention states: the exact merge of partial attention results (docs/attention_states.md).

The *state* of a (token, head) over a set of admitted keys is its sink-free output row ``o`` (the
softmax-weighted sum of the values, normalized over those keys) and the natural log-sum-exp ``lse``
of its scores. ``paged_attention(..., return_lse=True)`` without ``head_sink`` returns the state of
each (token, head) over the keys its block table maps; calls whose block tables map disjoint key
sets return partial states, and :func:`merge_states` turns them into the state over the union,
adding ``head_sink`` once, in the merge::

    lse = ln(sum_i exp(lse_i))
    out = sum_i exp(lse_i) * o_i / (exp(lse) + exp(head_sink))     (the sink term only when given)

which is what one call over all the keys with that ``head_sink`` returns. A state with ``lse_i =
-inf`` (no admitted key: an empty shard) contributes nothing, whatever its output row holds; when
every state is empty the result is zeros with ``lse = -inf``.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from . import _capture, arrays
from .contract import ArrayInfo
from .errors import fail

__all__ = ["merge_states"]

MERGE_DTYPES = ("float16", "bfloat16", "float32")
_LIBRARY_NAMES = "NumPy, CuPy or PyTorch (CPU or CUDA)"


def merge_states(outputs, lses, *, head_sink=None, out=None, out_lse=None, stream=None) -> tuple:
    """Merge partial attention states computed over disjoint key sets into the state over their union.

    Parameters
    ----------
    outputs : sequence of S arrays (N, H*Dv) of T, or one (S, N, H*Dv) array
        The sink-free output of each partial state; T is float16, bfloat16 or float32, the same for all.
    lses : sequence of S float32 arrays (N, H), or one (S, N, H) array
        The log-sum-exp of each partial state (``-inf``: no admitted key, the state contributes nothing).
        The same form as ``outputs`` (a sequence of S arrays, or one stacked array).
    head_sink : (H,) array of T or float32, optional
        Per-head sink logit, counted once here (the partial states are computed without it).
    out : (N, H*Dv) array of T, optional
        Written in place and returned; it may be one of ``outputs``.
    out_lse : (N, H) float32 array, optional
        Written in place and returned; it may be one of ``lses``.
    stream : optional
        CUDA stream for device arrays (CuPy or PyTorch stream, or a raw pointer); default the caller's
        current stream (PyTorch's for torch tensors).

    Returns
    -------
    output : (N, H*Dv) array of T
        The merged output with ``head_sink`` applied: what one call over the union of the keys returns.
    lse : (N, H) float32
        The log-sum-exp over the union (the sink left out, as ``paged_attention`` returns it).

    Both come back in the library of the first output: NumPy, PyTorch CPU tensors and other host arrays
    are merged in float64 on the CPU; CuPy arrays and CUDA tensors by one kernel launch on ``stream``
    (fp32 arithmetic, no host synchronization; capturable into a CUDA graph when ``out`` and
    ``out_lse`` are given or allocated by a capture-aware pool). Violations raise
    :class:`cupa.PagedAttentionError` naming the argument.
    """
    states = _States(outputs, lses, head_sink)
    if states.host:
        return _merge_host(states, out, out_lse)
    return _merge_device(states, out, out_lse, stream)


class _States:
    """The validated arguments of one merge: ``items`` (outputs), ``lse_items``, ``sink``, sizes and placement."""

    def __init__(self, outputs, lses, head_sink):
        self.stacked = hasattr(outputs, "shape")
        if self.stacked != hasattr(lses, "shape"):
            raise fail("lses", "an array" if hasattr(lses, "shape") else "a sequence",
                       "the same form as outputs: a sequence of (N, H) arrays, or one (S, N, H) array")
        if self.stacked:
            out_items, lse_items = [("outputs", outputs)], [("lses", lses)]
        else:
            out_items = _sequence("outputs", outputs)
            lse_items = _sequence("lses", lses)
            if len(lse_items) != len(out_items):
                raise fail("lses", f"{len(lse_items)} arrays", f"one per output ({len(out_items)})")
        infos = {name: _info(name, x) for name, x in out_items + lse_items}
        first_name, first = out_items[0]
        self.first = first
        want_ndim = 3 if self.stacked else 2
        shape0 = infos[first_name].shape
        if len(shape0) != want_ndim:
            raise fail(first_name, f"shape {shape0}", "(S, N, H*Dv)" if self.stacked else "(N, H*Dv)")
        self.dtype = infos[first_name].dtype
        if self.dtype not in MERGE_DTYPES:
            raise fail(first_name, f"dtype {self.dtype}", f"one of {MERGE_DTYPES}")
        for name, _ in out_items[1:]:
            info = infos[name]
            if info.shape != shape0 or info.dtype != self.dtype:
                raise fail(name, f"shape {info.shape} dtype {info.dtype}",
                           f"shape {shape0} dtype {self.dtype} like {first_name}")
        lse_name = lse_items[0][0]
        lse_shape = infos[lse_name].shape
        lead = shape0[:-1]
        if len(lse_shape) != want_ndim or lse_shape[:-1] != lead or lse_shape[-1] < 1:
            want = f"({', '.join(map(str, lead))}, H)"
            raise fail(lse_name, f"shape {lse_shape}", f"{want}: the leading dimensions of {first_name}, then H >= 1")
        self.num_heads = H = lse_shape[-1]
        width = shape0[-1]
        if width % H:
            raise fail(first_name, f"width {width}", f"a multiple of num_heads (H = {H}, from {lse_name}): H*Dv")
        for name, _ in lse_items:
            info = infos[name]
            if info.shape != lse_shape or info.dtype != "float32":
                raise fail(name, f"shape {info.shape} dtype {info.dtype}", f"shape {lse_shape} dtype float32")
        self.num_states = shape0[0] if self.stacked else len(out_items)
        self.token_count = shape0[-2]
        self.width = width
        self.sink = head_sink
        if head_sink is not None:
            info = _info("head_sink", head_sink)
            allowed = tuple(dict.fromkeys((self.dtype, "float32")))
            if info.shape != (H,) or info.dtype not in allowed:
                raise fail("head_sink", f"shape {info.shape} dtype {info.dtype}",
                           f"shape ({H},) dtype {' or '.join(allowed)}")
        self.items, self.lse_items = out_items, lse_items
        named = out_items + lse_items + ([("head_sink", head_sink)] if head_sink is not None else [])
        where = {name: arrays.placement(x) for name, x in named}
        self.host = where[first_name] == "host"
        for name, w in where.items():
            if w == "other":
                raise fail(name, f"a {type(dict(named)[name]).__module__}.{type(dict(named)[name]).__qualname__}",
                           f"an array of {_LIBRARY_NAMES}")
            if w != where[first_name]:
                side = "a host (CPU) array" if w == "host" else "a device (CUDA) array"
                raise fail(name, side, f"an array where {first_name} is: mixing CPU and GPU arrays is not allowed")
        self.named = named

    @property
    def output_shape(self) -> tuple:
        return (self.token_count, self.width)

    @property
    def lse_shape(self) -> tuple:
        return (self.token_count, self.num_heads)


def _sequence(name: str, x) -> list:
    if isinstance(x, (str, bytes)) or not isinstance(x, Sequence):
        raise fail(name, f"a {type(x).__module__}.{type(x).__qualname__}",
                   "a sequence (list or tuple) of arrays, or one stacked array")
    if len(x) == 0:
        raise fail(name, "an empty sequence", "at least one state")
    return [(f"{name}[{i}]", item) for i, item in enumerate(x)]


def _info(name: str, x) -> ArrayInfo:
    if x is None:
        raise fail(name, "None", f"an array of {_LIBRARY_NAMES}")
    try:
        return arrays.describe(x)
    except (AttributeError, TypeError) as exc:
        raise fail(name, f"a {type(x).__module__}.{type(x).__qualname__}", f"an array of {_LIBRARY_NAMES}") from exc


# ------------------------------------------------------------------------------------------------
# the host merge (float64)

def merge_host(outputs: np.ndarray, lses: np.ndarray, head_sink: Optional[np.ndarray]) -> tuple:
    """The merge in float64 on NumPy arrays: ``outputs`` (S, N, H, Dv), ``lses`` (S, N, H), ``head_sink``
    (H,) or None. Returns the merged output (N, H, Dv) and lse (N, H), float64."""
    o = np.asarray(outputs, dtype=np.float64)
    lse = np.asarray(lses, dtype=np.float64)
    m = lse.max(axis=0)                                   # -inf where every state is empty
    m_ref = np.where(np.isfinite(m), m, 0.0)
    with np.errstate(over="ignore", invalid="ignore"):
        w = np.exp(lse - m_ref)                           # 0 for an empty state
        total = w.sum(axis=0)
        acc = np.where(w[..., None] > 0, w[..., None] * o, 0.0).sum(axis=0)   # an empty state's row unread
        den = total if head_sink is None else total + np.exp(np.asarray(head_sink, dtype=np.float64) - m_ref)
        merged = np.where(total[..., None] > 0, acc / np.where(total > 0, den, 1.0)[..., None], 0.0)
    with np.errstate(divide="ignore"):
        merged_lse = np.where(total > 0, m_ref + np.log(np.where(total > 0, total, 1.0)), -np.inf)
    return merged, merged_lse


def _merge_host(states: _States, out, out_lse) -> tuple:
    views = {name: arrays.host_view(x, name) for name, x in states.named}
    H, N, S = states.num_heads, states.token_count, states.num_states
    Dv = states.width // H
    T = arrays.numpy_dtype(states.dtype)
    out_view = arrays.host_out(out, states.first, states.output_shape, T, shape_note=" (N, H*Dv)")
    lse_view = arrays.host_out(out_lse, states.first, states.lse_shape, np.dtype(np.float32), name="out_lse",
                               shape_note=" (N, H)")
    if states.stacked:
        o = views["outputs"].reshape(S, N, H, Dv)
        lse = views["lses"]
    else:
        o = np.stack([views[name] for name, _ in states.items]).reshape(S, N, H, Dv)
        lse = np.stack([views[name] for name, _ in states.lse_items])
    merged, merged_lse = merge_host(o, lse, views.get("head_sink"))
    result = out_view if out_view is not None else np.empty(states.output_shape, dtype=T)
    result[...] = merged.reshape(states.output_shape).astype(T)
    result_lse = lse_view if lse_view is not None else np.empty(states.lse_shape, dtype=np.float32)
    result_lse[...] = merged_lse.astype(np.float32)
    return arrays.wrap_host(result, states.first, out), arrays.wrap_host(result_lse, states.first, out_lse)


# ------------------------------------------------------------------------------------------------
# the device merge (one kernel launch)

def _merge_device(states: _States, out, out_lse, stream) -> tuple:
    from .kernels import states as kernels

    stream = arrays.resolve_stream(stream, states.first)
    dev, device = arrays.device_arrays(dict(states.named), stream, caches=())
    import cupy

    with cupy.cuda.Device(device), stream:
        out_view = arrays.check_out(out, states.output_shape, states.dtype, states.first, device)
        if out_view is None:
            out_view = arrays.empty_output(states.output_shape, states.dtype, states.first, device)
            _capture.keep_alive(out_view)
        lse_view = arrays.check_out(out_lse, states.lse_shape, "float32", states.first, device, name="out_lse")
        if lse_view is None:
            lse_view = arrays.empty_output(states.lse_shape, "float32", states.first, device)
            _capture.keep_alive(lse_view)
    if states.stacked:
        outputs, lses = dev["outputs"], dev["lses"]
    else:
        outputs = [dev[name] for name, _ in states.items]
        lses = [dev[name] for name, _ in states.lse_items]
    kernels.merge(outputs, lses, dev.get("head_sink"), out_view, lse_view, states.num_heads, stream)
    return (arrays.wrap_output(out_view, states.first, stream), arrays.wrap_output(lse_view, states.first, stream))
