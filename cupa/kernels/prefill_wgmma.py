"""The Hopper wgmma prefill backend (sm_90a): the prefill of choice on compute capability 9.0.

Same contract, prologue and zero pass as the mma.sync prefill backend (:mod:`cupa.kernels.prefill`),
with one of two attention kernels (:func:`ws_preferred`):

- ``paged_prefill_wgmma`` (cuda_src/prefill_wgmma.cu; ``CUPA_PREFILL_WGMMA_WS=0``): the mma.sync prefill's launch layout, one CTA =
  2 warpgroups x 64 query rows of one sequence and one KV head, S = Q K^T on ``wgmma.m64n64k16`` and
  O += P V on ``wgmma.m64n128k16`` with P in registers, K/V rows gathered through the block table with
  cp.async into the 128B-swizzled layout wgmma reads, by every thread, one CTA barrier per key tile;
- ``paged_prefill_wgmma_ws`` (cuda_src/prefill_wgmma_ws.cu): persistent, one CTA per SM looping over
  the same work items, warp-specialized (a copier warpgroup filling K/V tiles -- by TMA in boxes of
  consecutive rows where :func:`tma_plan` allows, else cp.async gathers through the block table --, a
  scheduler warpgroup locating rows and loading Q, two consumer warpgroups taking turns on the tensor
  cores; mbarriers, setmaxnreg), 128-key tiles on ``wgmma.m64n128k16``: the default, faster with or
  without a past.

It serves a call only when all of these hold, and otherwise says why in explain() (the call then
goes to the mma.sync prefill backend as before):

- ``CUPA_PREFILL_WGMMA`` is not ``"0"`` (the switch that sends these calls to the mma.sync prefill
  instead; read at dispatch: an op memoizes its choice per input signature, so set it before the
  op's first call or use a fresh op);
- the current device has compute capability 9.0 (wgmma needs the arch-specific sm_90a target,
  compiled offline with NVRTC and loaded as a cubin: :func:`cupa.jit.get_kernel` on a pinned spec);
- T is float16 or bfloat16, the caches hold T (no int8/fp8 caches in this first version), and
  head_size is 128;
- no LATENT layout, attention_bias or output_qk (as for the mma.sync prefill).
"""

from __future__ import annotations

import functools
import math
import os
from typing import Optional

from ..contract import Problem
from ..errors import fail
from . import launch, registry, tma
from .prefill import MAX_GRID_X, PrefillBackend, kv_from_inputs, prologue_phrase
from .types import i32

#: The switch: "0" turns the backend off (validated on an H200: tests/test_prefill_wgmma_gpu.py).
ENV_VAR = "CUPA_PREFILL_WGMMA"
WGMMA_DTYPES = ("float16", "bfloat16")
WGMMA_HEAD_SIZES = (128,)
#: mirrors WgmmaPrefillConfig in prefill_wgmma.cu
ROWS, THREADS, KEYS, STAGES = 128, 256, 64, 2
CAPABILITY = (9, 0)
#: The warp-specialized persistent kernel (prefill_wgmma_ws.cu), the default; "0" selects paged_prefill_wgmma.
WS_ENV_VAR = "CUPA_PREFILL_WGMMA_WS"
#: mirrors WsPrefillConfig / WsPrefillSmem in prefill_wgmma_ws.cu
WS_ROWS, WS_THREADS, WS_KEYS, WS_STAGES, WS_QBUFS = 128, 512, 128, 2, 2


def enabled() -> bool:
    return os.environ.get(ENV_VAR, "") != "0"


def ws_preferred(problem: Problem) -> bool:
    """Whether a call goes to the warp-specialized kernel (read when a problem's launches are built):
    yes unless ``CUPA_PREFILL_WGMMA_WS=0`` ("1" or unset: yes; anything else is an error).

    Measured on the H200 (docs/performance.md), whole calls: B=4 x 2048 without a past 368.7 us against
    375-377 for paged_prefill_wgmma; chunked prefill (B=8 x 512 new tokens over 8192 cached) 1117 us
    against 1230-1242 (session 6, cp.async only; with TMA since session 7: 339 and 1008 us).
    """
    env = os.environ.get(WS_ENV_VAR, "")
    if env not in ("", "0", "1"):
        raise fail(WS_ENV_VAR, repr(env), "'0' (paged_prefill_wgmma), '1' or unset (the warp-specialized kernel)")
    return env != "0"


#: Caps the persistent kernel's CTAs (default: one per SM): a test knob that puts many work items on each CTA.
WS_CTAS_ENV_VAR = "CUPA_PREFILL_WS_CTAS"


def ws_ctas(device_id: Optional[int] = None) -> Optional[int]:
    """Persistent CTAs of the warp-specialized kernel: one per SM, or fewer under :data:`WS_CTAS_ENV_VAR`."""
    sms = sm_count(device_id)
    cap = os.environ.get(WS_CTAS_ENV_VAR, "")
    if cap:
        try:
            n = int(cap)
        except ValueError:
            n = 0
        if n < 1:
            raise fail(WS_CTAS_ENV_VAR, repr(cap), "a positive integer (persistent CTAs of the wgmma prefill)")
        return n if sms is None else min(n, sms)
    return sms


@functools.lru_cache(maxsize=None)
def _sm_count_of(device_id: int) -> int:
    import cupy

    return int(cupy.cuda.Device(device_id).attributes["MultiProcessorCount"])


def sm_count(device_id: Optional[int] = None) -> Optional[int]:
    """Streaming multiprocessors of ``device_id`` (default: the current CuPy device); None without a device."""
    try:
        import cupy

        return _sm_count_of(cupy.cuda.runtime.getDevice() if device_id is None else device_id)
    except Exception:  # no cupy, no driver, no device
        return None


@functools.lru_cache(maxsize=None)
def _capability_of(device_id: int) -> tuple:
    import cupy

    cc = cupy.cuda.Device(device_id).compute_capability  # e.g. "90"
    return (int(cc[:-1]), int(cc[-1]))


def device_capability() -> Optional[tuple]:
    """(major, minor) of the current CuPy device, or None where no device is usable."""
    try:
        import cupy

        return _capability_of(cupy.cuda.runtime.getDevice())
    except Exception:  # no cupy, no driver, no device
        return None


def shared_bytes(problem: Problem) -> int:
    """Dynamic shared memory of paged_prefill_wgmma (mirrors WgmmaPrefillSmem in prefill_wgmma.cu)."""
    D = problem.head_size
    q_bytes = ROWS * D * 2
    stage = 2 * KEYS * D * 2
    rows = (STAGES + 1) * KEYS * 8
    sizes = (STAGES + 1) * KEYS * 4
    mapped = (STAGES + 1) * (KEYS // 32) * 4
    align_pad = 1024  # the kernel rounds the dynamic region up to a 1024-byte boundary (swizzle atoms)
    return q_bytes + STAGES * stage + rows + sizes + mapped + align_pad


def ws_shared_bytes(problem: Problem) -> int:
    """Dynamic shared memory of paged_prefill_wgmma_ws (mirrors WsPrefillSmem in prefill_wgmma_ws.cu): two Q
    buffers and two stages of K and V tiles, plus the 1024-byte alignment pad."""
    D = problem.head_size
    return WS_QBUFS * WS_ROWS * D * 2 + WS_STAGES * 2 * WS_KEYS * D * 2 + 1024


def ws_launch_plan(problem: Problem, sms: Optional[int] = None) -> dict:
    """Grid of the persistent kernel: the zero-pass CTAs, then one CTA per SM (``sms``; None: as many as
    work items, the bound used before a device is known) looping over the work items (row tile, KV head)
    -- the same items and order as :func:`launch_plan`'s CTAs."""
    p = problem
    num_tiles = (p.token_count * p.group_size) // WS_ROWS + p.batch_size
    items = num_tiles * p.kv_num_heads
    zero_ctas = math.ceil(p.token_count / WS_THREADS)
    persistent = items if sms is None else max(1, min(items, sms))
    return {"rows": WS_ROWS, "threads": WS_THREADS, "num_tiles": num_tiles, "zero_ctas": zero_ctas,
            "items": items, "persistent": persistent, "grid": zero_ctas + persistent, "keys": WS_KEYS,
            "stages": WS_STAGES}


#: "0": the warp-specialized kernel gathers every K/V row with cp.async (no TMA): an A/B switch.
TMA_ENV_VAR = "CUPA_PREFILL_TMA"
#: Keys per copier warp of the warp-specialized kernel: the largest TMA box of cache rows, and the box
#: of new key / value rows.
WS_WARP_KEYS = 32
#: Smallest TMA box of cache rows: the kernel's box destinations (box-aligned rows of 128 bytes) stay
#: 1024-byte aligned, as the 128-byte swizzle needs, only for boxes of 8, 16 or 32 rows (a correctness
#: limit, not a tuning knob; below it the copier gathers rows with cp.async).
TMA_MIN_BOX = 8
TMA_BOXES = (0, 8, 16, 32)


def tma_enabled() -> bool:
    env = os.environ.get(TMA_ENV_VAR, "")
    if env not in ("", "0", "1"):
        raise fail(TMA_ENV_VAR, repr(env), "'0' (K/V rows by cp.async only), '1' or unset (TMA where it applies)")
    return env != "0" and tma.available()


def tma_plan(problem: Problem) -> tuple:
    """``(cache_box, inputs)`` of the warp-specialized kernel: rows per TMA box of cache rows (0: cache rows
    by cp.async) and whether new K/V rows read from ``key``/``value`` come by TMA.

    A box of cache rows must lie inside one block, and tiles start on box boundaries: boxes of
    gcd(block_size, 32) rows (block_size 16: 16; 64, 256, ...: 32), where that is at least 8 rows; new
    rows are consecutive, in boxes of 32. Boxes with masked and unmasked keys (a sequence's ends)
    are gathered with cp.async.
    """
    p = problem
    if not tma_enabled():
        return 0, False
    box = math.gcd(p.block_size, WS_WARP_KEYS)
    cache_box = box if box >= TMA_MIN_BOX and p.num_blocks * p.block_size <= tma.MAX_ROWS else 0
    inputs = kv_from_inputs(p) and p.token_count <= tma.MAX_ROWS
    assert cache_box in TMA_BOXES  # (the kernel's contract: tma_box in paged_prefill_wgmma_ws)
    return cache_box, inputs


def launch_plan(problem: Problem) -> dict:
    """Grid of one call, from static sizes only (the same numbering as the mma.sync prefill)."""
    p = problem
    num_tiles = (p.token_count * p.group_size) // ROWS + p.batch_size
    zero_ctas = math.ceil(p.token_count / THREADS)  # one thread per token checks its ownership
    return {"rows": ROWS, "threads": THREADS, "num_tiles": num_tiles, "zero_ctas": zero_ctas,
            "grid": zero_ctas + num_tiles * p.kv_num_heads, "keys": KEYS, "stages": STAGES}


class PrefillWgmmaBackend(PrefillBackend):
    """The mma.sync prefill's run() (prologue, workspace, zero-token shortcut) with the wgmma kernel."""

    name = "prefill_wgmma"

    def not_supported_reasons(self, problem: Problem) -> list:
        p, reasons = problem, []
        if not enabled():
            reasons.append(f"switched off by {ENV_VAR}=0")
        if p.latent:
            reasons.append("kv_cache_layout='LATENT' (MLA) is not served by the wgmma prefill")
        if p.has_bias:
            reasons.append("attention_bias is not served by the wgmma prefill")
        if p.attrs.qk_output:
            reasons.append("output_qk (qk_output != 0) is not served by the wgmma prefill")
        if p.attrs.return_lse:
            reasons.append("return_lse is not served by this backend yet")
        if p.dtype not in WGMMA_DTYPES:
            reasons.append(f"T={p.dtype}: the wgmma prefill takes float16 or bfloat16")
        if p.quantized:
            reasons.append(f"{p.cache_kind} cache: the wgmma prefill takes caches of T only (this first version)")
        if p.head_size not in WGMMA_HEAD_SIZES:
            reasons.append(f"head_size {p.head_size}: the wgmma prefill takes {WGMMA_HEAD_SIZES[0]} only")
        if not reasons:
            cc = device_capability()
            if cc != CAPABILITY:
                have = "no usable CUDA device" if cc is None else f"compute capability {cc[0]}.{cc[1]}"
                reasons.append(f"needs compute capability 9.0 (sm_90a wgmma); {have}")
        if not reasons and launch_plan(p)["grid"] > MAX_GRID_X:
            reasons.append(f"{launch_plan(p)['grid']} CTAs exceed one launch's grid ({MAX_GRID_X})")
        return reasons

    def describe(self, problem: Problem) -> str:
        if ws_preferred(problem):
            plan = ws_launch_plan(problem, ws_ctas())
            cache_box, inputs = tma_plan(problem)
            feed = []
            if cache_box:
                feed.append(f"cache rows by TMA in boxes of {cache_box}")
            if inputs:
                feed.append(f"new rows from key/value by TMA in boxes of {WS_WARP_KEYS}")
            feed = "; ".join(feed + ["otherwise block-table gathers with cp.async"])
            return (f"paged prefill on Hopper warpgroup MMA, warp-specialized (wgmma m64n128k16, sm_90a; off with "
                    f"{ENV_VAR}=0): the warp-specialized kernel ({WS_ENV_VAR}=0: the other one): "
                    f"{plan['persistent']} persistent CTAs of a copier warpgroup ({feed}; {TMA_ENV_VAR}=0: "
                    f"cp.async only), a scheduler warpgroup and 2 consumer warpgroups taking turns (mbarriers, "
                    f"setmaxnreg), over {plan['num_tiles']} row tiles of {plan['rows']} (token, group "
                    f"head) rows x {problem.kv_num_heads} KV heads, + {plan['zero_ctas']} zero-pass CTA(s); keys in "
                    f"tiles of {plan['keys']} through a {plan['stages']}-stage ring; {prologue_phrase(problem)}; "
                    f"token_count ({problem.token_count}) {'>' if self.preferred(problem) else '<='} batch_size "
                    f"({problem.batch_size}): {'' if self.preferred(problem) else 'not '}preferred")
        plan = launch_plan(problem)
        return (f"paged prefill on Hopper warpgroup MMA (wgmma m64n64k16 / m64n128k16, sm_90a; off with "
                f"{ENV_VAR}=0): one CTA of 2 warpgroups per (tile of {plan['rows']} (token, group head) rows of "
                f"one sequence, KV head); {plan['num_tiles']} row tiles x {problem.kv_num_heads} KV heads + "
                f"{plan['zero_ctas']} zero-pass CTA(s); keys in tiles of {plan['keys']} through a "
                f"{plan['stages']}-stage cp.async pipeline; {prologue_phrase(problem)}; token_count "
                f"({problem.token_count}) {'>' if self.preferred(problem) else '<='} batch_size "
                f"({problem.batch_size}): {'' if self.preferred(problem) else 'not '}preferred")

    # Read when a problem's launches are built (once per problem object and device).
    def _spec(self, p: Problem):
        if ws_preferred(p):
            return registry.prefill_wgmma_ws_spec(p.dtype, p.head_size)
        return registry.prefill_wgmma_spec(p.dtype, p.head_size)

    def _plan(self, p: Problem) -> dict:
        return ws_launch_plan(p, ws_ctas()) if ws_preferred(p) else launch_plan(p)

    def _shared_bytes(self, p: Problem) -> int:
        return ws_shared_bytes(p) if ws_preferred(p) else shared_bytes(p)

    def _tail_args(self, p: Problem) -> tuple:
        if not ws_preferred(p):
            return ()
        cache_box, inputs = tma_plan(p)
        return (launch.TENSOR_MAP,) * 4 + (i32(cache_box), i32(int(inputs)))

    def _maps(self, p: Problem, tail: tuple):
        if not tail:
            return None
        return _ws_maps(p, int(tail[4]), bool(tail[5]))  # the plan the kernel's arguments carry


_KEY_CACHE, _VALUE_CACHE = launch.PTR_INDEX["key_cache"], launch.PTR_INDEX["value_cache"]
_KEY, _VALUE = launch.PTR_INDEX["key"], launch.PTR_INDEX["value"]


def _ws_maps(p: Problem, cache_box: int, inputs: bool):
    """``maps(ptrs)``: the warp-specialized kernel's tensor maps of one call (key_cache, value_cache, key,
    value; zeros where its plan uses none), encoded per address (:func:`tma.rows_map` keeps recent ones)."""
    slots, heads, d = p.num_blocks * p.block_size, p.kv_num_heads, p.head_size
    tokens, zero, rows_map = p.token_count, tma.ZERO_MAP, tma.rows_map

    def maps(ptrs):
        kc = vc = k = v = zero
        if cache_box:
            kc = rows_map(ptrs[_KEY_CACHE], slots, heads, d, cache_box)
            vc = rows_map(ptrs[_VALUE_CACHE], slots, heads, d, cache_box)
        if inputs:
            k = rows_map(ptrs[_KEY], tokens, heads, d, WS_WARP_KEYS)
            v = rows_map(ptrs[_VALUE], tokens, heads, d, WS_WARP_KEYS)
        return (kc, vc, k, v)

    return maps


BACKEND = PrefillWgmmaBackend()
