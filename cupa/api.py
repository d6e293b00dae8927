"""The public entry points: ``paged_attention`` and the bound-attributes ``PagedAttention``."""

from __future__ import annotations

import functools
import operator
from typing import Any

from . import arrays, dispatch
from .contract import INPUT_NAMES, Attributes, Problem, metadata_values, validate, validate_data
from .errors import PagedAttentionError, fail
from .options import Options, resolve as _resolve_options

_TENSOR_INPUTS = tuple(n for n in INPUT_NAMES if n != "attention_metadata")
_N_INPUTS = len(INPUT_NAMES)
_INPUT_INDEX = {name: i for i, name in enumerate(INPUT_NAMES)}
_INPUT_SET = frozenset(INPUT_NAMES)
#: the names taken by n positional inputs
_POSITIONAL = tuple(frozenset(INPUT_NAMES[:n]) for n in range(_N_INPUTS + 1))
_ALL_NONE = dict.fromkeys(INPUT_NAMES)
#: plan memo entries kept per op (the memo is cleared when full)
_MEMO_SIZE = 64
_GET_TENSORS = operator.itemgetter(*_TENSOR_INPUTS)
#: the inputs whose values Options(validate_data=True) checks (contract.validate_data)
_DATA_CHECKED = ("cumulative_sequence_length", "past_seqlens", "block_table", "slot_mapping", "query_positions",
                 "k_scale", "v_scale")


def _describe(name: str, x):
    """ArrayInfo of input ``name``; a non-array is a PagedAttentionError naming the input."""
    if x is None:
        return None
    try:
        return arrays.describe(x)
    except (AttributeError, TypeError) as e:
        raise fail(name, f"a {type(x).__module__}.{type(x).__qualname__}",
                   "an array: NumPy, CuPy, or a CUDA array exposing __dlpack__ (PyTorch, JAX)") from e


def bind_inputs(args: tuple, kwargs: dict) -> dict:
    """Map positional (ONNX order) and keyword inputs to {name: value or None}; an unknown or repeated
    name is a PagedAttentionError."""
    n = len(args)
    if n > _N_INPUTS:
        raise PagedAttentionError(f"inputs: got {n} positional inputs; expected at most {_N_INPUTS} "
                                  f"(the ONNX input order {list(INPUT_NAMES)})")
    inputs = _ALL_NONE.copy()
    inputs.update(zip(INPUT_NAMES, args))
    if kwargs:
        keys = kwargs.keys()
        if keys <= _INPUT_SET and keys.isdisjoint(_POSITIONAL[n]):
            inputs.update(kwargs)   # every name known, none given twice: what the loop below does
        else:
            _bind_keywords(inputs, n, kwargs)
    return inputs


def _bind_keywords(inputs: dict, n: int, kwargs: dict) -> None:
    """Keyword inputs one by one, raising for the first unknown or repeated name."""
    for name, value in kwargs.items():
        pos = _INPUT_INDEX.get(name)
        if pos is None:
            hint = (" (an attribute: bind it in PagedAttention(...))" if name in Attributes.names()
                    else "")
            raise PagedAttentionError(f"{name}: got an unknown input name{hint}; "
                                      f"expected one of {list(INPUT_NAMES)}")
        if pos < n:
            raise PagedAttentionError(f"{name}: got it both positionally (input {pos}) and by keyword; "
                                      "expected it once")
        inputs[name] = value


class PagedAttention:
    """Attributes bound once, like an ONNX node; call it with the inputs.

    Parameters
    ----------
    num_heads, kv_num_heads : int
        H and Hk; ``num_heads % kv_num_heads == 0``.
    **attributes
        The other attributes of contract §3 (``scale``, ``softcap``, ``local_window_size``,
        ``is_causal``, ``do_rotary``, ``rotary_interleaved``, ``rotary_offset``, ``qk_norm_epsilon``,
        ``k_quant_type``, ``v_quant_type``, ``k_cache_dtype``, ``v_cache_dtype``, ``kv_cache_layout``,
        ``v_head_size``, ``qk_output``) with ONNX Runtime's defaults, and the cupa extension
        ``return_lse``.
    options : cupa.Options, optional
        Backend, launch route, byte limits and data validation (:class:`cupa.Options`); default
        ``cupa.Options()``.

    Examples
    --------
    >>> op = cupa.PagedAttention(num_heads=32, kv_num_heads=8)
    >>> out = op(q, k, v, key_cache, value_cache, cum, past, block_table)
    """

    def __init__(self, *, num_heads: int = None, kv_num_heads: int = None, options: Options = None,
                 **attributes: Any):
        if attributes:
            known = Attributes.names()
            for name in sorted(attributes):
                if name not in known:
                    hint = " (an input: pass it when calling the operator)" if name in INPUT_NAMES else ""
                    raise PagedAttentionError(f"{name}: got an unknown attribute name{hint}; "
                                              f"expected one of {list(known)}")
        # num_heads / kv_num_heads default to None only so that leaving one out is a
        # PagedAttentionError naming it (Attributes rejects None), like any other violation.
        self.attributes = Attributes(num_heads=num_heads, kv_num_heads=kv_num_heads, **attributes)
        self.options = _resolve_options(options)
        # (metadata, (type, shape, dtype) per input) -> [Problem, backend or None]; see _memo_entry()
        self._problems = {}
        self._last = (None, None)   # (key, entry) of the last memo hit or fill: checked before the dict
        self._writes = True   # False: every call's slot_mapping is all -1 (dispatch.Plan.writes; cupa.cascade)

    def __repr__(self) -> str:
        default = Attributes(num_heads=1, kv_num_heads=1)
        parts = [f"{k}={v!r}" for k, v in self.attributes.as_dict().items()
                 if k in ("num_heads", "kv_num_heads") or v != getattr(default, k)]
        if self.options != Options():
            parts.append(f"options={self.options!r}")
        return f"PagedAttention({', '.join(parts)})"

    # -- planning -----------------------------------------------------------------
    _bind = staticmethod(bind_inputs)

    def _memo_entry(self, inputs: dict) -> list:
        """``[problem, plan or None]`` for the bound inputs, validating them on a memo miss.

        validate() is a pure function of the attributes, the inputs' (shape, dtype) and the
        metadata values, and the backend choice a pure function of the Problem, the device the inputs
        live on and the Options (bound to this op): both are memoized per op on exactly that key, read
        again on every call (the metadata values, each input's type, shape and dtype, and the device of
        ``query``). A repeated call costs one key build and one comparison with the last key (a dict
        lookup when it differs).
        """
        mdv = metadata_values(inputs["attention_metadata"])
        try:
            query = inputs["query"]
            key = (mdv, arrays.device_key(query),
                   *[None if x is None else (type(x), x.shape, x.dtype) for x in _GET_TENSORS(inputs)])
            last = self._last
            if key == last[0]:
                return last[1]
            entry = self._problems.get(key)
        except (AttributeError, TypeError, ValueError):   # not an array, unhashable or odd shape/dtype: no memo
            key = entry = None
        if entry is None:
            infos = {name: _describe(name, inputs[name]) for name in _TENSOR_INPUTS}
            entry = [validate(self.attributes, infos, mdv, output_qk_max_bytes=self.options.output_qk_max_bytes), None]
            if key is None:
                return entry
            if len(self._problems) >= _MEMO_SIZE:
                self._problems.clear()
            self._problems[key] = entry
        self._last = (key, entry)   # one tuple, replaced whole: a thread reads an old or a new pair
        return entry

    def _problem(self, inputs: dict) -> Problem:
        """Validate the bound inputs (shapes, dtypes, attributes, host metadata) into a Problem (memoized)."""
        return self._memo_entry(inputs)[0]

    def _plan_of(self, inputs: dict) -> dispatch.Plan:
        entry = self._memo_entry(inputs)
        plan = entry[1]
        if plan is None:
            # A mix of host and device inputs, or no backend for the problem, raises here (never memoized).
            plan = entry[1] = dispatch.make_plan(entry[0], inputs, self.options, self._writes)
        return plan

    def plan(self, *args, **kwargs) -> dispatch.Plan:
        """Validate the inputs and pick a backend; returns the :class:`cupa.dispatch.Plan` (``problem``,
        ``backend``, ``device``, ``options``) the op keeps for inputs of this signature.

        Every contract violation checkable from shapes, dtypes, attributes and the host values
        of attention_metadata raises :class:`PagedAttentionError` here, before any backend runs.
        """
        return self._plan_of(self._bind(args, kwargs))

    def explain(self, *args, **kwargs) -> str:
        """Which backend these inputs would run on and, for every other backend, why not."""
        inputs = self._bind(args, kwargs)
        problem = self._problem(inputs)
        return dispatch.explain(problem, inputs, self.options)

    # -- execution ----------------------------------------------------------------
    def __call__(self, *args, out=None, stream=None, **kwargs):
        """Run the operator. Returns ``output``, or a tuple ``(output, output_qk?, lse?)`` when
        ``qk_output != 0`` or ``return_lse``.

        The caches are updated in place. See :func:`paged_attention` for every input.
        """
        inputs = self._bind(args, kwargs)          # what plan() does, inlined: this path runs every step
        entry = self._memo_entry(inputs)
        plan = entry[1]
        if plan is None:
            plan = entry[1] = dispatch.make_plan(entry[0], inputs, self.options, self._writes)
        if self.options.validate_data:
            validate_data(plan.problem, {name: arrays.to_host(inputs[name]) for name in _DATA_CHECKED})
        return plan.backend.run(plan, inputs, out, stream)


def paged_attention(query, key=None, value=None, key_cache=None, value_cache=None,
                    cumulative_sequence_length=None, past_seqlens=None, block_table=None,
                    cos_cache=None, sin_cache=None, slot_mapping=None, head_sink=None,
                    q_norm_weight=None, k_norm_weight=None, k_scale=None, v_scale=None,
                    attention_metadata=None, query_positions=None, attention_bias=None, *,
                    num_heads: int, kv_num_heads: int, scale: float = 0.0, softcap: float = 0.0,
                    local_window_size: int = -1, is_causal: int = 1, do_rotary: int = 0,
                    rotary_interleaved: int = 0, rotary_offset: int = 0, qk_norm_epsilon: float = 1e-6,
                    k_quant_type: str = "NONE", v_quant_type: str = "NONE", k_cache_dtype: str = "",
                    v_cache_dtype: str = "", kv_cache_layout: str = "SEPARATE", v_head_size: int = 0,
                    qk_output: int = 0, return_lse: bool = False, out=None, stream=None, options: Options = None):
    """Paged attention with ONNX Runtime ``com.microsoft::PagedAttention`` semantics.

    Positional order is the ONNX input order, so ``paged_attention(*node_inputs, **node_attributes)``
    runs an ONNX node (None for an absent input).

    Parameters
    ----------
    query : (N, H*D) or packed (N, (H+2*Hk)*D) array of T (float16, bfloat16, float32)
        Packed [Q|K|V] iff key and value are both absent (SEPARATE layout).
    key, value : (N, Hk*D) arrays of T, optional
        In LATENT layout key is the (N, D) latent row and value is absent.
    key_cache, value_cache : (num_blocks, block_size, Hk, D) arrays of T_CACHE
        Updated in place. T_CACHE is T, int8, float8_e4m3fn, or uint8 holding e4m3 bytes
        (``k_cache_dtype=v_cache_dtype="float8e4m3fn"``). value_cache is absent in LATENT.
    cumulative_sequence_length : (B+1,) int32
        Sequence b owns packed tokens [cum[b], cum[b+1]).
    past_seqlens : (B,) int32
        Tokens already cached for each sequence.
    block_table : (B, max_blocks) int32
        Physical block of each logical block; -1 (or out of range) is unmapped and masked.
    cos_cache, sin_cache : (max_pos, rotary_dim/2) arrays of T, optional
        Required iff ``do_rotary=1``.
    slot_mapping : (N,) int32, optional
        Flat write slot ``block*block_size + offset`` per token; -1 skips the write.
    head_sink : (H,) array of T, optional
        Per-head sink logit added to the softmax denominator.
    q_norm_weight, k_norm_weight : (D,) arrays of T, optional
        RMSNorm gains for Q and K (together).
    k_scale, v_scale : float32, (1,) PER_TENSOR or (Hk, 1, D) PER_CHANNEL, optional
        Present iff the corresponding quant type is not NONE.
    attention_metadata : host int32 sequence of 2 or 3 entries, optional
        Replay-wide bounds [max_query_len_bound, max_kv_len_bound(, max_kv_len_lower_bound)], 0 = unknown.
    query_positions : (N,) int32, optional
        Explicit logical position of each token.
    attention_bias : (B or 1, H or 1, q_capacity, kv_capacity) array of T, optional
        Added to the scaled scores before softcap.
    return_lse : bool, default False
        cupa extension: also return ``lse``, float32 (N, num_heads), the natural log of the sum of
        exp(score) over each token's admitted keys (the sink left out; -inf where no key is admitted).
    out : array, optional
        Preallocated (N, H*v_head_size) output of T in the library and device of ``query``.
    stream : optional
        CUDA stream (CuPy stream, torch stream, or a raw pointer); default: the caller's current stream.
    options : cupa.Options, optional
        Backend choice, launch route, byte limits, data validation; default ``cupa.Options()``.

    Returns
    -------
    output : (N, H*v_head_size) array of T, in the library of ``query``
    output_qk : (H, N, kv_capacity) float32, only when ``qk_output != 0``
    lse : (N, H) float32, only when ``return_lse``
        The outputs come back as a tuple in this order when more than ``output`` is asked for.
    """
    op = _op_for(num_heads, kv_num_heads, scale, softcap, local_window_size, is_causal, do_rotary,
                 rotary_interleaved, rotary_offset, qk_norm_epsilon, k_quant_type, v_quant_type, k_cache_dtype,
                 v_cache_dtype, kv_cache_layout, v_head_size, qk_output, return_lse, options)
    return op(query, key, value, key_cache, value_cache, cumulative_sequence_length, past_seqlens,
              block_table, cos_cache, sin_cache, slot_mapping, head_sink, q_norm_weight, k_norm_weight,
              k_scale, v_scale, attention_metadata, query_positions, attention_bias, out=out, stream=stream)


_ATTRIBUTE_ORDER = ("num_heads", "kv_num_heads", "scale", "softcap", "local_window_size", "is_causal", "do_rotary",
                    "rotary_interleaved", "rotary_offset", "qk_norm_epsilon", "k_quant_type", "v_quant_type",
                    "k_cache_dtype", "v_cache_dtype", "kv_cache_layout", "v_head_size", "qk_output", "return_lse",
                    "options")


@functools.lru_cache(maxsize=64, typed=True)
def _bound_op(*values) -> PagedAttention:
    return PagedAttention(**dict(zip(_ATTRIBUTE_ORDER, values)))


def _op_for(*values) -> PagedAttention:
    """The bound op of paged_attention()'s attribute values, reused across calls (its plan memo with it).

    ``typed=True``: values equal across types (``True`` and ``1``, ``1`` and ``1.0``) get separate ops, so
    a value the attributes reject (a bool) is rejected every time; unhashable values are not cached.
    """
    try:
        return _bound_op(*values)
    except TypeError:
        if any(_unhashable(v) for v in values):
            return PagedAttention(**dict(zip(_ATTRIBUTE_ORDER, values)))
        raise


def _unhashable(v) -> bool:
    try:
        hash(v)
    except TypeError:
        return True
    return False


__all__ = ["paged_attention", "PagedAttention", "Problem"]
