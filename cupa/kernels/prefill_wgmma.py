"""The Hopper wgmma prefill backend (sm_90a): the prefill of choice on compute capability 9.0.

Same contract, prologue and zero pass as the mma.sync prefill backend (:mod:`cupa.kernels.prefill`),
with the attention kernel ``paged_prefill_wgmma_ws`` (cuda_src/prefill_wgmma_ws.cu): persistent, one
CTA per SM looping over the work items (a row tile of 128 (token, group head) rows of one sequence,
one KV head: the mma.sync prefill's numbering), warp-specialized -- a copier warpgroup filling K/V
tiles (by TMA in boxes of consecutive rows where :func:`tma_plan` allows, else cp.async gathers
through the block table), a scheduler warpgroup locating rows and loading Q, two consumer
warpgroups taking turns on the tensor cores (mbarriers, setmaxnreg) -- with 128-key tiles on
``wgmma.m64n128k16``.

It serves a call only when all of these hold, and otherwise says why in explain() (the call then
goes to the mma.sync prefill backend):

- the inputs' device has compute capability 9.0 (wgmma needs the arch-specific sm_90a target,
  compiled offline with NVRTC and loaded as a cubin: :func:`cupa.jit.get_kernel` on a pinned spec);
- T is float16 or bfloat16, both caches hold T or both hold 8-bit codes of one kind (int8 or fp8,
  widened in shared memory by the copier warps; packed 4-bit caches go to the mma.sync prefill), and
  head_size is 128;
- no LATENT layout, attention_bias or output_qk (as for the mma.sync prefill).
"""

from __future__ import annotations

import math
from typing import Optional

from ..contract import Problem
from ..device import DeviceInfo
from ..options import Options
from . import launch, registry, tma
from .backend import shared_reason
from .prefill import MAX_GRID_X, PrefillBackend, kv_from_inputs, prologue_phrase
from .types import i32

WGMMA_DTYPES = ("float16", "bfloat16")
#: Cache kinds of both caches (one kind for K and V): T, or 8-bit codes the kernel widens in place.
WGMMA_CACHES = ("T", "int8", "fp8")
WGMMA_HEAD_SIZES = (128,)
CAPABILITY = (9, 0)
#: mirrors WsPrefillConfig / WsPrefillSmem in prefill_wgmma_ws.cu
ROWS, THREADS, KEYS, STAGES, QBUFS = 128, 512, 128, 2, 2
#: An upper bound of the kernel's static shared memory (per Q buffer its rows' tokens, heads and ranges, the
#: work item, the mbarriers, the copiers' row indices; ptxas's figure is checked against it by a test).
STATIC_SHARED_BOUND = 8192
#: Cache slots (num_blocks * block_size) the kernel can index: its row arithmetic is 32-bit.
MAX_SLOTS = (1 << 31) - 1
#: Work items (row tiles x KV heads) the kernel numbers in 32 bits, with room for a round of CTAs past the last.
MAX_ITEMS = 1 << 30
#: Keys per copier warp: the largest TMA box of cache rows, and the box of new key / value rows.
WARP_KEYS = 32
#: Smallest TMA box of cache rows: the kernel's box destinations (box-aligned rows of 128 bytes) stay
#: 1024-byte aligned, as the 128-byte swizzle needs, only for boxes of 8, 16 or 32 rows (a correctness
#: limit, not a tuning knob; below it the copier gathers rows with cp.async).
TMA_MIN_BOX = 8
TMA_BOXES = (0, 8, 16, 32)


def shared_bytes(problem: Problem) -> int:
    """Dynamic shared memory of paged_prefill_wgmma_ws (mirrors WsPrefillSmem in prefill_wgmma_ws.cu): two Q
    buffers and two stages of K and V tiles, plus the 1024-byte alignment pad."""
    D = problem.head_size
    return QBUFS * ROWS * D * 2 + STAGES * 2 * KEYS * D * 2 + 1024


def persistent_ctas(device: DeviceInfo, options: Options) -> int:
    """Persistent CTAs: one per SM, or fewer under ``Options._tuning.prefill_ws_ctas``."""
    cap = options._tuning.prefill_ws_ctas
    return device.sm_count if cap is None else min(cap, device.sm_count)


def launch_plan(problem: Problem, sms: Optional[int] = None) -> dict:
    """Grid of the persistent kernel: the zero-pass CTAs, then ``sms`` CTAs (None: as many as work items,
    the bound used before a device is known) looping over the work items (row tile, KV head).

    Row tiles are numbered as paged_prefill numbers them (``static_tiles`` of them), or, when
    attention_metadata's max_query_len_bound leaves at most 3/4 of them, ``tiles_per_seq`` = ceil(bound *
    group_size / ROWS) a sequence (locate_bounded_tile): the bound drops trailing tiles that would be
    empty (contract §4.5), as with many one-token sequences of a wide group (the heads-form cascade
    prefix: 2 tiles a sequence instead of 3). Where it would drop only a few, the items keep the
    order the persistent CTAs' snake was measured with."""
    p = problem
    static_tiles = num_tiles = (p.token_count * p.group_size) // ROWS + p.batch_size
    tiles_per_seq = 0
    if p.has_metadata and p.batch_size > 0:
        per_seq = -(-(p.max_query_len_bound * p.group_size) // ROWS)
        if 4 * p.batch_size * per_seq <= 3 * static_tiles:
            num_tiles, tiles_per_seq = p.batch_size * per_seq, per_seq
    items = num_tiles * p.kv_num_heads
    zero_ctas = math.ceil(p.token_count / THREADS)
    persistent = items if sms is None else max(1, min(items, sms))
    return {"rows": ROWS, "threads": THREADS, "num_tiles": num_tiles, "static_tiles": static_tiles,
            "tiles_per_seq": tiles_per_seq, "zero_ctas": zero_ctas,
            "items": items, "persistent": persistent, "grid": zero_ctas + persistent, "keys": KEYS,
            "stages": STAGES}


def tma_plan(problem: Problem, options: Options) -> tuple:
    """``(cache_box, inputs)``: rows per TMA box of cache rows (0: cache rows by cp.async) and whether new
    K/V rows read from ``key``/``value`` come by TMA.

    A box of cache rows must lie inside one block, and tiles start on box boundaries: boxes of
    gcd(block_size, 32) rows (block_size 16: 16; 64, 256, ...: 32), where that is at least 8 rows; new
    rows are consecutive, in boxes of 32. Boxes with masked and unmasked keys (a sequence's ends)
    are gathered with cp.async. ``Options(tma=False)``: cp.async only.
    """
    p = problem
    if not (options.tma and tma.available()):
        return 0, False
    box = math.gcd(p.block_size, WARP_KEYS)
    cache_box = box if box >= TMA_MIN_BOX and 0 < p.num_blocks * p.block_size <= tma.MAX_ROWS else 0
    inputs = kv_from_inputs(p, options) and p.token_count <= tma.MAX_ROWS
    assert cache_box in TMA_BOXES  # (the kernel's contract: tma_box in paged_prefill_wgmma_ws)
    return cache_box, inputs


class PrefillWgmmaBackend(PrefillBackend):
    """The mma.sync prefill's run() (prologue, workspace, zero-token shortcut) with the wgmma kernel."""

    name = "prefill_wgmma"
    serves = frozenset({"return_lse"})   # not the packed 4-bit caches or the bias PrefillBackend reads
    #: int8 / fp8 caches: the copiers' widening (auto keeps those calls on the mma.sync prefill until
    #: its GPU tests have passed)
    unverified = frozenset({"cache8"})
    # The persistent CTAs take their items in a fixed order, so the CTAs of SMs a prologue beside holds
    # start late and end late: on the H200, causal B=4 x 2048 ran 339.6 us with the prologue on 32 SMs
    # of its own and 330.8 us with it first on every SM (B=1 x 8192: 980.4 / 954.5 us).
    beside_prologue = False

    def reasons(self, problem: Problem, device: DeviceInfo, options: Options) -> list:
        p, reasons = problem, []
        if p.dtype not in WGMMA_DTYPES:
            reasons.append(f"T={p.dtype}: the wgmma prefill takes float16 or bfloat16")
        if p.cache_kind not in WGMMA_CACHES or p.v_cache_kind != p.cache_kind:
            kinds = p.cache_kind if p.v_cache_kind == p.cache_kind else f"{p.cache_kind} / {p.v_cache_kind}"
            reasons.append(f"{kinds} caches: the wgmma prefill takes two caches of T, int8 or fp8 (one kind)")
        if p.head_size not in WGMMA_HEAD_SIZES:
            reasons.append(f"head_size {p.head_size}: the wgmma prefill takes {WGMMA_HEAD_SIZES[0]} only")
        if device.capability != CAPABILITY:
            reasons.append(f"needs compute capability 9.0 (sm_90a wgmma); the device has "
                           f"{device.capability[0]}.{device.capability[1]}")
        if p.num_blocks * p.block_size > MAX_SLOTS:
            reasons.append(f"{p.num_blocks * p.block_size} cache slots: the wgmma prefill indexes cache rows in 32 "
                           f"bits (at most {MAX_SLOTS} slots; the mma.sync prefill serves larger caches)")
        if launch_plan(p)["num_tiles"] * p.kv_num_heads > MAX_ITEMS:
            reasons.append(f"{launch_plan(p)['num_tiles'] * p.kv_num_heads} work items (row tiles x KV heads): the "
                           f"wgmma prefill numbers at most {MAX_ITEMS}")
        need = shared_bytes(p) + STATIC_SHARED_BOUND
        if not reasons and need > device.shared_per_block_optin:
            reasons.append(shared_reason("paged_prefill_wgmma_ws", need, device))
        if not reasons and launch_plan(p)["zero_ctas"] + device.sm_count > MAX_GRID_X:
            reasons.append(f"{launch_plan(p)['zero_ctas']} zero-pass CTAs exceed one launch's grid ({MAX_GRID_X})")
        return reasons

    def specializations(self) -> list:
        specs = [registry.prefill_wgmma_ws_spec(dtype, d, kind) for dtype in WGMMA_DTYPES for d in WGMMA_HEAD_SIZES
                 for kind in WGMMA_CACHES]
        return specs + [registry.prefill_wgmma_ws_spec(dtype, d, "T", copier_clean=True) for dtype in WGMMA_DTYPES
                        for d in WGMMA_HEAD_SIZES]

    def describe(self, problem: Problem, device: DeviceInfo, options: Options) -> str:
        plan = launch_plan(problem, persistent_ctas(device, options))
        cache_box, inputs = tma_plan(problem, options)
        feed = []
        if cache_box:
            feed.append(f"cache rows by TMA in boxes of {cache_box}")
        if inputs:
            feed.append(f"new rows from key/value by TMA in boxes of {WARP_KEYS}")
        feed = "; ".join(feed + ["otherwise block-table gathers with cp.async"])
        if problem.quantized:
            feed += f"; {problem.cache_kind} codes widened to {problem.dtype} in shared memory by the copier warps"
        elif options._tuning.prefill_ws_copier_clean:
            feed += "; V tiles with keys to clean cleaned by the copier warps"
        per_seq = (f"(at most {plan['tiles_per_seq']} a sequence: attention_metadata's max_query_len_bound) "
                   if plan["tiles_per_seq"] else "")
        return (f"paged prefill on Hopper warpgroup MMA, warp-specialized (wgmma m64n128k16, sm_90a): "
                f"{plan['persistent']} persistent CTAs of a copier warpgroup ({feed}), a scheduler warpgroup and "
                f"2 consumer warpgroups taking turns (mbarriers, setmaxnreg), over {plan['num_tiles']} row tiles "
                f"{per_seq}of {plan['rows']} (token, group head) rows x {problem.kv_num_heads} KV heads, + "
                f"{plan['zero_ctas']} zero-pass CTA(s); keys in tiles of {plan['keys']} through a "
                f"{plan['stages']}-stage ring; {prologue_phrase(problem, device, options, False)}; token_count "
                f"({problem.token_count}) {'>' if self.preferred(problem) else '<='} batch_size "
                f"({problem.batch_size}): {'' if self.preferred(problem) else 'not '}preferred")

    # Read when a plan's launches are built.
    def _spec(self, p: Problem, device: DeviceInfo, options: Options):
        copier_clean = options._tuning.prefill_ws_copier_clean and not p.quantized
        return registry.prefill_wgmma_ws_spec(p.dtype, p.head_size, p.cache_kind, copier_clean)

    def _plan(self, p: Problem, device: DeviceInfo, options: Options) -> dict:
        return launch_plan(p, persistent_ctas(device, options))

    def _shared_bytes(self, p: Problem, device: DeviceInfo) -> int:
        return shared_bytes(p)

    def _tail_args(self, p: Problem, options: Options) -> tuple:
        cache_box, inputs = tma_plan(p, options)
        return (launch.TENSOR_MAP,) * 4 + (i32(cache_box), i32(int(inputs)), i32(launch_plan(p)["tiles_per_seq"]))

    def _tail_pointers(self, p: Problem) -> tuple:
        return ()

    def _maps(self, p: Problem, tail: tuple):
        return _maps(p, int(tail[4]), bool(tail[5]))  # the plan the kernel's arguments carry


_KEY_CACHE, _VALUE_CACHE = launch.PTR_INDEX["key_cache"], launch.PTR_INDEX["value_cache"]
_KEY, _VALUE = launch.PTR_INDEX["key"], launch.PTR_INDEX["value"]


def _maps(p: Problem, cache_box: int, inputs: bool):
    """``maps(ptrs)``: the kernel's tensor maps of one call (key_cache, value_cache, key, value; zeros where
    its plan uses none), encoded per address (:func:`tma.rows_map` keeps recent ones)."""
    slots, heads, d = p.num_blocks * p.block_size, p.kv_num_heads, p.head_size
    tokens, zero, rows_map = p.token_count, tma.ZERO_MAP, tma.rows_map
    code_bytes = 1 if p.quantized else 2  # (8-bit codes, or T)

    def maps(ptrs):
        kc = vc = k = v = zero
        if cache_box:
            kc = rows_map(ptrs[_KEY_CACHE], slots, heads, d, cache_box, code_bytes)
            vc = rows_map(ptrs[_VALUE_CACHE], slots, heads, d, cache_box, code_bytes)
        if inputs:
            k = rows_map(ptrs[_KEY], tokens, heads, d, WARP_KEYS)
            v = rows_map(ptrs[_VALUE], tokens, heads, d, WARP_KEYS)
        return (kc, vc, k, v)

    return maps


BACKEND = PrefillWgmmaBackend()
