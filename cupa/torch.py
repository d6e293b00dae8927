"""``cupa::paged_attention`` as a PyTorch custom operator (``import cupa.torch``; torch is an optional extra).

Importing this module registers ``torch.ops.cupa.paged_attention`` with :mod:`torch.library`: an
operator that mutates ``key_cache`` and ``value_cache`` in place, with implementations for CPU
tensors (the NumPy reference, results back as torch tensors) and CUDA tensors (cupa's kernels on
PyTorch's current stream), and a fake implementation that gives the outputs' shapes and dtypes from
the inputs' alone. So ``torch.compile(fullgraph=True)`` traces a model that calls it without a
graph break (the operator is one node of the graph; functionalization and Inductor's re-inplacing
handle the cache writes), and a ``torch.cuda.graph`` capture records its kernels (warm up first and
capture inside :func:`cupa.graphs.capture_scope`, see docs/graphs.md).

The raw operator always returns three tensors, ``(output, output_qk, lse)``; ``output_qk`` is
``(H, N, kv_capacity)`` float32 when ``qk_output != 0`` and ``lse`` is ``(N, H)`` float32 when
``return_lse``, else each is an empty float32 tensor of shape ``(0,)``. :func:`paged_attention`
is the function to call: it takes the arguments of :func:`cupa.paged_attention` and returns what
that function returns. ``attention_metadata`` is a list of Python ints (host values, frozen into a
compiled graph like any constant). :class:`cupa.Options` travel as a string (:func:`options_key`).

The operator has no autograd formula (inference only) and no ``out=``/``stream=`` arguments: outputs
are new tensors, and the call runs on PyTorch's current stream.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Optional, Sequence

import torch
from torch import Tensor

from .api import PagedAttention
from .contract import INPUT_NAMES, ArrayInfo, Attributes, metadata_values, validate
from .errors import PagedAttentionError, fail
from .options import DEFAULT_OPTIONS, Options, resolve as _resolve_options

__all__ = ["paged_attention", "options_key", "options_from_key", "OP"]

#: inputs the operator writes in place
MUTATED = ("key_cache", "value_cache")
_EMPTY = (0,)


# -- Options as a schema-friendly string ------------------------------------------------------------

def _fields_differing(obj, default) -> dict:
    out = {}
    for f in dataclasses.fields(obj):
        v, d = getattr(obj, f.name), getattr(default, f.name)
        if v == d:
            continue
        out[f.name] = _fields_differing(v, d) if dataclasses.is_dataclass(v) else v
    return out


@torch.compiler.assume_constant_result
def options_key(options: Optional[Options]) -> str:
    """The string form of ``options`` that the operator's ``options`` argument takes ("" for the defaults).

    JSON of the fields that differ from ``cupa.Options()``; :func:`options_from_key` reads it back.
    """
    options = _resolve_options(options)
    if options is DEFAULT_OPTIONS or options == DEFAULT_OPTIONS:
        return ""
    return json.dumps(_fields_differing(options, DEFAULT_OPTIONS), sort_keys=True)


@functools.lru_cache(maxsize=64)
def options_from_key(key: str) -> Options:
    """The :class:`cupa.Options` of a string made by :func:`options_key`."""
    if not key:
        return DEFAULT_OPTIONS
    try:
        values = json.loads(key)
        kwargs = {}
        for name, v in values.items():
            default = getattr(DEFAULT_OPTIONS, name)
            kwargs[name] = dataclasses.replace(default, **v) if dataclasses.is_dataclass(default) else v
        return Options(**kwargs)
    except PagedAttentionError:
        raise
    except (ValueError, TypeError, AttributeError) as e:
        raise fail("options", repr(key), "a string made by cupa.torch.options_key()") from e


# -- the operator ---------------------------------------------------------------------------------

@functools.lru_cache(maxsize=64)
def _bound(attributes: tuple, options: str) -> PagedAttention:
    return PagedAttention(**dict(attributes), options=options_from_key(options))


def _contiguous(x: Optional[Tensor]) -> Optional[Tensor]:
    return x if x is None or x.is_contiguous() else x.contiguous()


def _paged_attention_op(
        query: Tensor, key: Optional[Tensor], value: Optional[Tensor], key_cache: Tensor,
        value_cache: Optional[Tensor], cumulative_sequence_length: Tensor, past_seqlens: Tensor,
        block_table: Tensor, cos_cache: Optional[Tensor], sin_cache: Optional[Tensor],
        slot_mapping: Optional[Tensor], head_sink: Optional[Tensor], q_norm_weight: Optional[Tensor],
        k_norm_weight: Optional[Tensor], k_scale: Optional[Tensor], v_scale: Optional[Tensor],
        attention_metadata: Optional[list[int]], query_positions: Optional[Tensor],
        attention_bias: Optional[Tensor], *, num_heads: int, kv_num_heads: int, scale: float = 0.0,
        softcap: float = 0.0, local_window_size: int = -1, is_causal: int = 1, do_rotary: int = 0,
        rotary_interleaved: int = 0, rotary_offset: int = 0, qk_norm_epsilon: float = 1e-6,
        k_quant_type: str = "NONE", v_quant_type: str = "NONE", k_cache_dtype: str = "",
        v_cache_dtype: str = "", kv_cache_layout: str = "SEPARATE", v_head_size: int = 0,
        qk_output: int = 0, return_lse: bool = False, options: str = "") -> tuple[Tensor, Tensor, Tensor]:
    attributes = (("num_heads", num_heads), ("kv_num_heads", kv_num_heads), ("scale", scale),
                  ("softcap", softcap), ("local_window_size", local_window_size), ("is_causal", is_causal),
                  ("do_rotary", do_rotary), ("rotary_interleaved", rotary_interleaved),
                  ("rotary_offset", rotary_offset), ("qk_norm_epsilon", qk_norm_epsilon),
                  ("k_quant_type", k_quant_type), ("v_quant_type", v_quant_type),
                  ("k_cache_dtype", k_cache_dtype), ("v_cache_dtype", v_cache_dtype),
                  ("kv_cache_layout", kv_cache_layout), ("v_head_size", v_head_size),
                  ("qk_output", qk_output), ("return_lse", return_lse))
    op = _bound(attributes, options)
    # Caches are written where they live (a non-contiguous cache is the contract's error); the
    # other inputs may reach the operator as views with any strides under torch.compile.
    result = op(_contiguous(query), _contiguous(key), _contiguous(value), key_cache, value_cache,
                _contiguous(cumulative_sequence_length), _contiguous(past_seqlens), _contiguous(block_table),
                _contiguous(cos_cache), _contiguous(sin_cache), _contiguous(slot_mapping),
                _contiguous(head_sink), _contiguous(q_norm_weight), _contiguous(k_norm_weight),
                _contiguous(k_scale), _contiguous(v_scale), attention_metadata,
                _contiguous(query_positions), _contiguous(attention_bias))
    if not (qk_output or return_lse):
        result = (result,)
    output, rest = result[0], list(result[1:])
    output_qk = rest.pop(0) if qk_output else query.new_empty(_EMPTY, dtype=torch.float32)
    lse = rest.pop(0) if return_lse else query.new_empty(_EMPTY, dtype=torch.float32)
    return output, output_qk, lse


# The schema spells the attributes and attention_metadata ``int``, not the inferred ``SymInt``: they
# are host constants of a call, so a compiled graph specializes on them even under dynamic=True.
_paged_attention_op = torch.library.custom_op(
    "cupa::paged_attention", _paged_attention_op, mutates_args=MUTATED, device_types=("cpu", "cuda"),
    schema=torch.library.infer_schema(_paged_attention_op, mutates_args=MUTATED).replace("SymInt", "int"))


def _static(shape) -> bool:
    return all(type(d) is int for d in shape)


@_paged_attention_op.register_fake
def _paged_attention_fake(query, key, value, key_cache, value_cache, cumulative_sequence_length, past_seqlens,
                          block_table, cos_cache, sin_cache, slot_mapping, head_sink, q_norm_weight,
                          k_norm_weight, k_scale, v_scale, attention_metadata, query_positions, attention_bias,
                          *, num_heads, kv_num_heads, scale=0.0, softcap=0.0, local_window_size=-1, is_causal=1,
                          do_rotary=0, rotary_interleaved=0, rotary_offset=0, qk_norm_epsilon=1e-6,
                          k_quant_type="NONE", v_quant_type="NONE", k_cache_dtype="", v_cache_dtype="",
                          kv_cache_layout="SEPARATE", v_head_size=0, qk_output=0, return_lse=False, options=""):
    tensors = (query, key, value, key_cache, value_cache, cumulative_sequence_length, past_seqlens, block_table,
               cos_cache, sin_cache, slot_mapping, head_sink, q_norm_weight, k_norm_weight, k_scale, v_scale,
               query_positions, attention_bias)
    attrs = Attributes(num_heads=num_heads, kv_num_heads=kv_num_heads, scale=scale, softcap=softcap,
                       local_window_size=local_window_size, is_causal=is_causal, do_rotary=do_rotary,
                       rotary_interleaved=rotary_interleaved, rotary_offset=rotary_offset,
                       qk_norm_epsilon=qk_norm_epsilon, k_quant_type=k_quant_type, v_quant_type=v_quant_type,
                       k_cache_dtype=k_cache_dtype, v_cache_dtype=v_cache_dtype, kv_cache_layout=kv_cache_layout,
                       v_head_size=v_head_size, qk_output=qk_output, return_lse=return_lse)
    if all(t is None or _static(t.shape) for t in tensors):
        # Concrete shapes (the common trace): the contract's own validation, so a bad call fails
        # while it is traced, with the message an eager call gives.
        names = [n for n in INPUT_NAMES if n != "attention_metadata"]
        infos = {n: None if t is None else ArrayInfo(tuple(t.shape), str(t.dtype).replace("torch.", ""))
                 for n, t in zip(names, tensors)}
        problem = validate(attrs, infos, metadata_values(attention_metadata),
                           output_qk_max_bytes=options_from_key(options).output_qk_max_bytes)
        out_shape, qk_shape, lse_shape = problem.output_shape, problem.output_qk_shape, problem.lse_shape
    else:
        # Symbolic shapes: the same sizes, derived without specializing them.
        n = query.shape[0]
        head_size = query.shape[1] // num_heads
        if key is None and value is None and kv_cache_layout == "SEPARATE":
            head_size = query.shape[1] // (num_heads + 2 * kv_num_heads)
        out_shape = (n, num_heads * (v_head_size or head_size))
        capacity = block_table.shape[1] * key_cache.shape[1]
        if attention_metadata is not None and attention_metadata[1] > 0:
            capacity = torch.sym_min(attention_metadata[1], capacity)
        qk_shape, lse_shape = (num_heads, n, capacity), (n, num_heads)
    output = query.new_empty(out_shape)
    output_qk = query.new_empty(qk_shape if qk_output else _EMPTY, dtype=torch.float32)
    lse = query.new_empty(lse_shape if return_lse else _EMPTY, dtype=torch.float32)
    return output, output_qk, lse


#: the registered operator, ``torch.ops.cupa.paged_attention.default``
OP = torch.ops.cupa.paged_attention.default


def paged_attention(query: Tensor, key: Optional[Tensor] = None, value: Optional[Tensor] = None,
                    key_cache: Optional[Tensor] = None, value_cache: Optional[Tensor] = None,
                    cumulative_sequence_length: Optional[Tensor] = None, past_seqlens: Optional[Tensor] = None,
                    block_table: Optional[Tensor] = None, cos_cache: Optional[Tensor] = None,
                    sin_cache: Optional[Tensor] = None, slot_mapping: Optional[Tensor] = None,
                    head_sink: Optional[Tensor] = None, q_norm_weight: Optional[Tensor] = None,
                    k_norm_weight: Optional[Tensor] = None, k_scale: Optional[Tensor] = None,
                    v_scale: Optional[Tensor] = None, attention_metadata: Optional[Sequence[int]] = None,
                    query_positions: Optional[Tensor] = None, attention_bias: Optional[Tensor] = None, *,
                    num_heads: int, kv_num_heads: int, scale: float = 0.0, softcap: float = 0.0,
                    local_window_size: int = -1, is_causal: int = 1, do_rotary: int = 0,
                    rotary_interleaved: int = 0, rotary_offset: int = 0, qk_norm_epsilon: float = 1e-6,
                    k_quant_type: str = "NONE", v_quant_type: str = "NONE", k_cache_dtype: str = "",
                    v_cache_dtype: str = "", kv_cache_layout: str = "SEPARATE", v_head_size: int = 0,
                    qk_output: int = 0, return_lse: bool = False, options: Optional[Options] = None):
    """:func:`cupa.paged_attention` through the ``cupa::paged_attention`` operator (torch tensors only).

    Takes the inputs and attributes of :func:`cupa.paged_attention` (contract §1 and §3) as torch
    tensors, all on the CPU or all on one CUDA device; ``attention_metadata`` is host values (a list
    or tuple of ints). ``key_cache`` and ``value_cache`` are updated in place. Traceable by
    ``torch.compile(fullgraph=True)`` and capturable by ``torch.cuda.graph``.

    Returns
    -------
    output : (N, H*v_head_size) tensor of T
    output_qk : (H, N, kv_capacity) float32 tensor, only when ``qk_output != 0``
    lse : (N, H) float32 tensor, only when ``return_lse``
        A tuple in this order when more than ``output`` is asked for, as :func:`cupa.paged_attention`.
    """
    md = None if attention_metadata is None else list(metadata_values(attention_metadata))
    output, output_qk, lse = OP(
        query, key, value, key_cache, value_cache, cumulative_sequence_length, past_seqlens, block_table,
        cos_cache, sin_cache, slot_mapping, head_sink, q_norm_weight, k_norm_weight, k_scale, v_scale, md,
        query_positions, attention_bias, num_heads=num_heads, kv_num_heads=kv_num_heads, scale=float(scale),
        softcap=float(softcap), local_window_size=local_window_size, is_causal=is_causal, do_rotary=do_rotary,
        rotary_interleaved=rotary_interleaved, rotary_offset=rotary_offset,
        qk_norm_epsilon=float(qk_norm_epsilon), k_quant_type=k_quant_type, v_quant_type=v_quant_type,
        k_cache_dtype=k_cache_dtype, v_cache_dtype=v_cache_dtype, kv_cache_layout=kv_cache_layout,
        v_head_size=v_head_size, qk_output=qk_output, return_lse=return_lse, options=options_key(options))
    if not (qk_output or return_lse):
        return output
    return (output,) + ((output_qk,) if qk_output else ()) + ((lse,) if return_lse else ())
