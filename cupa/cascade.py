"""Cascade attention for sequences that share a cached prefix (docs/attention_states.md).

When every sequence of a call starts with the same P cached positions -- the same physical blocks in
the first P / block_size entries of every block-table row -- plain paged attention reads those blocks
once per sequence. :class:`CascadeAttention` reads them once for all the sequences:

1. the prefix: every token's queries against the P shared keys as one problem (``prefix_mode``:
   ``"heads"``, one token whose query heads are those of all the tokens; or ``"tokens"``, one sequence
   of all the tokens at their own positions), with ``return_lse`` and without head_sink. The heads
   form splits the shared keys into ``prefix_splits`` runs of whole blocks, one sequence of the
   prefix call each, so that its (token, group head) row tiles times the splits fill the GPU;
2. the suffix: the plain call on each sequence's own keys [P, kv_len), as a position-shifted shard
   (past_seqlens - P, the block-table columns after the prefix, cos/sin from row P on); it writes the
   new tokens' K/V;
3. :func:`cupa.merge_states` of the prefix states and the suffix state with head_sink (one launch,
   which reads the heads form's KV-head-major rows where they are).

Every step runs on the inputs' device and stream without a host synchronization -- the suffix by
default on a side stream forked from it and joined back by events (``concurrent``), which a capture of
the inputs' stream takes in -- and a step can be captured into a CUDA graph once its kernels are compiled
(one eager call, as ``cupa.capture_graph``'s warm-up makes). A step uploads nothing from the host: one
launch derives every index array of the prefix and suffix calls, the prefix call's constant ones
included, so a graph keeps every buffer it uses and outlives the op that recorded it.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, replace
from typing import Any, Optional

import numpy as np

from . import _capture, arrays, dispatch
from .api import PagedAttention, bind_inputs
from .contract import INPUT_NAMES, Attributes, Problem
from .device import device_info
from .errors import fail
from .options import Options
from .states import merge_host

__all__ = ["CascadeAttention", "cascade_attention", "PREFIX_MODES", "HEADS_MAX_ROWS", "MAX_PREFIX_SPLITS",
           "prefix_splits_for"]

PREFIX_MODES = ("auto", "heads", "tokens")
#: ``prefix_mode="auto"`` takes "heads" (when exact) up to this many query rows (token_count * group size)
HEADS_MAX_ROWS = 4096
#: most key splits of a heads-form prefix (the merge takes the splits and the suffix as at most 16 states)
MAX_PREFIX_SPLITS = 15
#: ``prefix_splits="auto"``: fewest shared keys a split holds. Each split adds a copy of the queries and
#: a state to merge; on an H200 (benchmarks/results/cascade_h200.json, "sweep_splits_6e4d322": each
#: step captured and replayed), B=32 decode tokens over a 4096-key prefix with 4096 keys of their own took
#: 162 us with 8 splits of 512 keys and 179 with 4 of 1024 (concurrent).
MIN_SPLIT_KEYS = 512
#: ``prefix_splits="auto"``: (token, group head) rows of one tensor-core prefill row tile
TILE_ROWS = 128


def prefix_splits_for(token_count: int, num_heads: int, kv_num_heads: int, prefix_len: int, block_size: int,
                      sm_count: int, concurrent: bool = False) -> int:
    """``prefix_splits="auto"``: key splits of a heads-form prefix so that its row tiles (KV heads x
    ceil(token_count * group size / TILE_ROWS)) times the splits come near the SMs it has without
    exceeding them -- ``sm_count``, or half of them when the prefix runs ``concurrent`` with the suffix
    (which takes the other half) -- each split keeping at least MIN_SPLIT_KEYS keys (whole blocks); at
    most MAX_PREFIX_SPLITS, at least 1.

    On an H200 (benchmarks/results/cascade_h200.json, "sweep_splits_6e4d322"; GQA 32/8, D=128, fp16,
    block 16; each step captured and replayed), B=64 decode tokens over an 8192-key prefix with 256 keys
    of their own: serial, 93 us with 4 splits and 83 with 8 (one row tile per SM); concurrent, 64 us with
    4 (64 row tiles: half the SMs)."""
    rows = token_count * (num_heads // kv_num_heads)
    tiles = kv_num_heads * -(-rows // TILE_ROWS)
    blocks = prefix_len // block_size
    budget = sm_count // 2 if concurrent else sm_count
    splits = min(MAX_PREFIX_SPLITS, budget // max(tiles, 1), max(prefix_len // MIN_SPLIT_KEYS, 1), blocks)
    splits = max(splits, 1)
    per = -(-blocks // splits)
    return -(-blocks // per)   # whole blocks a split: no empty split


class CascadeAttention:
    """Paged attention for a call whose sequences share their first ``prefix_len`` cached positions.

    Called with the inputs of the plain call (:func:`cupa.paged_attention`), it returns what the plain
    call returns -- ``output``, or ``(output, lse)`` with ``return_lse`` -- within the contract §6
    tolerances, and writes the caches as the plain call does, while the shared blocks are read once.

    Parameters
    ----------
    prefix_len : int
        P, the shared positions: a positive multiple of block_size, smaller than the block table's
        capacity. Row 0 of block_table supplies the shared blocks (entries [0, P / block_size)); every
        row holds the same ones there (device data: not checked). Every token's position must be at
        least P (the prefix is cached before any query of it): a token at a position below P writes
        nothing and sees no suffix key.
    prefix_mode : {"auto", "heads", "tokens"}, default "auto"
        How the prefix is attended: ``"heads"`` (one decode token with the query heads of every token;
        exact when do_rotary=0 and local_window_size <= 0), ``"tokens"`` (one sequence of every token,
        each at its own position) or ``"auto"`` ("heads" where it is exact and token_count * group size
        <= :data:`HEADS_MAX_ROWS`).
    prefix_splits : "auto" or int, default "auto"
        Runs of whole shared blocks the heads form attends as separate sequences of its prefix call
        (1 to :data:`MAX_PREFIX_SPLITS`; the last may be shorter). ``"auto"``:
        :func:`prefix_splits_for` with the device's SM count on a GPU, 1 on the host. The tokens form
        takes 1.
    concurrent : bool, default True
        On a GPU, run the suffix call beside the prefix call: on a side stream (one per thread, device
        and stream) that an event forks from the inputs' stream after the index launch and another
        joins back before the merge, so the two calls share the SMs (the suffix is bound by memory
        latency, the prefix by the tensor cores); the heads form's ``"auto"`` splits then give the prefix
        half the SMs. False: the prefix, then the suffix, on the inputs' stream. The results are the
        same bits either way for the same ``prefix_splits``.
    num_heads, kv_num_heads, **attributes
        The attributes of :class:`cupa.PagedAttention` (``return_lse`` included; not ``qk_output``).
    options : cupa.Options, optional
        Passed to the prefix and suffix calls (beside the prefix call, the suffix call launches its
        attention kernel plainly, whatever ``programmatic_launch`` says).

    Examples
    --------
    >>> op = cupa.CascadeAttention(prefix_len=8192, num_heads=32, kv_num_heads=8)
    >>> out = op(q, k, v, key_cache, value_cache, cum, past, block_table, attention_metadata=md)

    attention_bias and output_qk are not served (PagedAttentionError).
    """

    def __init__(self, *, prefix_len: int, prefix_mode: str = "auto", prefix_splits="auto", concurrent: bool = True,
                 num_heads: int = None, kv_num_heads: int = None, options: Options = None, **attributes: Any):
        if isinstance(prefix_len, bool) or not isinstance(prefix_len, (int, np.integer)) or prefix_len < 1:
            raise fail("prefix_len", repr(prefix_len), "a positive integer (the shared cached positions)")
        if prefix_mode not in PREFIX_MODES:
            raise fail("prefix_mode", repr(prefix_mode), f"one of {PREFIX_MODES}")
        if prefix_splits != "auto" and (isinstance(prefix_splits, bool) or not isinstance(prefix_splits, (int, np.integer))
                                        or not 1 <= prefix_splits <= MAX_PREFIX_SPLITS):
            raise fail("prefix_splits", repr(prefix_splits), f"'auto' or an integer in [1, {MAX_PREFIX_SPLITS}]")
        if prefix_mode == "tokens" and prefix_splits not in ("auto", 1):
            raise fail("prefix_splits", repr(prefix_splits), "'auto' or 1 with prefix_mode='tokens' (only the heads "
                       "form splits the shared keys)")
        if not isinstance(concurrent, (bool, np.bool_)):
            raise fail("concurrent", repr(concurrent), "True or False")
        self.prefix_len = int(prefix_len)
        self.concurrent = bool(concurrent)
        self.prefix_mode = prefix_mode
        self.prefix_splits = prefix_splits if prefix_splits == "auto" else int(prefix_splits)
        self._plain = PagedAttention(num_heads=num_heads, kv_num_heads=kv_num_heads, options=options, **attributes)
        a = self.attributes = self._plain.attributes
        if a.qk_output:
            raise fail("qk_output", a.qk_output, "0: CascadeAttention returns no output_qk")
        if prefix_mode == "heads" and (a.do_rotary or a.local_window_size > 0):
            raise fail("prefix_mode", "'heads'", "'tokens' or 'auto' with do_rotary=1 or a local window (the "
                       "prefix scores depend on each token's position)")
        self.options = self._plain.options
        self._parts = {k: v for k, v in a.as_dict().items() if k not in ("return_lse", "qk_output")}
        self._suffix = PagedAttention(**self._parts, return_lse=True, options=self.options)
        # Beside the prefix call, the suffix call's attention kernel is not launched programmatically: a
        # programmatic launch makes its CTAs resident while the prologue runs, holding SM slots the prefix
        # call's CTAs could fill (benchmarks/results/cascade_h200.json, "suffix_launch_ab").
        self._suffix_beside = (self._suffix if not self.options.programmatic_launch else PagedAttention(
            **self._parts, return_lse=True, options=replace(self.options, programmatic_launch=False)))
        self._steps = {}   # (problem, CUDA ordinal or None) -> _Step

    def __repr__(self) -> str:
        return (f"CascadeAttention(prefix_len={self.prefix_len}, prefix_mode={self.prefix_mode!r}, "
                f"prefix_splits={self.prefix_splits!r}, concurrent={self.concurrent}, {self._plain!r})")

    # -- planning ---------------------------------------------------------------------
    def _step(self, problem: Problem, device: Optional[int]) -> "_Step":
        """The step of one input signature on ``device`` (a CUDA ordinal, or None: the host)."""
        key = (problem, device)
        step = self._steps.get(key)
        if step is None:
            if len(self._steps) >= 64:
                self._steps.clear()
            step = self._steps[key] = self._make_step(problem, device)
        return step

    def _make_step(self, p: Problem, device: Optional[int]) -> "_Step":
        P, a = self.prefix_len, p.attrs
        if P % p.block_size:
            raise fail("prefix_len", P, f"a multiple of block_size ({p.block_size}): the shared prefix is whole blocks")
        prefix_blocks = P // p.block_size
        if prefix_blocks >= p.max_blocks_per_seq:
            raise fail("block_table", f"{p.max_blocks_per_seq} columns",
                       f"more than prefix_len / block_size = {prefix_blocks} (room for the sequences' own keys)")
        if p.has_bias:
            raise fail("attention_bias", "an array", "absent: CascadeAttention does not serve attention_bias")
        if a.do_rotary and p.rotary_max_pos <= P:
            raise fail("cos_cache", f"{p.rotary_max_pos} rows", f"more than prefix_len ({P}): every token is at a "
                       "position >= prefix_len")
        mode = self.prefix_mode
        exact_heads = not a.do_rotary and a.local_window_size <= 0
        if mode == "auto":
            mode = "heads" if exact_heads and p.token_count * p.group_size <= HEADS_MAX_ROWS else "tokens"
        N = p.token_count
        if mode == "heads":
            splits = self.prefix_splits
            if splits == "auto":
                splits = 1 if device is None else prefix_splits_for(N, p.num_heads, p.kv_num_heads, P, p.block_size,
                                                                     device_info(device).sm_count, self.concurrent)
            prefix_cols = -(-prefix_blocks // min(splits, prefix_blocks))
            prefix_rows = -(-prefix_blocks // prefix_cols)
            keys = np.minimum(prefix_blocks - np.arange(prefix_rows) * prefix_cols, prefix_cols) * p.block_size
            cum, past = np.arange(prefix_rows + 1, dtype=np.int32), (keys - 1).astype(np.int32)
            metadata = np.array([1, prefix_cols * p.block_size], np.int32)
            op = PagedAttention(**dict(self._parts, num_heads=N * p.num_heads), return_lse=True, options=self.options)
            slots = prefix_rows
        else:
            prefix_rows, prefix_cols = max(1, -(-N // P)), prefix_blocks
            q_lens = np.diff(np.minimum(np.arange(prefix_rows + 1) * P, N)).astype(np.int32)
            cum = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
            past = (P - q_lens).astype(np.int32)
            metadata = np.array([max(1, int(q_lens.max())), P], np.int32)
            op = PagedAttention(**self._parts, return_lse=True, options=self.options)
            slots = N
        op._writes = False   # its slot_mapping is all -1: no launch that would only store rows (dispatch.Plan.writes)
        return _Step(problem=p, mode=mode, prefix_blocks=prefix_blocks, prefix_rows=prefix_rows, prefix_cols=prefix_cols,
                     prefix_op=op, prefix_cum=cum, prefix_past=past, prefix_metadata=metadata,
                     prefix_slots=np.full(slots, -1, np.int32), suffix_metadata=_shifted_metadata(p, P))

    def describe(self, *args, **kwargs) -> str:
        """How a call with these inputs is run: the prefix form and sizes, the backends of the prefix and
        suffix calls, and the merge (nothing is launched)."""
        inputs = bind_inputs(args, kwargs)
        p = self._plain.plan(*(inputs[n] for n in INPUT_NAMES)).problem
        step = self._step(p, dispatch.call_device(inputs))
        prefix_plan, suffix_plan = self._plans(step, inputs)
        P = self.prefix_len
        if step.mode == "heads":
            runs = (f"in {step.prefix_rows} run(s) of up to {step.prefix_cols * p.block_size} keys, one decode "
                    "sequence each" if step.prefix_rows > 1 else "as one decode sequence")
            prefix = (f"one decode token with the {p.token_count} tokens' {p.token_count * p.num_heads} query heads "
                      f"(KV-head major) over the {P} shared positions, {runs}")
        else:
            prefix = (f"{step.prefix_rows} sequence(s) of the {p.token_count} tokens at their own positions over "
                      f"the {P} shared positions")
        return (f"cascade attention, prefix_mode={step.mode!r}: prefix = {prefix} [{prefix_plan.backend.name}]; "
                f"suffix = the call on each sequence's positions >= {P} (block-table columns from "
                f"{step.prefix_blocks}) [{suffix_plan.backend.name}]; merge_states of the two with head_sink")

    def backends(self, *args, **kwargs) -> tuple:
        """The names of the backends that run the prefix and the suffix call for these inputs."""
        inputs = bind_inputs(args, kwargs)
        p = self._plain.plan(*(inputs[n] for n in INPUT_NAMES)).problem
        prefix_plan, suffix_plan = self._plans(self._step(p, dispatch.call_device(inputs)), inputs)
        return prefix_plan.backend.name, suffix_plan.backend.name

    def _plans(self, step: "_Step", inputs: dict) -> tuple:
        """The plans of the prefix and suffix calls, from arrays of their inputs' shapes (allocated, not
        filled: no kernel runs)."""
        p = step.problem
        if dispatch.call_device(inputs) is None:
            x, xp = inputs, np
        else:
            import cupy as xp

            tensors = {n: v for n, v in inputs.items() if n != "attention_metadata"}
            x, device = arrays.device_arrays(tensors, arrays.resolve_stream(None, inputs["query"]))
            x["attention_metadata"] = inputs["attention_metadata"]
        T, N = arrays.numpy_dtype(p.dtype), p.token_count
        with (xp.cuda.Device(device) if xp is not np else contextlib.nullcontext()):
            idx = lambda *shape: xp.empty(shape, np.int32)   # noqa: E731
            common = dict(key_cache=x["key_cache"], value_cache=x["value_cache"],
                          cumulative_sequence_length=idx(step.prefix_rows + 1), past_seqlens=idx(step.prefix_rows),
                          block_table=idx(step.prefix_rows, step.prefix_cols), q_norm_weight=x["q_norm_weight"],
                          k_norm_weight=x["k_norm_weight"], k_scale=x["k_scale"], v_scale=x["v_scale"],
                          attention_metadata=step.prefix_metadata)
            if step.mode == "heads":
                S, width = step.prefix_rows, p.head_size if p.latent else p.kv_num_heads * p.head_size
                prefix = step.prefix_op.plan(xp.empty((S, N * p.num_heads * p.head_size), T), xp.empty((S, width), T),
                                             None if p.latent else xp.empty((S, width), T), slot_mapping=idx(S),
                                             **common)
            else:
                prefix = step.prefix_op.plan(x["query"], x["key"], x["value"], cos_cache=x["cos_cache"],
                                             sin_cache=x["sin_cache"], slot_mapping=idx(N), query_positions=idx(N),
                                             **common)
            cos, sin, P = x["cos_cache"], x["sin_cache"], self.prefix_len
            suffix = self._suffix.plan(
                x["query"], x["key"], x["value"], x["key_cache"], x["value_cache"], x["cumulative_sequence_length"],
                x["past_seqlens"], idx(p.batch_size, p.max_blocks_per_seq - step.prefix_blocks),
                None if cos is None else cos[P:], None if sin is None else sin[P:], x["slot_mapping"], None,
                x["q_norm_weight"], x["k_norm_weight"], x["k_scale"], x["v_scale"], step.suffix_metadata,
                x["query_positions"], None)
        return prefix, suffix

    # -- execution ----------------------------------------------------------------------
    def __call__(self, *args, out=None, stream=None, **kwargs):
        """Run the cascade step. Returns ``output``, or ``(output, lse)`` with ``return_lse``.

        The inputs are those of :func:`cupa.paged_attention` for the plain call; the caches are updated
        in place as the plain call updates them.
        """
        inputs = bind_inputs(args, kwargs)
        query = inputs["query"]
        problem = self._plain.plan(*(inputs[n] for n in INPUT_NAMES)).problem
        if problem.token_count == 0:   # nothing to attend: the plain call returns the empty outputs
            return self._plain(*(inputs[n] for n in INPUT_NAMES), out=out, stream=stream)
        device = dispatch.call_device(inputs)
        step = self._step(problem, device)
        if device is None:
            return self._run_host(step, inputs, out)
        return self._run_device(step, inputs, out, stream)

    def _run_host(self, step: "_Step", inputs: dict, out):
        p = step.problem
        query = inputs["query"]
        x = {n: (v if n == "attention_metadata" or v is None else
                 arrays.host_view(v, n, cache=n in arrays.CACHE_NAMES)) for n, v in inputs.items()}
        out_view = arrays.host_out(out, query, p.output_shape, arrays.numpy_dtype(p.dtype))
        d = _derive_host(step, x, self.prefix_len)
        o_pre, lse_pre = self._prefix(step, x, d, np)
        o_suf, lse_suf = self._suffix_call(step, x, d, None, self._suffix)
        N, H, Hk, Dv = p.token_count, p.num_heads, p.kv_num_heads, p.v_head_size
        if step.mode == "heads":   # (splits, KV head, token, group head) rows -> (splits, token, head)
            S, G = step.prefix_rows, p.group_size
            o_pre = o_pre.reshape(S, Hk, N, G, Dv).transpose(0, 2, 1, 3, 4).reshape(S, N, H * Dv)
            lse_pre = lse_pre.reshape(S, Hk, N, G).transpose(0, 2, 1, 3).reshape(S, N, H)
            lse_pre = np.where((d["prefix_positions"] >= 0)[None, :, None], lse_pre, -np.inf)
        else:
            o_pre, lse_pre = o_pre[None], lse_pre[None]
        merged, merged_lse = merge_host(np.concatenate([o_pre, o_suf[None]]).reshape(-1, N, H, Dv),
                                        np.concatenate([lse_pre, lse_suf[None]]), x["head_sink"])
        result = out_view if out_view is not None else np.empty(p.output_shape, arrays.numpy_dtype(p.dtype))
        result[...] = merged.reshape(p.output_shape).astype(result.dtype)
        output = arrays.wrap_host(result, query, out)
        if not self.attributes.return_lse:
            return output
        return output, arrays.wrap_host(merged_lse.astype(np.float32), query)

    def _run_device(self, step: "_Step", inputs: dict, out, stream):
        import cupy

        from .kernels import states as kernels

        p = step.problem
        query = inputs["query"]
        stream = arrays.resolve_stream(stream, query)
        tensors = {n: v for n, v in inputs.items() if n != "attention_metadata"}
        x, device = arrays.device_arrays(tensors, stream)
        x["attention_metadata"] = inputs["attention_metadata"]
        with cupy.cuda.Device(device), stream:
            out_view = arrays.check_out(out, p.output_shape, p.dtype, query, device)
            if out_view is None:
                out_view = arrays.empty_output(p.output_shape, p.dtype, query, device)
            lse_view = (arrays.empty_output(p.lse_shape, "float32", query, device)
                        if self.attributes.return_lse else None)
            d = _derive_device(step, x, self.prefix_len, stream, kernels)
            if self.concurrent:   # the suffix on a side stream, forked from the inputs' stream, joined here
                side, fork, join = _side_stream(device, stream)
                fork.record(stream)
                side.wait_event(fork)
                o_pre, lse_pre = self._prefix(step, x, d, cupy, stream)
                with side:
                    o_suf, lse_suf = self._suffix_call(step, x, d, side, self._suffix_beside)
                join.record(side)
                stream.wait_event(join)
            else:
                o_pre, lse_pre = self._prefix(step, x, d, cupy, stream)
                o_suf, lse_suf = self._suffix_call(step, x, d, stream, self._suffix)
            _capture.keep_alive(out_view, lse_view)
        if step.mode == "heads":   # the prefix call's rows stay KV-head major: the merge reads them so
            S = step.prefix_rows
            kernels.merge([o_pre[i] for i in range(S)] + [o_suf], [lse_pre[i] for i in range(S)] + [lse_suf],
                          x["head_sink"], out_view, lse_view, p.num_heads, stream,
                          heads_major=(S, p.group_size, d["prefix_positions"]))
        else:
            kernels.merge([o_pre, o_suf], [lse_pre, lse_suf], x["head_sink"], out_view, lse_view, p.num_heads,
                          stream)
        output = arrays.wrap_output(out_view, query, stream)
        if lse_view is None:
            return output
        return output, arrays.wrap_output(lse_view, query, stream)

    def _prefix(self, step: "_Step", x: dict, d: dict, xp, stream=None) -> tuple:
        """The prefix state. The tokens form: output (N, H*Dv), lse (N, H), -inf for tokens invalid in the
        plain call. The heads form: output (S, Hk*N*G*Dv) and lse (S, Hk*N*G), one row per split, each
        KV-head major (KV head, token, group head), whatever a token's validity."""
        p = step.problem
        N, H, Hk, G, D, Dv = p.token_count, p.num_heads, p.kv_num_heads, p.group_size, p.head_size, p.v_head_size
        c = d["constants"]
        common = dict(key_cache=x["key_cache"], value_cache=x["value_cache"], cumulative_sequence_length=c["cum"],
                      past_seqlens=c["past"], block_table=d["prefix_table"], slot_mapping=c["slots"],
                      q_norm_weight=x["q_norm_weight"], k_norm_weight=x["k_norm_weight"], k_scale=x["k_scale"],
                      v_scale=x["v_scale"], attention_metadata=step.prefix_metadata, stream=stream)
        if step.mode == "tokens":
            return step.prefix_op(x["query"], x["key"], x["value"], cos_cache=x["cos_cache"],
                                  sin_cache=x["sin_cache"], query_positions=d["prefix_positions"], **common)
        S = step.prefix_rows
        stacked = d.get("stacked")   # (copied by cascade_inputs on the device where the rows allow)
        if stacked is None:
            q = x["query"][:, :H * D].reshape(N, Hk, G, D).transpose(1, 0, 2, 3)
            stacked = xp.ascontiguousarray(xp.broadcast_to(q[None], (S, Hk, N, G, D))).reshape(S, N * H * D)
        o_stacked, lse_stacked = step.prefix_op(stacked, c["key"], c["value"], **common)
        _capture.keep_alive(stacked, o_stacked, lse_stacked)   # a captured graph writes them at every replay
        return o_stacked, lse_stacked

    def _suffix_call(self, step: "_Step", x: dict, d: dict, stream, op: PagedAttention) -> tuple:
        """The suffix state: the plain call on positions >= prefix_len, shifted down by prefix_len."""
        P = self.prefix_len
        cos, sin = x["cos_cache"], x["sin_cache"]
        return op(
            x["query"], x["key"], x["value"], x["key_cache"], x["value_cache"], x["cumulative_sequence_length"],
            d["suffix_past"], d["suffix_table"], None if cos is None else cos[P:], None if sin is None else sin[P:],
            x["slot_mapping"], None, x["q_norm_weight"], x["k_norm_weight"], x["k_scale"], x["v_scale"],
            step.suffix_metadata, d["suffix_positions"], None, stream=stream)


_sides = threading.local()   # .streams: {(device, stream pointer): (side stream, fork event, join event)}
#: side streams kept per thread (one per device and stream a cascade step has run on)
MAX_SIDE_STREAMS = 16


def _side_stream(device: int, stream) -> tuple:
    """The side stream of ``stream`` on this thread, with its fork and join events (created once).

    One per (thread, device, stream): the memory a suffix call allocates on it returns to the
    allocator's pool of that side stream, whose next use waits on a later fork from the same stream
    -- after the merge that read it -- and a capture on one thread never takes in another's work."""
    import cupy

    streams = getattr(_sides, "streams", None)
    if streams is None:
        streams = _sides.streams = {}
    key = (device, stream.ptr)
    entry = streams.get(key)
    if entry is None:
        if len(streams) >= MAX_SIDE_STREAMS:
            streams.pop(next(iter(streams)))
        entry = streams[key] = (cupy.cuda.Stream(non_blocking=True), cupy.cuda.Event(disable_timing=True),
                                cupy.cuda.Event(disable_timing=True))
    return entry


@dataclass(eq=False)
class _Step:
    """What a cascade call of one input signature needs beyond its inputs (built once per signature)."""

    problem: Problem
    mode: str
    prefix_blocks: int
    prefix_rows: int         # sequences of the prefix call ("tokens": ceil(N / P); "heads": the key splits)
    prefix_cols: int         # its block-table columns ("tokens": the prefix blocks; "heads": blocks a split)
    prefix_op: PagedAttention
    prefix_cum: np.ndarray
    prefix_past: np.ndarray
    prefix_metadata: np.ndarray
    prefix_slots: np.ndarray  # all -1: the prefix call writes nothing
    suffix_metadata: Optional[np.ndarray]


def _shifted_metadata(p: Problem, P: int) -> Optional[np.ndarray]:
    """attention_metadata of the suffix call: the plain call's bounds (clamped, contract §4.5) with the kv
    bounds less the prefix."""
    if not p.has_metadata:
        return None
    md = [p.max_query_len_bound, max(p.max_kv_len_bound - P, 1)]
    if p.max_kv_len_lower_bound:
        md.append(max(p.max_kv_len_lower_bound - P, 0))
    return np.array(md, np.int32)


def _host_constants(step: _Step) -> dict:
    p = step.problem
    c = dict(cum=step.prefix_cum, past=step.prefix_past, slots=step.prefix_slots, key=None, value=None)
    if step.mode == "heads":
        T, S = arrays.numpy_dtype(p.dtype), step.prefix_rows
        c["key"] = np.zeros((S, p.head_size if p.latent else p.kv_num_heads * p.head_size), T)
        c["value"] = None if p.latent else np.zeros((S, p.kv_num_heads * p.head_size), T)
    return c


def _derive_host(step: _Step, x: dict, P: int) -> dict:
    """The index arrays of one cascade call on the host (the NumPy twin of states.cu cascade_inputs)."""
    p = step.problem
    cum = np.asarray(x["cumulative_sequence_length"]).astype(np.int64)
    past = np.asarray(x["past_seqlens"]).astype(np.int64)
    bt = np.asarray(x["block_table"])
    qp = x["query_positions"]
    N, B = p.token_count, p.batch_size
    positions = np.full(N, -1, np.int64)
    if B > 0 and N > 0:
        t = np.arange(N, dtype=np.int64)
        lo, hi = np.zeros(N, np.int64), np.full(N, B, np.int64)
        while np.any(lo < hi):        # the owner search of docs/architecture.md (paged.cuh find_owner)
            act = lo < hi
            mid = (lo + hi) // 2
            go = cum[np.minimum(mid + 1, B)] > t
            hi = np.where(act & go, mid, hi)
            lo = np.where(act & ~go, mid + 1, lo)
        bc = np.minimum(lo, B - 1)
        c0, c1, pst = cum[bc], cum[bc + 1], past[bc]
        pos = np.asarray(qp).astype(np.int64) if qp is not None else pst + t - c0
        valid = ((lo < B) & (c0 <= t) & (pst >= 0) & (c1 >= c0) & (pst + c1 - c0 <= p.static_kv_capacity)
                 & (pos >= 0) & ((p.rotary_max_pos == 0) | (pos < p.rotary_max_pos)))
        positions = np.where(valid, pos, -1)
    shift = lambda v: np.where(v >= 0, v - P, -1).astype(np.int32)
    rows, cols, Pb = step.prefix_rows, step.prefix_cols, step.prefix_blocks
    if B == 0:
        prefix_table = np.full((rows, cols), -1, np.int32)
    elif step.mode == "heads":   # consecutive runs of the prefix blocks, -1 past the last
        prefix_table = np.full(rows * cols, -1, np.int32)
        prefix_table[:Pb] = bt[0, :Pb]
        prefix_table = prefix_table.reshape(rows, cols)
    else:
        prefix_table = np.tile(bt[0, :Pb], (rows, 1))
    return dict(prefix_positions=positions.astype(np.int32), suffix_past=shift(past),
                suffix_positions=None if qp is None else shift(np.asarray(qp).astype(np.int64)),
                suffix_table=np.ascontiguousarray(bt[:, step.prefix_blocks:]),
                prefix_table=np.ascontiguousarray(prefix_table, dtype=np.int32),
                constants=_host_constants(step))


def _derive_device(step: _Step, x: dict, P: int, stream, kernels) -> dict:
    """The index arrays of one cascade call on the device, and the prefix call's constant inputs (no host
    upload: a step captured first, or by an op built inside the captured step, needs none), in one
    ``cascade_inputs`` launch on ``stream``."""
    import cupy

    p = step.problem
    N, B, Pb, S = p.token_count, p.batch_size, step.prefix_blocks, step.prefix_rows
    qp = x["query_positions"]
    sizes = dict(prefix_positions=(N,), suffix_past=(B,), suffix_positions=(N,) if qp is not None else None,
                 suffix_table=(B, p.max_blocks_per_seq - Pb), prefix_table=(S, step.prefix_cols),
                 prefix_cum=(S + 1,), prefix_past=(S,), prefix_slots=(len(step.prefix_slots),))
    total = sum(int(np.prod(s)) for s in sizes.values() if s is not None)
    buffer = cupy.empty(max(total, 1), dtype=np.int32)
    _capture.keep_alive(buffer)
    d, at = {}, 0
    for name, shape in sizes.items():
        if shape is None:
            d[name] = None
            continue
        n = int(np.prod(shape))
        d[name] = buffer[at:at + n].reshape(shape)
        at += n
    key = value = zero_kv = None
    if step.mode == "heads":   # the prefix call's key / value rows: zeros (it stores nothing)
        width = p.head_size if p.latent else p.kv_num_heads * p.head_size
        zero_kv = cupy.empty((1 if p.latent else 2, S, width), dtype=x["query"].dtype)
        _capture.keep_alive(zero_kv)
        key, value = zero_kv[0], (None if p.latent else zero_kv[1])
    # the heads form's stacked queries, copied by the same launch where the query rows allow it
    stacked = None
    if step.mode == "heads" and kernels.stack_units(x["query"], p.head_size, N * p.num_heads, S) is not None:
        stacked = cupy.empty((S, N * p.num_heads * p.head_size), dtype=x["query"].dtype)
        _capture.keep_alive(stacked)
    kernels.cascade_inputs(x["cumulative_sequence_length"], x["past_seqlens"], x["block_table"], qp,
                           kv_capacity=p.static_kv_capacity, rotary_max_pos=p.rotary_max_pos, prefix_len=P,
                           prefix_blocks=Pb, prefix_rows=S, prefix_cols=step.prefix_cols,
                           prefix_split=step.mode == "heads", stream=stream, query=x["query"],
                           kv_num_heads=p.kv_num_heads, group=p.group_size, head_size=p.head_size, stacked=stacked,
                           prefix_kv=zero_kv, block_size=p.block_size, **d)
    constants = dict(cum=d.pop("prefix_cum"), past=d.pop("prefix_past"), slots=d.pop("prefix_slots"), key=key,
                     value=value)
    d["constants"], d["stacked"] = constants, stacked
    return d


def cascade_attention(*args, prefix_len: int, prefix_mode: str = "auto", prefix_splits="auto", concurrent: bool = True,
                      out=None, stream=None, options: Options = None, **kwargs):
    """:class:`CascadeAttention` as a function: ``cascade_attention(*inputs, prefix_len=P, num_heads=...,
    kv_num_heads=..., **attributes)``. Inputs by position (ONNX order) or keyword, as
    :func:`cupa.paged_attention`; the bound op is rebuilt each call (bind a :class:`CascadeAttention`
    once to keep its plan memo)."""
    attribute_names = set(Attributes.names())
    attributes = {k: kwargs.pop(k) for k in list(kwargs) if k in attribute_names}
    op = CascadeAttention(prefix_len=prefix_len, prefix_mode=prefix_mode, prefix_splits=prefix_splits,
                          concurrent=concurrent, options=options, **attributes)
    return op(*args, out=out, stream=stream, **kwargs)
