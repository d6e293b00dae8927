"""Launches of the attention-state kernels (cuda_src/states.cu): the merge of partial states and the
index arrays of a cascade step.

Both take CuPy arrays already checked by their callers (:mod:`cupa.states`, :mod:`cupa.cascade`) and
launch on the given stream with that stream's device current: no host synchronization, no allocation
but the outputs the callers pass in, so a step made of them can be captured into a CUDA graph.
"""

from __future__ import annotations

import numpy as np

from .. import _capture, jit
from . import registry, types

#: states passed one pointer each (mirrors MERGE_LISTED in states.cu); more come as one strided array
MERGE_LISTED = 16
MERGE_WARPS = 8  # rows (one warp each) per CTA, mirrors MERGE_WARPS
#: the kernel argument ``MergeInputs<T>`` of states.cu
MERGE_INPUTS = np.dtype([("out", np.uint64, (MERGE_LISTED,)), ("lse", np.uint64, (MERGE_LISTED,)),
                         ("out_stride", np.int64), ("lse_stride", np.int64), ("heads_major", np.int32),
                         ("group", np.int32), ("tokens", np.int64), ("valid", np.uint64)])
MERGE_DTYPES = ("float16", "bfloat16", "float32")
CASCADE_THREADS = 256


def sink_types(dtype: str) -> tuple:
    """The head_sink dtypes a merge of T=``dtype`` takes: T itself or float32."""
    return (dtype,) if dtype == "float32" else (dtype, "float32")


def specializations() -> list:
    """Every specialization of states.cu."""
    specs = [registry.merge_states_spec(dtype, sink, vec)
             for dtype in MERGE_DTYPES for sink in sink_types(dtype) for vec in (8, 1)]
    specs.append(registry.cascade_inputs_spec())
    return specs


def _cupy():
    import cupy

    return cupy


def merge(outputs, lses, head_sink, out, out_lse, num_heads: int, stream, heads_major: tuple = None) -> None:
    """Launch ``merge_states`` on ``stream``.

    Parameters
    ----------
    outputs : list of S CuPy arrays (N, H*Dv) of T, or one C-contiguous (S, N, H*Dv) array
    lses : list of S CuPy float32 arrays (N, H), or one C-contiguous (S, N, H) array (same form)
    head_sink : CuPy (H,) array of T or float32, or None
    out : CuPy (N, H*Dv) array of T (may be one of ``outputs``)
    out_lse : CuPy (N, H) float32 array (may be one of ``lses``), or None
    heads_major : (count, group, valid) or None
        The first ``count`` states (a list of at most MERGE_LISTED) hold their rows KV-head major:
        (KV head, token, group head) with ``group`` heads a KV head, as a heads-form cascade prefix
        returns them; a token whose entry of ``valid`` (a CuPy int32 (N,) array, or None) is negative
        takes nothing from them.
    """
    cupy = _cupy()
    stacked = not isinstance(outputs, (list, tuple))
    first = outputs if stacked else outputs[0]
    num_states = first.shape[0] if stacked else len(outputs)
    N, width = out.shape
    rows = N * num_heads
    if rows == 0:
        return
    head_width = width // num_heads
    if not stacked and num_states > MERGE_LISTED:
        with cupy.cuda.Device(out.data.device_id), stream:
            outputs, lses, stacked = cupy.stack(outputs), cupy.stack(lses), True
        _capture.keep_alive(outputs, lses)
    arg = np.zeros(1, dtype=MERGE_INPUTS)
    if heads_major is not None:
        count, group, valid = heads_major
        assert not stacked and 0 < count <= num_states and num_heads % group == 0
        arg["heads_major"], arg["group"], arg["tokens"] = count, group, N
        arg["valid"] = 0 if valid is None else valid.data.ptr
    if stacked:
        arg["out"][0, 0], arg["lse"][0, 0] = outputs.data.ptr, lses.data.ptr
        arg["out_stride"], arg["lse_stride"] = N * width, N * num_heads
        ptrs = [outputs.data.ptr + i * N * width * out.itemsize for i in range(num_states)]
    else:
        ptrs = [o.data.ptr for o in outputs]
        arg["out"][0, :num_states] = ptrs
        arg["lse"][0, :num_states] = [x.data.ptr for x in lses]
    aligned = head_width % 8 == 0 and all(p % 16 == 0 for p in ptrs + [out.data.ptr])
    dtype = out.dtype.name
    sink_dtype = dtype if head_sink is None else head_sink.dtype.name
    spec = registry.merge_states_spec(dtype, sink_dtype, 8 if aligned else 1)
    with cupy.cuda.Device(out.data.device_id), stream:
        kernel = jit.get_kernel(spec)
        kernel((-(-rows // MERGE_WARPS),), (MERGE_WARPS * 32,),
               (arg, np.int32(num_states), np.int64(rows), np.int32(num_heads), np.int32(head_width),
                types.ptr(head_sink), out, types.ptr(out_lse)))


#: stacked-query units ``cascade_inputs`` copies at most (its copy loop indexes them in 32 bits)
MAX_STACK_UNITS = (1 << 31) - 1


def stack_units(query, head_size: int, heads: int = 0, copies: int = 1):
    """16-byte units of one ``query`` head row when ``cascade_inputs`` can copy the heads form's stacked
    queries from it (16-byte aligned rows and row stride, contiguous heads, and ``copies`` copies of
    ``heads`` head rows within :data:`MAX_STACK_UNITS` units), else None."""
    row = head_size * query.dtype.itemsize
    if (query.ndim != 2 or row % 16 or query.data.ptr % 16 or query.strides[1] != query.dtype.itemsize
            or query.strides[0] % 16 or copies * heads * (row // 16) > MAX_STACK_UNITS):
        return None
    return row // 16


def cascade_inputs(cum, past, block_table, query_positions, *, kv_capacity: int, rotary_max_pos: int,
                   prefix_len: int, prefix_blocks: int, prefix_rows: int, prefix_cols: int, prefix_split: bool,
                   prefix_positions, suffix_past, suffix_positions, suffix_table, prefix_table, stream,
                   query=None, kv_num_heads: int = 0, group: int = 0, head_size: int = 0, stacked=None,
                   prefix_cum=None, prefix_past=None, prefix_slots=None, prefix_kv=None, block_size: int = 0) -> None:
    """Launch ``cascade_inputs`` on ``stream``: fills ``prefix_positions`` (N,), ``suffix_past`` (B,),
    ``suffix_positions`` (N,; only with ``query_positions``), ``suffix_table`` (B, max_blocks -
    prefix_blocks) and ``prefix_table`` (prefix_rows, prefix_cols), all int32 CuPy arrays. The prefix
    table repeats row 0's prefix blocks in every row, or with ``prefix_split`` holds them in
    consecutive runs of prefix_cols, one a row (-1 past the last).

    With ``stacked`` (a C-contiguous array of prefix_rows * N * kv_num_heads * group * head_size
    elements of ``query``'s dtype) it also writes the heads form's queries there: prefix_rows copies of
    ``query``'s first kv_num_heads * group heads, KV-head major (KV head, token, group head); ``query``
    must pass :func:`stack_units`.

    The prefix call's own inputs, each written where given: ``prefix_cum`` (prefix_rows + 1,) and
    ``prefix_past`` (prefix_rows,) -- with ``prefix_split`` one token a split whose past is its keys
    (``block_size`` a block) less one, else runs of ``prefix_len`` tokens whose past is prefix_len less
    the run's tokens -- ``prefix_slots`` (all -1), int32; ``prefix_kv`` (any C-contiguous array of a
    16-bit or 32-bit dtype): zeros."""
    cupy = _cupy()
    N, B, max_blocks = prefix_positions.shape[0], past.shape[0], block_table.shape[1]
    units, q_row, copy = 0, 0, 0
    if stacked is not None:
        units = stack_units(query, head_size, kv_num_heads * N * group, prefix_rows)
        assert units is not None and stacked.flags.c_contiguous and stacked.data.ptr % 16 == 0
        q_row, copy = query.strides[0] // 16, kv_num_heads * N * group * units
        assert stacked.nbytes == copy * prefix_rows * 16
    n_slots = 0 if prefix_slots is None else prefix_slots.size
    n_kv = 0 if prefix_kv is None else prefix_kv.nbytes // 2
    assert prefix_kv is None or prefix_kv.flags.c_contiguous
    total = (copy * prefix_rows + N + B + B * (max_blocks - prefix_blocks) + prefix_rows * prefix_cols
             + (0 if prefix_cum is None else prefix_rows + 1) + (0 if prefix_past is None else prefix_rows)
             + n_slots + n_kv)
    if total == 0:
        return
    blocks = min(-(-total // CASCADE_THREADS), 1024)
    with cupy.cuda.Device(cum.data.device_id), stream:
        kernel = jit.get_kernel(registry.cascade_inputs_spec())
        kernel((blocks,), (CASCADE_THREADS,),
               (cum, past, block_table, types.ptr(query_positions), np.int32(N), np.int32(B), np.int32(max_blocks),
                np.int64(kv_capacity), np.int32(rotary_max_pos), np.int32(prefix_len), np.int32(prefix_blocks),
                np.int32(prefix_rows), np.int32(prefix_cols), np.int32(int(prefix_split)), prefix_positions,
                suffix_past, types.ptr(suffix_positions), suffix_table, prefix_table, types.ptr(query),
                np.int64(q_row), np.int32(group), np.int32(units), np.int64(copy), types.ptr(stacked),
                types.ptr(prefix_cum), types.ptr(prefix_past), types.ptr(prefix_slots), np.int32(n_slots),
                np.int32(block_size), types.ptr(prefix_kv), np.int64(n_kv)))
