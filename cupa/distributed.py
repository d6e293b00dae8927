"""Attention across processes and GPUs on ``torch.distributed`` (docs/distributed.md).

Two ways to spread one attention call over the ranks of a process group (NCCL between GPUs, gloo
between CPU processes), built on the attention states of :mod:`cupa.states`:

- **Context parallel** (:class:`ContextParallelAttention`): each rank holds a share of every
  sequence's KV -- its own pages, and a block table that maps only its share (-1 elsewhere) -- and the
  same query. Each rank computes its partial state (``return_lse``, no head_sink), the ranks
  all-gather the partial outputs and lses, and every rank merges them with
  :func:`cupa.merge_states`, counting head_sink once. Every rank ends with the same output.
- **Tensor parallel by heads** (:func:`head_range`, :func:`shard_heads`, :func:`gather_heads`): each
  rank owns ``num_heads / world_size`` query heads and their KV heads (replicated when there are
  fewer KV heads than ranks) and calls cupa on them alone; no exchange is needed for the attention
  itself.

This module imports torch; ``import cupa`` never does (install the ``distributed`` extra, or torch).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .api import PagedAttention, bind_inputs
from .contract import INPUT_NAMES
from .errors import fail
from .options import Options
from .states import merge_states

__all__ = ["ContextParallelAttention", "context_parallel_attention", "head_range", "shard_heads", "gather_heads"]

# torch 2.13 names the single-tensor all-gather all_gather_single; older releases all_gather_into_tensor.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _gather_stacked(x: torch.Tensor, group) -> torch.Tensor:
    """``x`` of every rank of ``group``, stacked: (world_size, *x.shape), in rank order."""
    world = dist.get_world_size(group)
    out = torch.empty((world * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_single(out, x.contiguous(), group=group)   # the concatenated form: every backend takes it
    return out.view(world, *x.shape)


class ContextParallelAttention:
    """Paged attention over KV sharded by position across the ranks of a process group.

    Every rank calls it with the same query, key/value, cumulative_sequence_length and attributes,
    and with its own share of the KV: its ``key_cache``/``value_cache`` pages and a ``block_table``
    that maps only the blocks it holds (-1 elsewhere; past_seqlens and positions are the global
    ones), or a position-shifted share (docs/attention_states.md: ``past_seqlens - start``, the block
    table from ``start / block_size`` on, ``cos_cache[start:]``; decode only). The shares of one
    sequence are disjoint and together its whole KV; the rank holding a new token's block writes it.

    Parameters
    ----------
    num_heads, kv_num_heads, **attributes
        As :class:`cupa.PagedAttention` (``return_lse`` included; not ``qk_output``).
    group : torch.distributed.ProcessGroup, optional
        Default: the default group.
    options : cupa.Options, optional

    The call returns ``output`` (or ``(output, lse)``), the same on every rank: each rank computes its
    partial state without head_sink, the partial outputs and lses are all-gathered (two collectives),
    and :func:`cupa.merge_states` merges them in rank order with head_sink. Inputs are torch tensors on
    the group's device kind (CUDA tensors with NCCL, CPU tensors with gloo); on the GPU nothing
    synchronizes with the host.
    """

    def __init__(self, *, num_heads: int = None, kv_num_heads: int = None, group=None, options: Options = None,
                 **attributes: Any):
        local = PagedAttention(num_heads=num_heads, kv_num_heads=kv_num_heads, options=options, **attributes)
        a = local.attributes
        if a.qk_output:
            raise fail("qk_output", a.qk_output, "0: ContextParallelAttention returns no output_qk")
        self.attributes, self.group = a, group
        parts = {k: v for k, v in a.as_dict().items() if k != "return_lse"}
        self._local = PagedAttention(**parts, return_lse=True, options=local.options)

    def __call__(self, *args, out=None, **kwargs):
        """This rank's share in, the merged ``output`` (``(output, lse)`` with ``return_lse``) out."""
        inputs = bind_inputs(args, kwargs)
        query = inputs["query"]
        if not isinstance(query, torch.Tensor):
            raise fail("query", f"a {type(query).__module__}.{type(query).__qualname__}",
                       "a torch tensor (the ranks exchange partial states through torch.distributed)")
        sink = inputs["head_sink"]
        inputs["head_sink"] = None   # counted once, in the merge
        output, lse = self._local(*(inputs[n] for n in INPUT_NAMES))
        outputs, lses = _gather_stacked(output, self.group), _gather_stacked(lse, self.group)
        merged, merged_lse = merge_states(outputs, lses, head_sink=sink, out=out)
        return (merged, merged_lse) if self.attributes.return_lse else merged


def context_parallel_attention(*args, group=None, out=None, options: Options = None, **kwargs):
    """:class:`ContextParallelAttention` as a function (inputs by position or keyword, attributes by
    keyword); bind the class once to keep its plan memo."""
    from .contract import Attributes

    names = set(Attributes.names())
    attributes = {k: kwargs.pop(k) for k in list(kwargs) if k in names}
    return ContextParallelAttention(group=group, options=options, **attributes)(*args, out=out, **kwargs)


# ------------------------------------------------------------------------------------------------
# tensor parallel by heads

def head_range(rank: int, world_size: int, num_heads: int, kv_num_heads: int) -> tuple:
    """``(q0, q1, kv0, kv1)``: the query heads [q0, q1) and KV heads [kv0, kv1) rank ``rank`` owns.

    Each rank owns ``num_heads / world_size`` consecutive query heads (a whole part of a GQA group or
    several whole groups) and the KV heads they read: ``kv_num_heads / world_size`` of them when there
    are at least as many KV heads as ranks, else the one KV head of its query heads (each KV head then
    replicated on ``world_size / kv_num_heads`` ranks). Raises PagedAttentionError when the heads do
    not divide that way.
    """
    H, Hk, tp = num_heads, kv_num_heads, world_size
    if tp < 1 or not 0 <= rank < tp:
        raise fail("rank", rank, f"an integer in [0, world_size={tp})")
    if H % tp:
        raise fail("num_heads", H, f"a multiple of world_size ({tp})")
    if Hk >= tp and Hk % tp:
        raise fail("kv_num_heads", Hk, f"a multiple of world_size ({tp}) or a divisor of it")
    if Hk < tp and tp % Hk:
        raise fail("kv_num_heads", Hk, f"a multiple of world_size ({tp}) or a divisor of it")
    q0, q1 = rank * H // tp, (rank + 1) * H // tp
    if Hk >= tp:
        kv0, kv1 = rank * Hk // tp, (rank + 1) * Hk // tp
    else:
        kv0 = q0 // (H // Hk)
        kv1 = kv0 + 1
    return q0, q1, kv0, kv1


def shard_heads(inputs: dict, attributes: dict, rank: int, world_size: int) -> tuple:
    """The share of rank ``rank`` of a call's inputs and attributes under tensor parallelism by heads.

    Parameters
    ----------
    inputs : dict
        Input name -> array (torch tensors or NumPy arrays) of the whole call, as for
        :func:`cupa.paged_attention` by keyword.
    attributes : dict
        Its attributes (``num_heads``, ``kv_num_heads``, ...).

    Returns
    -------
    (dict, dict)
        The rank's inputs -- query/key/value columns of its heads (packed QKV re-packed), the caches'
        KV-head slices (copies: in a real deployment each rank allocates only its own), head_sink,
        PER_CHANNEL scales and a per-head attention_bias sliced, everything else as given -- and its
        attributes (``num_heads``, ``kv_num_heads`` of the share).
    """
    H, Hk = attributes["num_heads"], attributes["kv_num_heads"]
    q0, q1, kv0, kv1 = head_range(rank, world_size, H, Hk)
    latent = attributes.get("kv_cache_layout", "SEPARATE") in ("LATENT", b"LATENT")
    query = inputs["query"]
    packed = inputs.get("key") is None and not latent
    D = query.shape[1] // (H + 2 * Hk) if packed else query.shape[1] // H
    local = dict(inputs)

    def cols(x, first, last):
        return _contiguous(x[:, first * D:last * D])

    if packed:
        q, k, v = query[:, :H * D], query[:, H * D:(H + Hk) * D], query[:, (H + Hk) * D:]
        local["query"] = _cat([cols(q, q0, q1), cols(k, kv0, kv1), cols(v, kv0, kv1)])
    else:
        local["query"] = cols(query, q0, q1)
        if not latent:
            local["key"], local["value"] = cols(inputs["key"], kv0, kv1), cols(inputs["value"], kv0, kv1)
    if not latent:
        for name in ("key_cache", "value_cache"):
            local[name] = _contiguous(inputs[name][:, :, kv0:kv1])
    for name in ("k_scale", "v_scale"):
        s = inputs.get(name)
        if s is not None and len(s.shape) == 3:
            local[name] = _contiguous(s[kv0:kv1])
    if inputs.get("head_sink") is not None:
        local["head_sink"] = _contiguous(inputs["head_sink"][q0:q1])
    bias = inputs.get("attention_bias")
    if bias is not None and bias.shape[1] == H:
        local["attention_bias"] = _contiguous(bias[:, q0:q1])
    return local, dict(attributes, num_heads=q1 - q0, kv_num_heads=kv1 - kv0)


def _contiguous(x):
    return x.contiguous() if isinstance(x, torch.Tensor) else x.copy()


def _cat(parts):
    if isinstance(parts[0], torch.Tensor):
        return torch.cat(parts, dim=1)
    import numpy as np

    return np.concatenate(parts, axis=1)


def gather_heads(output: torch.Tensor, group=None) -> torch.Tensor:
    """The outputs (N, H_local*Dv) of every rank's heads, all-gathered into (N, H*Dv) in head order.

    A tensor-parallel model usually needs no gather (its output projection is row-parallel and
    all-reduces); this reassembles the whole attention output, e.g. to check it against one process.
    """
    stacked = _gather_stacked(output, group)            # (world, N, H_local*Dv)
    return stacked.permute(1, 0, 2).reshape(output.shape[0], -1)
