"""Layer kinds and layer groups: how the layers of one model share one block pool.

A :class:`LayerKind` says how a layer keeps its keys and values: full attention keeps every
position; a sliding-window layer (``local_window_size = W``) keeps them all (``"keep"``), recycles
``ceil((W + max_query_len - 1) / block_size) + 1`` blocks per sequence (``"ring"``, seed 9.3.2
policy 1), or returns the blocks below the window to the pool (``"evict"``, policy 2).

Layers of one kind are cut into :class:`LayerGroup` s of ``group_size`` layers. Every group has
its own block table per sequence, and layer ``j`` of every group stores its blocks in cache
tensor ``j``: a physical block id belongs to one group at a time, so full-attention and window
layers of one model (GPT-OSS alternates them) draw from one pool without reserving memory per
kind.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Union

from ..errors import fail

__all__ = ["LayerKind", "LayerGroup", "full_attention", "sliding_window", "group_layers", "POLICIES"]

#: what a sliding-window layer does with the blocks below its window
POLICIES = ("keep", "ring", "evict")


@dataclass(frozen=True)
class LayerKind:
    """How one attention layer uses the cache.

    Parameters
    ----------
    window : int, default -1
        ``local_window_size`` of the layer: -1 for full attention, W > 0 for a sliding window of W
        positions including the query's own.
    policy : {"keep", "ring", "evict"}, default "keep"
        Window layers only. "keep": every position stays cached (the window only masks). "ring":
        a ring of :meth:`ring_blocks` blocks per sequence, rewritten through ``slot_mapping``;
        block-table entries below the window are -1. "evict": blocks whose positions all lie
        below the window go back to the pool (their entries become -1); they stay in the prefix
        cache until evicted.
    max_query_len : int, default 1
        "ring" only: the most new tokens one sequence brings in one step (1 for decode; the chunk
        size for chunked prefill, k + 1 for k speculative tokens). It sizes the ring.
    """

    window: int = -1
    policy: str = "keep"
    max_query_len: int = 1

    def __post_init__(self):
        if isinstance(self.window, bool) or not isinstance(self.window, int) or (self.window != -1 and self.window < 1):
            raise fail("window", repr(self.window), "-1 (full attention) or a positive int (local_window_size)")
        if self.policy not in POLICIES:
            raise fail("policy", repr(self.policy), f"one of {POLICIES}")
        if self.window == -1 and self.policy != "keep":
            raise fail("policy", repr(self.policy), "'keep' for a full-attention layer (window=-1)")
        if isinstance(self.max_query_len, bool) or not isinstance(self.max_query_len, int) or self.max_query_len < 1:
            raise fail("max_query_len", repr(self.max_query_len), "a positive int")

    def __str__(self) -> str:
        if not self.is_window:
            return "full"
        ring = f", max_query_len={self.max_query_len}" if self.policy == "ring" and self.max_query_len > 1 else ""
        return f"window({self.window}, {self.policy}{ring})"

    @property
    def is_window(self) -> bool:
        return self.window > 0

    @property
    def shares_prefix(self) -> bool:
        """Whether blocks of this kind can be shared between sequences (a ring is private)."""
        return self.policy != "ring"

    def ring_blocks(self, block_size: int) -> int:
        """Blocks per sequence of a ring: ``ceil((W + max_query_len - 1) / block_size) + 1``.

        With ``max_query_len = 1`` this is seed 9.3.2's ``ceil(W / block_size) + 1``; the +1 absorbs
        the partially filled boundary block. A step that writes positions ``[p_min, p_max]`` touches
        logical blocks ``max(0, p_min - W + 1) // block_size .. p_max // block_size``; the ring holds
        them all without a live block being rewritten whenever ``p_max - p_min < max_query_len``.
        """
        if self.policy != "ring":
            raise fail("policy", repr(self.policy), "'ring' for ring_blocks()")
        return math.ceil((self.window + self.max_query_len - 1) / block_size) + 1

    def attention_attributes(self) -> dict:
        """The op attributes this kind fixes (``local_window_size`` for a window layer)."""
        return {"local_window_size": self.window} if self.is_window else {}


def full_attention() -> LayerKind:
    """A full-attention layer."""
    return LayerKind()


def sliding_window(window: int, policy: str = "evict", max_query_len: int = 1) -> LayerKind:
    """A sliding-window layer of ``window`` positions (``local_window_size``); see :class:`LayerKind`."""
    return LayerKind(window=window, policy=policy, max_query_len=max_query_len)


@dataclass(frozen=True)
class LayerGroup:
    """Layers of one kind that share one block table per sequence.

    Attributes
    ----------
    index : int
        Position of the group in ``KVCache.groups`` (the index of its block table in a Step).
    kind : LayerKind
    layers : tuple of int
        Model layer indices; ``layers[j]`` stores its blocks in cache tensor ``j``.
    """

    index: int
    kind: LayerKind
    layers: tuple


def _as_kinds(layers: Union[int, Sequence[Optional[LayerKind]]]) -> list:
    if isinstance(layers, bool):
        raise fail("layers", repr(layers), "a layer count or a sequence of LayerKind (one per layer)")
    if isinstance(layers, int):
        if layers < 1:
            raise fail("layers", layers, "a positive layer count")
        return [LayerKind()] * layers
    try:
        kinds = [LayerKind() if k is None else k for k in layers]
    except TypeError:
        raise fail("layers", type(layers).__name__, "a layer count or a sequence of LayerKind (one per layer)")
    if not kinds:
        raise fail("layers", "an empty sequence", "at least one layer")
    for i, k in enumerate(kinds):
        if not isinstance(k, LayerKind):
            raise fail(f"layers[{i}]", repr(k), "a cupa.serving.LayerKind (or None for full attention)")
    return kinds


def group_layers(layers: Union[int, Sequence[Optional[LayerKind]]], group_size: Optional[int] = None):
    """Cut the layers of each kind into groups of ``group_size`` layers.

    Parameters
    ----------
    layers : int or sequence of LayerKind
        A layer count (all full attention) or one kind per layer (None = full attention).
    group_size : int, optional
        Layers per group, default the smallest count of layers of one kind. The last group of a
        kind may be shorter (its cache tensors past its length are unused by it).

    Returns
    -------
    groups : tuple of LayerGroup
    layer_slots : tuple of (group index, tensor index), one per layer
    """
    kinds = _as_kinds(layers)
    by_kind: dict = {}
    for i, k in enumerate(kinds):
        by_kind.setdefault(k, []).append(i)
    if group_size is None:
        group_size = min(len(v) for v in by_kind.values())
    elif isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise fail("group_size", repr(group_size), "a positive int")
    groups, slots = [], [None] * len(kinds)
    for kind, idx in by_kind.items():
        for start in range(0, len(idx), group_size):
            members = tuple(idx[start:start + group_size])
            g = len(groups)
            groups.append(LayerGroup(g, kind, members))
            for j, layer in enumerate(members):
                slots[layer] = (g, j)
    return tuple(groups), tuple(slots)
