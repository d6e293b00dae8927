"""The tensor-core prefill backend: prologue, then FlashAttention-style row tiles over the pages.

After the fused prologue (Q to an (N, H, D) workspace, K/V into the cache), one launch of
``paged_prefill`` (cuda_src/prefill.cu) does the rest. A CTA owns a tile of query rows -- the
(new token, query head) pairs of one sequence and one KV head, token-major, so the heads of a GQA
group share every K/V tile -- and streams the sequence's keys through shared memory in tiles,
gathered through the block table row by row (any block_size). The row tiles of all sequences are
numbered on one axis from static sizes only (token_count, batch_size, head counts): sequence b's
tiles start at ``floor(cum[b]*G/rows) + b`` (for a well-formed ``cumulative_sequence_length``),
found on the device by a warp-wide search, so a ragged batch is one launch without reading
lengths back.
The first CTAs of the grid write zeros to output rows no sequence owns. attention_metadata is
not needed to size anything: results are the same bits with or without it.

With attention_bias, the kernel's bias instances copy each tile's bias entries into shared memory with
its K/V tile and add them to the scores as fragments (ldmatrix); they use the tiles of :data:`BIAS_TILES`.
"""

from __future__ import annotations

import math
from typing import Optional

from .. import jit
from ..contract import Problem
from ..device import DeviceInfo
from ..errors import fail
from ..options import Options
from . import launch, registry, types
from .backend import CudaBackend, ctas_per_sm, packed_cache_reasons, shared_reason
from .launch import POINTER
from .prologue import POINTER_INPUTS, prologue_launcher, q_passthrough
from .types import f32, i32

PREFILL_DTYPES = ("float16", "bfloat16")
PREFILL_HEAD_SIZES = (64, 128, 256)
#: (head_size, query rows, keys) of a CTA's tile -> (warps, m16 tiles per warp, cp.async stages, CTAs per SM
#: the registers are sized for); mirrors PrefillConfig in prefill.cu (rows = 16 * m_tiles * warps).
TILE_CONFIG = {(64, 128, 64): (4, 2, 3, 2), (128, 128, 64): (4, 2, 2, 2), (128, 128, 32): (4, 2, 2, 2),
               (256, 128, 32): (8, 1, 2, 1), (256, 64, 32): (4, 1, 2, 1)}
#: head_size -> its (rows, keys) tiles, the default first, then compact tiles for less shared memory.
TILES = {64: ((128, 64),), 128: ((128, 64), (128, 32)), 256: ((128, 32), (64, 32))}
#: head_size -> the tiles of the attention_bias instances (their bias stages take rows x keys x 2 bytes each:
#: a 128 x 64 tile at head_size 128 would leave one CTA per SM on sm_90, and spills there).
BIAS_TILES = {64: ((128, 64),), 128: ((128, 32),), 256: ((128, 32),)}
MAX_GRID_X = (1 << 31) - 1
#: query heads a KV head from which a decode-shaped call may prefer the prefill kernels (preferred)
WIDE_GROUP = 64


def shared_bytes(head_size: int, quantized: bool, tile: tuple, packed: bool = False, bias: bool = False) -> int:
    """Dynamic shared memory of paged_prefill with ``tile`` (mirrors PrefillSmem in prefill.cu); ``packed``:
    packed 4-bit caches (K and V tiles of rows of D / 2 bytes, widened to T like the 8-bit ones); ``bias``: the
    attention_bias instances (a tile of 16-bit bias entries per stage, and each row's bias offset)."""
    D, (rows, keys) = head_size, tile
    stages = TILE_CONFIG[(D, rows, keys)][2]
    q_bytes = rows * D * 2
    stage = 2 * keys * (D // 2 if packed else D * (1 if quantized else 2))
    wide = 2 * keys * D * 2 if quantized else 0
    row_offsets = (stages + 1) * keys * 8  # byte offsets of the rows of a tile, one tile ahead
    sizes = (stages + 1) * keys * 4  # their copy sizes (16, or 0 for masked keys)
    mapped = (stages + 1) * (keys // 32) * 4
    bias_bytes = stages * rows * keys * 2 + rows * 8 if bias else 0
    align_pad = 128  # the kernel rounds the dynamic region up to a 128-byte boundary
    return q_bytes + stages * stage + wide + bias_bytes + row_offsets + sizes + mapped + align_pad


def static_shared_bound(head_size: int, tile: tuple) -> int:
    """An upper bound of paged_prefill's static shared memory (ptxas's figure; tests check it): per row
    its token, head and range (16 B); per warp the range arrays of every cache kind and the zero pass's
    flags (160 B); the new-key record and alignment (64 B)."""
    rows, keys = tile
    warps = TILE_CONFIG[(head_size, rows, keys)][0]
    return 16 * rows + 160 * warps + 64


def tile_for(head_size: int, quantized: bool, device: DeviceInfo, packed: bool = False,
             bias: bool = False) -> Optional[tuple]:
    """The (rows, keys) tile of paged_prefill on ``device``: the first of :data:`TILES` (``bias``:
    :data:`BIAS_TILES`) that fits a CTA (static plus dynamic shared memory) with the CTAs per SM its
    registers are sized for, else the first that fits a CTA; None when none fits (the backend declines)."""
    tiles = (BIAS_TILES if bias else TILES).get(head_size, ())
    need = {t: shared_bytes(head_size, quantized, t, packed, bias) + static_shared_bound(head_size, t) for t in tiles}
    fits = [t for t in tiles if need[t] <= device.shared_per_block_optin]
    for t in fits:
        if ctas_per_sm(need[t], device) >= TILE_CONFIG[(head_size,) + t][3]:
            return t
    return fits[0] if fits else None


def launch_plan(problem: Problem, tile: tuple) -> dict:
    """Grid of one call with ``tile``, from static sizes only (never attention_metadata or device data)."""
    p = problem
    rows, keys = tile
    warps, _, stages, _ = TILE_CONFIG[(p.head_size, rows, keys)]
    threads = 32 * warps
    num_tiles = (p.token_count * p.group_size) // rows + p.batch_size
    zero_ctas = math.ceil(p.token_count / threads)  # one thread per token checks its ownership
    return {"rows": rows, "threads": threads, "num_tiles": num_tiles, "static_tiles": num_tiles,
            "zero_ctas": zero_ctas,
            "grid": zero_ctas + num_tiles * p.kv_num_heads, "keys": keys, "stages": stages, "tile": tile}


def kv_from_inputs(problem: Problem, options: Options) -> bool:
    """True when the prologue stores the new K/V rows unchanged at the positions past + j: ``key`` and
    ``value`` given apart, a T cache, no rotary, no QK-norm, derived slots, no ``query_positions``.
    The attention kernels then read the new positions from ``key``/``value`` (the same bits) and a
    CTA whose keys are all new -- every CTA of a prefill without a past -- runs alongside the
    prologue instead of waiting for it (NewKeys in cuda_src/prefill_tiles.cuh)."""
    p = problem
    return (options.new_kv_from_inputs and q_passthrough(p) and not p.quantized and not p.latent
            and not p.has_slot_mapping and not p.has_query_positions)


#: Tokens per beside-prologue CTA below which the plain prologue launch is kept (a short prologue).
BESIDE_MIN_TOKENS_PER_SM = 64


def prologue_beside(problem: Problem, device: DeviceInfo, options: Options) -> bool:
    """Whether the prologue runs as a few fat CTAs beside the attention kernel (prologue_launcher's
    ``beside``): under :func:`kv_from_inputs` (so CTAs without a past never wait for it), with enough
    tokens for the copy to matter, and when attention_metadata's bounds say that no sequence has more
    keys than the longest run of new tokens (max_kv_len_bound <= max_query_len_bound: a call without
    a past to speak of). Where CTAs read a past they wait for the prologue, which is then better spread
    over every SM (measured on the H200: B=8 x 512 new tokens over 8192 cached ones, 1.689 -> 1.695 ms
    beside on 40 SMs; B=4 x 2048 without a past, 498.9 -> 493 us). A launch choice only: the prologue
    writes the same bytes either way. It needs programmatic launch on ``device``."""
    p = problem
    sms = options._tuning.prologue_beside_sms
    return (kv_from_inputs(p, options) and p.has_metadata and p.max_kv_len_bound <= p.max_query_len_bound
            and p.token_count >= BESIDE_MIN_TOKENS_PER_SM * sms and launch.pdl_allowed(device, options))


def prologue_phrase(problem: Problem, device: DeviceInfo, options: Options, beside: Optional[bool] = None) -> str:
    """How the attention launch relates to the prologue, for explain(); ``beside``: whether the prologue
    runs beside the attention kernel (default: :func:`prologue_beside`)."""
    if beside is None:
        beside = prologue_beside(problem, device, options)
    if kv_from_inputs(problem, options):
        where = f", on {options._tuning.prologue_beside_sms} SMs of its own" if beside else ""
        return (f"fused prologue alongside{where} (new K/V read from key/value; only CTAs that read cached rows "
                "wait for the prologue; Options(new_kv_from_inputs=False) turns this off)")
    return "fused prologue first"


class PrefillBackend(CudaBackend):
    name = "prefill"
    serves = frozenset({"return_lse", "subbyte", "bias"})
    #: Whether the prologue may run beside this backend's kernel (:func:`prologue_beside`).
    beside_prologue = True

    def reasons(self, problem: Problem, device: DeviceInfo, options: Options) -> list:
        p, reasons = problem, packed_cache_reasons(problem)
        if p.dtype not in PREFILL_DTYPES:
            reasons.append(f"T={p.dtype}: the tensor-core prefill takes float16 or bfloat16")
        if p.head_size not in PREFILL_HEAD_SIZES:
            reasons.append(f"head_size {p.head_size} not in {PREFILL_HEAD_SIZES}")
        elif (tile := tile_for(p.head_size, p.quantized, device, p.packed, p.has_bias)) is None:
            t = (BIAS_TILES if p.has_bias else TILES)[p.head_size][-1]
            need = (shared_bytes(p.head_size, p.quantized, t, p.packed, p.has_bias)
                    + static_shared_bound(p.head_size, t))
            reasons.append(shared_reason("paged_prefill" + (" with attention_bias" if p.has_bias else ""), need,
                                         device))
        elif not reasons and launch_plan(p, tile)["grid"] > MAX_GRID_X:
            reasons.append(f"{launch_plan(p, tile)['grid']} CTAs exceed one launch's grid ({MAX_GRID_X})")
        return reasons

    def preferred(self, problem: Problem, device: DeviceInfo = None, options: Options = None) -> bool:
        # More tokens than sequences means some sequence has several (seed 4.7's rule). A decode-shaped call
        # whose GQA groups fill tensor-core row tiles (WIDE_GROUP heads or more a KV head, as a heads-form
        # cascade prefix has) comes here too when its row tiles fill half the device: the decode kernels
        # would read every key once per group of heads.
        p = problem
        if p.token_count > p.batch_size:
            return True
        return (device is not None and p.group_size >= WIDE_GROUP
                and self._plan(p, device, options)["static_tiles"] * p.kv_num_heads * 2 >= device.sm_count)

    def specializations(self) -> list:
        specs = []
        for dtype in PREFILL_DTYPES:
            specs.append(registry.prologue_spec(dtype, "T", token_loop=True))
            for kind, v_kind in types.KV_KINDS:
                specs.append(registry.prologue_spec(dtype, kind, v_cache_kind=v_kind))
                specs.extend(registry.prefill_spec(dtype, kind, d, tile, v_kind)
                             for d in PREFILL_HEAD_SIZES for tile in TILES[d])
                specs.extend(registry.prefill_spec(dtype, kind, d, tile, v_kind, bias=True)
                             for d in PREFILL_HEAD_SIZES for tile in BIAS_TILES[d])
        return specs

    def describe(self, problem: Problem, device: DeviceInfo, options: Options) -> str:
        plan = self._plan(problem, device, options)
        return (f"paged prefill on tensor cores (mma.sync m16n8k16): one CTA per (tile of {plan['rows']} "
                f"(token, group head) rows of one sequence, KV head); {plan['num_tiles']} row tiles x "
                f"{problem.kv_num_heads} KV heads + {plan['zero_ctas']} zero-pass CTA(s); keys in tiles of "
                f"{plan['keys']} through a {plan['stages']}-stage cp.async pipeline"
                f"{' (and the tile of attention_bias entries with them)' if problem.has_bias else ''}; "
                f"{prologue_phrase(problem, device, options, self._beside(problem, device, options))}; "
                f"token_count ({problem.token_count}) {'>' if self.preferred(problem) else '<='} batch_size "
                f"({problem.batch_size}): {'' if self.preferred(problem) else 'not '}preferred")

    def run(self, plan, inputs: dict, out=None, stream=None):
        p = plan.problem
        call = launch.prepare(p, inputs, out, stream, plan.options)
        if p.token_count == 0:
            return call.finish()
        if call.output_ptr % 16:
            raise fail("out", f"a device pointer at {call.output_ptr:#x}",
                       "16-byte alignment (the prefill kernel stores whole 16-byte chunks)")
        r = plan.state.get("recipe")
        with call:
            if r is None:
                r = plan.state["recipe"] = self._recipe(plan, call)
            # The Q workspace (none when the kernel reads `query` itself), held by `ws` until the launches
            # are enqueued, and by a capture for the graph's life.
            ws = launch.workspace(r.q_bytes) if r.q_bytes else None
            r.launches(call.ptrs + [ws.ptr if ws is not None else 0, call.output_ptr, 0, call.lse_ptr],
                       call.stream.ptr, r.maps(call.ptrs) if r.maps is not None else ())
        return call.finish()

    def _beside(self, p: Problem, device: DeviceInfo, options: Options) -> bool:
        return self.beside_prologue and prologue_beside(p, device, options)

    # The kernel, launch plan and shared memory of a call on a device: the wgmma backend swaps these.
    def _spec(self, p: Problem, device: DeviceInfo, options: Options):
        return registry.prefill_spec(p.dtype, p.cache_kind, p.head_size,
                                     tile_for(p.head_size, p.quantized, device, p.packed, p.has_bias),
                                     p.v_cache_kind, bias=p.has_bias)

    def _plan(self, p: Problem, device: DeviceInfo, options: Options) -> dict:
        return launch_plan(p, tile_for(p.head_size, p.quantized, device, p.packed, p.has_bias))

    def _shared_bytes(self, p: Problem, device: DeviceInfo) -> int:
        tile = tile_for(p.head_size, p.quantized, device, p.packed, p.has_bias)
        return shared_bytes(p.head_size, p.quantized, tile, p.packed, p.has_bias)

    def _tail_args(self, p: Problem, options: Options) -> tuple:
        """Arguments the attention kernel takes after the common list: attention_bias (a pointer, null
        without one) and its dims (batch, heads, q_capacity, kv_capacity; 1, 1, 0, 0 without one)."""
        dims = p.bias_shape if p.has_bias else (1, 1, 0, 0)
        return (POINTER,) + tuple(i32(d) for d in dims)

    def _tail_pointers(self, p: Problem) -> tuple:
        """The pointer-list positions of the :data:`POINTER` arguments of :meth:`_tail_args`."""
        return (_I["attention_bias"],)

    def _maps(self, p: Problem, tail: tuple):
        """``maps(ptrs) -> tuple of bytes``: the kernel's tensor-map arguments of a call, from ``Call.ptrs``,
        for the tail arguments ``tail`` (:meth:`_tail_args`, built once with them); None: it takes none."""
        return None

    def _recipe(self, plan_, call) -> "_Recipe":
        """The prologue and attention launches of a plan (built once per plan, with the call's device
        current): the attention kernel waits for the prologue (grid_dependency_wait) before it reads
        anything the prologue writes -- in every CTA, or under :func:`kv_from_inputs` in CTA 0 and the
        CTAs that read cache rows -- so it is a programmatic step."""
        p, device, options = plan_.problem, plan_.device, plan_.options
        a = p.attrs
        plan = self._plan(p, device, options)
        kernel = jit.get_kernel(self._spec(p, device, options))
        shared = self._shared_bytes(p, device)
        launch.ensure_shared_memory(kernel, shared)
        args = (POINTER,) * len(_ATTEND_POINTERS) + (
            i32(p.token_count), i32(p.num_heads), i32(p.kv_num_heads), i32(p.batch_size), i32(p.num_blocks),
            i32(p.block_size), i32(p.max_blocks_per_seq), i32(plan["zero_ctas"]), i32(plan["num_tiles"]),
            i32(p.rotary_max_pos if p.rotary_dim else 0), f32(p.scale), f32(a.softcap), i32(a.local_window_size),
            i32(a.is_causal), i32(types.QUANT_CODE[p.k_quant]), i32(types.QUANT_CODE[p.v_quant]))
        tail = self._tail_args(p, options)
        args += tail
        attend = launch.Launcher(kernel, (plan["grid"],), (plan["threads"],), args, shared_mem=shared)
        passthrough = q_passthrough(p)  # the prologue only writes K/V; the kernel reads `query` itself
        r = _Recipe()
        r.q_bytes = 0 if passthrough else launch.align(
            p.token_count * p.num_heads * p.head_size * call.dev["query"].dtype.itemsize)
        pointers = list(_ATTEND_POINTERS) + list(self._tail_pointers(p))
        if passthrough:
            pointers[0] = _I["query"]
        if kv_from_inputs(p, options):
            pointers[1:3] = [_I["key"], _I["value"]]
        if passthrough and not plan_.writes:   # the prologue would only store rows, and none is stored
            steps = [(attend, pointers)]
        else:
            prologue = prologue_launcher(p, device, options, beside=self._beside(p, device, options))
            steps = [(prologue, _PROLOGUE_POINTERS), (attend, pointers, True)]
        r.launches = launch.Sequence(steps, _NPOINTERS, route=options.launch, pdl=launch.pdl_allowed(device, options))
        r.maps = self._maps(p, tail)
        return r


class _Recipe:
    """The launches of one problem on one device (prologue, then attention), the size of the Q
    workspace (0: the attention kernel reads ``query``) and the tensor maps of a call (None: none)."""

    __slots__ = ("launches", "q_bytes", "maps")


# Pointer arguments, as positions in Call.ptrs extended by [Q workspace, output, a null pointer, lse].
_Q_WS, _OUT, _NULL, _LSE = range(len(launch.PTR_INDEX), len(launch.PTR_INDEX) + 4)
_NPOINTERS = len(launch.PTR_INDEX) + 4
_I = launch.PTR_INDEX
# The prologue: its inputs, the Q workspace, and no split counters (null).
_PROLOGUE_POINTERS = tuple(_I[n] for n in POINTER_INPUTS) + (_Q_WS, _NULL)
# paged_prefill / paged_prefill_wgmma: q, key, value (null unless kv_from_inputs), key_cache, value_cache, cum,
# past, block_table, query_positions, head_sink, k_scale, v_scale, out, lse (0 unless the call asks for it)
_ATTEND_POINTERS = (_Q_WS, _NULL, _NULL, _I["key_cache"], _I["value_cache"], _I["cumulative_sequence_length"],
                    _I["past_seqlens"], _I["block_table"], _I["query_positions"], _I["head_sink"], _I["k_scale"],
                    _I["v_scale"], _OUT, _LSE)

BACKEND = PrefillBackend()
