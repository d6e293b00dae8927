"""cupa as an attention implementation of HuggingFace transformers (``pip install cupa[transformers]``).

One call, :func:`register`, adds an attention implementation (``AttentionInterface``) and the mask
function it needs (``AttentionMaskInterface``) under one name, ``"cupa"`` by default::

    from cupa.integrations import transformers as cupa_tf

    cupa_tf.register()
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="cupa")
    cache = cupa_tf.CupaCache(model.config, max_cache_len=4096)
    out = model.generate(**inputs, cache=cache, max_new_tokens=64)

Every call goes through the ``cupa::paged_attention`` operator of :mod:`cupa.torch`, so a compiled
model keeps it as one graph node; torch CPU tensors run the NumPy reference, CUDA tensors cupa's kernels.
What the model does before attention passes through unchanged: RoPE and QK-norm are applied by the
model (the operator runs with ``do_rotary=0`` and no norm weights), and the module's ``scaling``,
``sliding_window``, ``softcap`` and attention sinks (``s_aux``, GPT-OSS) become the operator's
``scale``, ``local_window_size``, ``softcap`` and ``head_sink``; GQA comes from the shapes.

The attention function serves four kinds of call, told apart by what transformers passes:

``model.generate(..., cache=CupaCache(...))``
    The cache holds every layer's ``key_cache``/``value_cache`` pages and one block table;
    ``CupaCache.update`` stores nothing and hands the layer to the attention function, where cupa
    writes the new keys and values into the pages and attends (no per-step copy of the history).
    Left padding is masked by packing each batch row as two cupa sequences: its padding tokens (no
    cache blocks: nothing written, zero output) and its real tokens, whose logical positions count
    real tokens only. The mask function derives those sequences from the 2D attention mask on the
    device (no host synchronization); padding must be on the left, as ``generate`` pads decoder-only
    models (checked where the mask is on the CPU).
continuous batching, decode fast path (``block_table`` and ``k_cache``/``v_cache`` in the kwargs)
    transformers' paged cache already has cupa's page layout ``(num_pages, page_size, Hk, D)``:
    cupa writes the new token into it through transformers' block table and attends. Its K and V
    page views are one buffer, V a page after K (block ids even): the call runs with
    ``cupa.Options(kv_pages_interleaved=True)``, which accepts caches laid out that way.
continuous batching, varlen path (``cu_seq_lens_q``/``cu_seq_lens_k``, keys already gathered)
    The cache has written the new keys and gathered each sequence's history contiguously; cupa
    attends to that gathered tensor in place, as a cache of one-token blocks (no second gather).
no cache, or a transformers ``DynamicCache`` (dense keys ``(B, Hk, S, D)``)
    The dense keys are copied into a one-token-block cache for the call (a copy of the history per
    step with a ``DynamicCache``: pass a :class:`CupaCache` to avoid it).

Continuous batching: transformers 5.24 admits only ``paged|eager``, ``sdpa`` and flash names in
``ContinuousBatchingManager.switch_to_cb_friendly_attn``, and offers its decode fast path (block
tables) to FlashAttention on CUDA only (``initialization.ensure_decode_fast_path_is_available``).
:func:`register` wraps these two functions, for the registered cupa names only and only on the
transformers releases listed in :data:`CONTINUOUS_BATCHING_RELEASES` (elsewhere it leaves
transformers untouched and ``generate_batch`` refuses the name as before): the first returns without
switching the implementation, the second keeps the fast path on for every device. Every other name
goes to the original functions.

docs/integrations.md has the snippets and the limits.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import threading
from typing import Any, Optional

import numpy as np
import torch
import transformers
from transformers import AttentionInterface, Cache
from transformers.cache_utils import CacheLayerMixin
from transformers.masking_utils import AttentionMaskInterface

from .. import PagedAttention, PagedAttentionError
from .. import torch as cupa_torch
from ..errors import fail
from ..options import Options, resolve as _resolve_options

__all__ = ["register", "CupaCache", "attention_forward", "mask_function", "trace", "TracedCall",
           "CONTINUOUS_BATCHING_RELEASES"]

log = logging.getLogger("cupa")

#: transformers releases (major, minor) whose continuous-batching allow-list the adaptation was tested with
CONTINUOUS_BATCHING_RELEASES = ((5, 24),)

#: registered name -> cupa.Options for its calls
_NAMES: dict = {}
#: the registered names admitted to continuous batching
_CB_NAMES: set = set()
_lock = threading.Lock()


def register(name: str = "cupa", *, options: Optional[Options] = None, continuous_batching: bool = True) -> str:
    """Register cupa as the transformers attention implementation ``name``; returns ``name``.

    Parameters
    ----------
    name : str, default "cupa"
        The ``attn_implementation`` to load or set models with. Registering another name with other
        ``options`` gives a second implementation (for example ``options=cupa.Options(backend=...)``).
    options : cupa.Options, optional
        Options of every cupa call made under this name.
    continuous_batching : bool, default True
        Also admit ``name`` to ``model.generate_batch`` (see the module docstring); a warning and no
        change where the installed transformers is not one of :data:`CONTINUOUS_BATCHING_RELEASES`.
    """
    if not isinstance(name, str) or not name or name in ("eager", "sdpa", "paged|eager") or "flash" in name:
        raise fail("name", repr(name), "a new attention implementation name (not eager/sdpa, no 'flash' in it: "
                   "transformers treats such names as FlashAttention)")
    with _lock:
        _NAMES[name] = _resolve_options(options)
        AttentionInterface.register(name, attention_forward)
        AttentionMaskInterface.register(name, mask_function)
        if continuous_batching and _admit_to_continuous_batching():
            _CB_NAMES.add(name)
    return name


# -- tracing: what cupa was asked to do ----------------------------------------------------------

@dataclasses.dataclass
class TracedCall:
    """One attention call made under :func:`trace`: the layer, the path it took, the operator and its inputs."""

    layer_idx: Optional[int]
    path: str
    op: PagedAttention
    inputs: dict

    def explain(self) -> str:
        """:meth:`cupa.PagedAttention.explain` for this call's inputs: the backend and why."""
        return self.op.explain(**self.inputs)


_traced: Optional[list] = None     # the list trace() collects into, or None


@contextlib.contextmanager
def trace():
    """Collect every cupa attention call made inside the block, on any thread, as :class:`TracedCall` s.

    Continuous batching runs the model on a thread of its own: its calls are collected too.

    Examples
    --------
    >>> with cupa_tf.trace() as calls:
    ...     model.generate(**inputs, cache=cache, max_new_tokens=2)
    >>> print(calls[0].path, calls[0].explain())
    """
    global _traced
    calls: list = []
    previous, _traced = _traced, calls
    try:
        yield calls
    finally:
        _traced = previous


# -- the paged cache -------------------------------------------------------------------------------

class _BlockPool:
    """The free block ids of a pool of ``num_blocks`` blocks, as a stack (host NumPy)."""

    def __init__(self, num_blocks: int):
        self.num_blocks = 0
        self.free = np.zeros(0, dtype=np.int32)
        self.grow(num_blocks)

    def grow(self, num_blocks: int) -> None:
        new = np.arange(self.num_blocks, num_blocks, dtype=np.int32)[::-1]
        self.free = np.concatenate([new, self.free])
        self.num_blocks = num_blocks

    def allocate(self, n: int) -> Optional[np.ndarray]:
        """``n`` block ids, or None when fewer are free."""
        if n > self.free.size:
            return None
        ids, self.free = self.free[self.free.size - n:][::-1].copy(), self.free[:self.free.size - n]
        return ids

    def release(self, ids: np.ndarray) -> None:
        self.free = np.concatenate([self.free, np.asarray(ids, dtype=np.int32)[::-1]])


class _CupaLayer(CacheLayerMixin):
    """One decoder layer of a :class:`CupaCache`: its pages and how many (padded) tokens it has seen."""

    is_compileable = False
    is_croppable = True

    def __init__(self, cache: "CupaCache", layer_idx: int, is_sliding: bool):
        super().__init__()
        self.cache = cache
        self.layer_idx = layer_idx
        self.is_sliding = is_sliding
        self.seen = 0
        self.key_cache: Optional[torch.Tensor] = None
        self.value_cache: Optional[torch.Tensor] = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.cache._initialize(key_states)
        shape = (self.cache.pool.num_blocks, self.cache.block_size, key_states.shape[1], key_states.shape[3])
        self.key_cache = torch.zeros(shape, dtype=key_states.dtype, device=key_states.device)
        self.value_cache = torch.zeros(shape, dtype=value_states.dtype, device=value_states.device)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Record the step and hand this layer to the attention function; the keys are written there, by cupa."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.seen += key_states.shape[2]
        self.cache._reserve(self.seen)
        step_kwargs = kwargs.get("kwargs")
        if step_kwargs is None:
            raise PagedAttentionError(
                "cache: got a model whose attention calls cache.update() without its kwargs; expected a model "
                "that passes them (cache.update(key, value, layer_idx, kwargs=kwargs)), so that CupaCache can "
                "hand its pages to the cupa attention function")
        step_kwargs["cupa_layer"] = self
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1 if self.cache.max_cache_len is None else self.cache.max_cache_len

    def reset(self) -> None:
        self.seen = 0

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise fail("tokens_to_remove", tokens_to_remove, "a negative number of tokens to remove, or 0")
        self.seen = max(0, self.seen + tokens_to_remove)

    def reorder_cache(self, beam_idx) -> None:
        raise NotImplementedError("CupaCache does not reorder rows (beam search); use greedy or sampling")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.seen:
            raise NotImplementedError("CupaCache cannot repeat rows that hold tokens")

    def batch_select_indices(self, indices) -> None:
        raise NotImplementedError("CupaCache does not select rows")

    def offload(self):
        raise NotImplementedError("CupaCache does not offload layers")

    def prefetch(self):
        raise NotImplementedError("CupaCache does not offload layers")


class CupaCache(Cache):
    """A ``transformers.Cache`` whose pages and block table are cupa's: pass it to ``model.generate(cache=...)``.

    Every decoder layer owns ``key_cache`` and ``value_cache`` tensors of shape ``(num_blocks,
    block_size, Hk, D)`` in the model's dtype and device (allocated at the first forward); one block
    table maps each batch row's logical blocks to physical blocks of all layers. Blocks are handed
    out as the rows grow. With ``num_blocks`` (or ``max_cache_len``) the pool has a fixed size and
    the tensors never move (what torch.compile and CUDA graphs need); otherwise it doubles when it
    runs out, copying the pages once.

    Parameters
    ----------
    config : transformers.PretrainedConfig
        The model's config (its text config is used): the number of layers and which are sliding.
    max_cache_len : int, optional
        Most tokens (padding included) one row will hold; sizes the block table and, without
        ``num_blocks``, the pool (``batch_size * ceil(max_cache_len / block_size)`` blocks).
    block_size : int, default 16
        Tokens per block.
    num_blocks : int, optional
        Blocks in the pool, shared by all rows.

    Notes
    -----
    Beam search (row reordering) and offloading are not supported; ``crop`` (assisted decoding) is.
    """

    def __init__(self, config, max_cache_len: Optional[int] = None, block_size: int = 16,
                 num_blocks: Optional[int] = None):
        for argname, v, allow_none in (("max_cache_len", max_cache_len, True), ("block_size", block_size, False),
                                       ("num_blocks", num_blocks, True)):
            if (v is None and not allow_none) or (v is not None and (isinstance(v, bool) or not isinstance(v, int)
                                                                     or v < 1)):
                raise fail(argname, repr(v), "a positive integer" + (" or None" if allow_none else ""))
        text = config.get_text_config(decoder=True)
        layer_types = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
        self.max_cache_len = max_cache_len
        self.block_size = block_size
        self.fixed_pool = num_blocks is not None or max_cache_len is not None
        self._num_blocks = num_blocks
        self.pool: Optional[_BlockPool] = None
        self._batch = 0
        self.device = None
        self.blocks_per_row = 0           # blocks every row holds (rows grow together: the padded length)
        self.table = np.zeros((0, 0), dtype=np.int32)
        self.block_table: Optional[torch.Tensor] = None   # (2B, width) int32: even rows -1 (padding), odd rows
        self._pinned: Optional[torch.Tensor] = None        # CUDA: the host side of block_table's copies
        self._copied = None                                 # CUDA: event after the last copy out of _pinned
        super().__init__(layers=[_CupaLayer(self, i, t == "sliding_attention") for i, t in enumerate(layer_types)])

    # -- allocation (host) --------------------------------------------------------------------------
    def _initialize(self, key_states: torch.Tensor) -> None:
        if self.pool is not None:
            if key_states.shape[0] != self._batch:
                raise fail("key_states", f"a batch of {key_states.shape[0]} rows",
                           f"{self._batch} rows, the batch this CupaCache was filled with")
            return
        self._batch = int(key_states.shape[0])
        self.device = key_states.device
        width = -(-self.max_cache_len // self.block_size) if self.max_cache_len is not None else \
            max(1, -(-2 * int(key_states.shape[2]) // self.block_size))
        num_blocks = self._num_blocks if self._num_blocks is not None else self._batch * width
        self.pool = _BlockPool(num_blocks)
        self._set_width(width)

    def _set_width(self, width: int) -> None:
        table = np.full((self._batch, width), -1, dtype=np.int32)
        table[:self.table.shape[0], :self.table.shape[1]] = self.table
        self.table = table
        self._publish()

    def _publish(self) -> None:
        """Copy the host table to the device table (in place while its width holds: the same pointer every step).

        On CUDA the copy goes through a pinned buffer without blocking the host; the buffer is rewritten
        only after the previous copy out of it (made ``block_size`` steps earlier at least) has completed.
        """
        shape = (2 * self._batch, self.table.shape[1])
        same = self.block_table is not None and tuple(self.block_table.shape) == shape
        if self.device.type != "cuda":
            both = torch.full(shape, -1, dtype=torch.int32)
        elif same:
            self._copied.synchronize()
            both = self._pinned
        else:
            both = self._pinned = torch.empty(shape, dtype=torch.int32, pin_memory=True)
        view = both.numpy()
        view[0::2] = -1
        view[1::2] = self.table
        if same:
            self.block_table.copy_(both, non_blocking=True)
        else:
            self.block_table = both.to(self.device, non_blocking=True)
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()

    def _reserve(self, length: int) -> None:
        """Give every row blocks for ``length`` tokens (their padded length)."""
        need = -(-length // self.block_size)
        if need <= self.blocks_per_row:
            return
        if need > self.table.shape[1]:
            if self.max_cache_len is not None:
                raise fail("cache", f"{length} tokens in a row", f"at most max_cache_len={self.max_cache_len}")
            self._set_width(max(need, 2 * self.table.shape[1]))
        count = (need - self.blocks_per_row) * self._batch
        ids = self.pool.allocate(count)
        if ids is None:
            if self.fixed_pool:
                raise fail("cache", f"{count} more blocks for {length} tokens a row",
                           f"at most the {self.pool.free.size} free of num_blocks={self.pool.num_blocks}")
            self._grow(max(2 * self.pool.num_blocks, self.pool.num_blocks + count))
            ids = self.pool.allocate(count)
        self.table[:, self.blocks_per_row:need] = ids.reshape(self._batch, need - self.blocks_per_row)
        self.blocks_per_row = need
        self._publish()

    def _grow(self, num_blocks: int) -> None:
        extra = num_blocks - self.pool.num_blocks
        self.pool.grow(num_blocks)
        for layer in self.layers:
            if layer.key_cache is not None:
                pad = layer.key_cache.new_zeros((extra, *layer.key_cache.shape[1:]))
                layer.key_cache = torch.cat([layer.key_cache, pad])
                layer.value_cache = torch.cat([layer.value_cache, pad])
        log.info("cupa: CupaCache grew to %d blocks", num_blocks)

    # -- the Cache API --------------------------------------------------------------------------------
    def reset(self) -> None:
        super().reset()
        if self.pool is not None:
            used = self.table[:, :self.blocks_per_row].ravel()
            self.pool.release(used[used >= 0])
            self.table[:] = -1
            self.blocks_per_row = 0
            self._publish()

    @property
    def is_compileable(self) -> bool:
        return False


# -- the mask function: each batch row as two cupa sequences -------------------------------------------

@dataclasses.dataclass
class _Rows:
    """Per batch row, on the device: padding among the new tokens and real tokens before them.

    ``cumulative_sequence_length`` (2B+1,) and ``past_seqlens`` (2B,) describe row b as sequence 2b
    (its padding tokens: no past) and sequence 2b+1 (its real tokens), both int32.
    """

    new_padding: torch.Tensor          # (B,) int32
    past_real: torch.Tensor            # (B,) int32
    cumulative_sequence_length: torch.Tensor
    past_seqlens: torch.Tensor
    kv_length: int                     # positions the mask covers: padded past + q_length


def _rows(new_padding: torch.Tensor, past_real: torch.Tensor, q_length: int, kv_length: int) -> _Rows:
    batch = new_padding.shape[0]
    starts = torch.arange(batch, dtype=torch.int32, device=new_padding.device) * q_length
    cum = torch.stack([starts, starts + new_padding], dim=1).reshape(-1)
    cum = torch.cat([cum, cum.new_full((1,), batch * q_length)])
    past = torch.stack([torch.zeros_like(past_real), past_real], dim=1).reshape(-1)
    return _Rows(new_padding, past_real, cum, past, kv_length)


def _rows_from_mask(attention_mask: Optional[torch.Tensor], batch_size: int, q_length: int, kv_length: int,
                    device) -> _Rows:
    if attention_mask is None:
        new_padding = torch.zeros(batch_size, dtype=torch.int32, device=device)
        past_real = torch.full((batch_size,), kv_length - q_length, dtype=torch.int32, device=device)
        return _rows(new_padding, past_real, q_length, kv_length)
    if attention_mask.dim() != 2:
        raise fail("attention_mask", f"a {attention_mask.dim()}D mask",
                   "the 2D padding mask (batch, kv_length): cupa attention builds its own masking")
    mask = attention_mask.to(device=device, dtype=torch.bool)
    if mask.device.type == "cpu" and mask.shape[1] > 1 and bool((mask[:, 1:] < mask[:, :-1]).any()):
        raise fail("attention_mask", "padding after a real token",
                   "left padding only (padding tokens before every real token of a row)")
    new_real = mask[:, mask.shape[1] - q_length:].sum(dim=1, dtype=torch.int32)
    past_real = mask[:, :mask.shape[1] - q_length].sum(dim=1, dtype=torch.int32)
    return _rows(q_length - new_real, past_real, q_length, mask.shape[1])


def mask_function(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                  mask_function=None, attention_mask: Optional[torch.Tensor] = None, use_vmap: bool = False,
                  device="cpu", **kwargs) -> _Rows:
    """The ``AttentionMaskInterface`` entry of cupa: the batch rows as cupa sequences (see :class:`_Rows`).

    Called by transformers' mask builders with the 2D padding mask; returns what the attention
    function needs to mask padding and causality itself. Extra mask patterns (``or_mask_function``
    / ``and_mask_function``, which transformers signals with ``use_vmap=True``) are refused.
    """
    if use_vmap:
        raise fail("mask_function", "a custom mask pattern (or_mask_function / and_mask_function)",
                   "the causal or sliding-window patterns cupa attention implements")
    return _rows_from_mask(attention_mask, batch_size, q_length, kv_length, device)


# -- the attention function --------------------------------------------------------------------------

def _heads_to_tokens(x: torch.Tensor) -> torch.Tensor:
    """(B, heads, S, D) -> (B*S, heads*D), contiguous (a copy only when the layout is head-major)."""
    b, h, s, d = x.shape
    return x.transpose(1, 2).reshape(b * s, h * d)


def _gathered_block_table(starts: torch.Tensor, lengths: torch.Tensor, width: int) -> torch.Tensor:
    """(S, width) int32: row s maps logical position j < lengths[s] to one-token block starts[s] + j, else -1."""
    j = torch.arange(width, dtype=torch.int32, device=starts.device)
    table = starts[:, None] + j[None, :]
    return torch.where(j[None, :] < lengths[:, None], table, table.new_full((), -1)).to(torch.int32)


def _call(name: str, module, path: str, query, key, value, key_cache, value_cache, cum, past, block_table,
          slot_mapping, head_sink, metadata, *, scaling, sliding_window, softcap, is_causal,
          interleaved_pages: bool = False):
    """One ``cupa::paged_attention`` call with the module's features as attributes (recorded under :func:`trace`).

    ``interleaved_pages``: the caches are transformers' paged cache, K and V pages of one buffer a page
    apart (``Options(kv_pages_interleaved=True)``)."""
    attrs = dict(num_heads=query.shape[1] // key_cache.shape[-1], kv_num_heads=key_cache.shape[2],
                 scale=0.0 if scaling is None else float(scaling), softcap=float(softcap or 0.0),
                 local_window_size=int(sliding_window) if sliding_window else -1, is_causal=int(is_causal))
    options = _NAMES[name]
    if interleaved_pages:
        options = dataclasses.replace(options, kv_pages_interleaved=True)
    inputs = dict(query=query, key=key, value=value, key_cache=key_cache, value_cache=value_cache,
                  cumulative_sequence_length=cum, past_seqlens=past, block_table=block_table,
                  slot_mapping=slot_mapping, head_sink=head_sink, attention_metadata=metadata)
    calls = _traced
    if calls is not None:
        calls.append(TracedCall(getattr(module, "layer_idx", None), path,
                                PagedAttention(**attrs, options=options), dict(inputs)))
    return cupa_torch.paged_attention(**inputs, **attrs, options=options)


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask, dropout: float = 0.0, scaling: Optional[float] = None,
                      sliding_window: Optional[int] = None, softcap: Optional[float] = None,
                      is_causal: Optional[bool] = None, s_aux: Optional[torch.Tensor] = None,
                      **kwargs) -> tuple[torch.Tensor, None]:
    """The ``AttentionInterface`` entry of cupa (see the module docstring for the three kinds of call).

    Parameters
    ----------
    module : the attention module (its ``config._attn_implementation`` names the registration)
    query : (B, H, Sq, D) tensor, after the model's RoPE and QK-norm
    key, value : (B, Hk, Sk, D) tensors: the new tokens (CupaCache), the gathered history
        (continuous batching, B = 1), or the dense history (no cache, DynamicCache)
    attention_mask : what cupa's mask function returned, or None

    Returns
    -------
    (output, None) : output (B, Sq, H, D) in query's dtype; no attention weights
    """
    name = module.config._attn_implementation
    if dropout:
        raise fail("dropout", dropout, "0.0: cupa attention is inference-only (call model.eval())")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    batch, num_heads, q_length, head_size = query.shape
    head_sink = None if s_aux is None else s_aux.detach().to(query.dtype)
    feature = dict(scaling=scaling, sliding_window=sliding_window, softcap=softcap, is_causal=is_causal)
    layer = kwargs.get("cupa_layer")

    if layer is not None:                                           # generate with a CupaCache
        rows = attention_mask if isinstance(attention_mask, _Rows) else \
            _rows_from_mask(attention_mask, batch, q_length, layer.seen, query.device)
        if rows.kv_length != layer.seen:
            raise fail("attention_mask", f"a mask of {rows.kv_length} positions",
                       f"{layer.seen} positions: the tokens this CupaCache layer has seen, this step's included")
        cache = layer.cache
        out = _call(name, module, "cupa cache", _heads_to_tokens(query), _heads_to_tokens(key),
                    _heads_to_tokens(value), layer.key_cache, layer.value_cache, rows.cumulative_sequence_length,
                    rows.past_seqlens, cache.block_table, None, head_sink,
                    [q_length, 0 if torch.compiler.is_compiling() else layer.seen], **feature)
        return out.view(batch, q_length, num_heads, -1), None

    if kwargs.get("block_table") is not None and kwargs.get("k_cache") is not None:   # continuous batching, decode
        cu_q, cu_k = kwargs["cu_seq_lens_q"].to(torch.int32), kwargs["cu_seq_lens_k"].to(torch.int32)
        past = (cu_k[1:] - cu_k[:-1]) - (cu_q[1:] - cu_q[:-1])
        out = _call(name, module, "continuous batching: decode", query[0].transpose(0, 1).reshape(q_length, -1),
                    key[0].transpose(0, 1).reshape(q_length, -1), value[0].transpose(0, 1).reshape(q_length, -1),
                    kwargs["k_cache"], kwargs["v_cache"], cu_q, past, kwargs["block_table"].to(torch.int32), None,
                    head_sink, None, interleaved_pages=True, **feature)
        return out.view(1, q_length, num_heads, -1), None

    if kwargs.get("cu_seq_lens_q") is not None and kwargs.get("cu_seq_lens_k") is not None:   # varlen
        cu_q, cu_k = kwargs["cu_seq_lens_q"].to(torch.int32), kwargs["cu_seq_lens_k"].to(torch.int32)
        max_k = int(kwargs["max_length_k"])
        lengths_k = cu_k[1:] - cu_k[:-1]
        keys = key[0].transpose(0, 1).contiguous()                  # (total_k, Hk, D): the gathered rows
        values = value[0].transpose(0, 1).contiguous()
        # The cache has already written the new keys and values: nothing is written here (slot -1), so
        # key/value are placeholders the call never reads.
        unread = [keys.new_zeros((q_length, keys.shape[1] * keys.shape[2])) for _ in range(2)]
        out = _call(name, module, "continuous batching", query[0].transpose(0, 1).reshape(q_length, -1),
                    *unread, keys.unsqueeze(1), values.unsqueeze(1),
                    cu_q, lengths_k - (cu_q[1:] - cu_q[:-1]), _gathered_block_table(cu_k[:-1], lengths_k, max_k),
                    torch.full((q_length,), -1, dtype=torch.int32, device=query.device), head_sink,
                    [int(kwargs["max_length_q"]), max_k], **feature)
        return out.view(1, q_length, num_heads, -1), None

    # Dense keys: no cache (Sk == Sq) or a DynamicCache (Sk == the mask's length).
    kv_length = key.shape[2]
    rows = attention_mask if isinstance(attention_mask, _Rows) else \
        _rows_from_mask(attention_mask, batch, q_length, kv_length, query.device)
    if rows.kv_length != kv_length:
        raise fail("cache", f"dense keys of {kv_length} positions for a mask of {rows.kv_length}",
                   "cache=cupa.integrations.transformers.CupaCache(...), a DynamicCache of full-attention layers, "
                   "or no cache")
    real = rows.past_real + (q_length - rows.new_padding)
    keys = key.transpose(1, 2).reshape(batch * kv_length, 1, key.shape[1], head_size)
    values = value.transpose(1, 2).reshape(batch * kv_length, 1, value.shape[1], head_size)
    starts = torch.arange(batch, dtype=torch.int32, device=query.device) * kv_length + (kv_length - real)
    table = _gathered_block_table(starts, real, kv_length)
    both = table.new_full((2 * batch, kv_length), -1)
    both[1::2] = table
    out = _call(name, module, "dense keys", _heads_to_tokens(query), _heads_to_tokens(key[:, :, -q_length:]),
                _heads_to_tokens(value[:, :, -q_length:]), keys, values, rows.cumulative_sequence_length,
                rows.past_seqlens, both, torch.full((batch * q_length,), -1, dtype=torch.int32, device=query.device),
                head_sink, [q_length, kv_length], **feature)
    return out.view(batch, q_length, num_heads, -1), None


# -- continuous batching: the allow-list adaptation -------------------------------------------------------

def _release() -> tuple:
    parts = transformers.__version__.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (ValueError, IndexError):
        return (0, 0)


_admitted = False


def _admit_to_continuous_batching() -> bool:
    """Wrap transformers' continuous-batching gates so that names in ``_CB_NAMES`` pass (tested releases only).

    Returns False, with a warning, where the installed transformers is not a tested release.
    """
    global _admitted
    if _admitted:
        return True
    if _release() not in CONTINUOUS_BATCHING_RELEASES:
        log.warning("cupa: continuous batching is adapted for transformers %s only (installed: %s); "
                    "generate_batch will refuse cupa's attention name",
                    ", ".join(f"{a}.{b}" for a, b in CONTINUOUS_BATCHING_RELEASES), transformers.__version__)
        return False
    from transformers.generation.continuous_batching import continuous_api, initialization

    switch = continuous_api.ContinuousBatchingManager.switch_to_cb_friendly_attn

    @functools.wraps(switch)
    def switch_to_cb_friendly_attn(self, model, auto_switch_to_flash: bool = True) -> None:
        if model.config._attn_implementation in _CB_NAMES:
            return      # cupa serves both paths itself: no switch, no FlashAttention lookup
        return switch(self, model, auto_switch_to_flash)

    ensure = initialization.ensure_decode_fast_path_is_available

    @functools.wraps(ensure)
    def ensure_decode_fast_path_is_available(config, cb_config, user_requested: bool) -> None:
        if config._attn_implementation not in _CB_NAMES:
            return ensure(config, cb_config, user_requested)
        # cupa reads and writes transformers' pages through its block table on every device; only
        # attention types whose allocator has no block table (sliding windows) turn the path off.
        supported = all(initialization.ATTN_TYPE_TO_ALLOCATOR[t].supports_block_table
                        for t in initialization.group_layers_by_attn_type(config))
        if not supported:
            cb_config.max_blocks_per_request = 0

    continuous_api.ContinuousBatchingManager.switch_to_cb_friendly_attn = switch_to_cb_friendly_attn
    initialization.ensure_decode_fast_path_is_available = ensure_decode_fast_path_is_available
    _admitted = True
    return True
