"""One engine step: the op inputs that :meth:`KVCacheManager.build_step` returns."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["Step"]


@dataclass
class Step:
    """The inputs of one step of every layer, on the cache's library and device.

    The arrays shared by every layer come first, then one block table and one slot mapping per
    layer group (``cache.group_of(layer)`` picks them). With ``fixed=True`` they are the same
    arrays at every step of one capacity, padded past the live rows and tokens (see
    :meth:`KVCacheManager.build_step`); otherwise they are sized to the step. Either way they are
    valid until the next ``build_step``, which overwrites them.

    Attributes
    ----------
    seq_ids : list
        The sequence of each batch row b, in row order (``batch_size`` entries).
    batch_size, token_count : int
        B and N of this step (the live rows and tokens; the arrays may be larger when fixed).
    cumulative_sequence_length : (B+1,) int32
        Sequence b owns packed tokens ``[cum[b], cum[b+1])`` (vLLM / SGLang ``query_start_loc`` /
        ``extend_start_loc``).
    past_seqlens : (B,) int32
        Tokens cached for sequence b before this step (vLLM ``seq_lens - query_lens``; SGLang
        ``extend_prefix_lens``).
    query_positions : (N,) int32
        Logical position of each packed token (vLLM ``positions``); -1 on padded tokens. Pass it
        to the op only when asked (``inputs(layer, query_positions=True)``): the op derives the same
        positions from ``past_seqlens``.
    block_tables : tuple of (B, max_blocks) int32, one per layer group
        Physical block of logical block i of sequence b; -1 where unmapped (below a window,
        padding rows).
    slot_mappings : tuple of (N,) int32, one per layer group
        Flat write slot ``block * block_size + offset`` of each token; -1 where the group writes
        nothing (prefix blocks it shares, padding tokens).
    attention_metadata : (2,) int32 NumPy array (host memory)
        ``[max_query_len_bound, max_kv_len_bound]``: the step's maxima, or replay-wide bounds
        (fixed) that stay valid for every step the arrays serve.
    query_lens, seq_lens, logits_indices : (B,) int32 NumPy arrays (host)
        New tokens, cached-after-the-step length (vLLM ``seq_lens``), and packed index of the
        last new token of each sequence (-1 for a row with no new token): the rows to sample.
    cache : KVCache
    """

    seq_ids: list
    batch_size: int
    token_count: int
    cumulative_sequence_length: Any
    past_seqlens: Any
    query_positions: Any
    block_tables: tuple
    slot_mappings: tuple
    attention_metadata: np.ndarray
    query_lens: np.ndarray
    seq_lens: np.ndarray
    logits_indices: np.ndarray
    cache: Any

    def inputs(self, layer: int, *, query_positions: bool = False) -> dict:
        """The op inputs of ``layer`` besides query / key / value, as keyword arguments.

        key_cache, value_cache (and k_scale / v_scale), cumulative_sequence_length, past_seqlens,
        block_table and slot_mapping of the layer's group, attention_metadata, and
        query_positions when asked.
        """
        g = self.cache.group_of(layer)
        inputs = self.cache.layer_inputs(layer)
        inputs.update(cumulative_sequence_length=self.cumulative_sequence_length, past_seqlens=self.past_seqlens,
                      block_table=self.block_tables[g], slot_mapping=self.slot_mappings[g],
                      attention_metadata=self.attention_metadata)
        if query_positions:
            inputs["query_positions"] = self.query_positions
        return inputs

    def attention(self, op, layer: int, query, key=None, value=None, **inputs):
        """``op(query, key, value, **self.inputs(layer), **inputs)``: run the layer's attention.

        ``op`` is a :class:`cupa.PagedAttention` bound with the layer's attributes
        (``cupa.PagedAttention(num_heads=H, **cache.attributes(layer))``). ``inputs`` adds or
        overrides op inputs (cos_cache, head_sink, ...) and takes ``out=`` / ``stream=``.
        """
        merged = self.inputs(layer)
        merged.update(inputs)
        return op(query, key, value, **merged)
