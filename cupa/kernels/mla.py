"""The absorbed-MLA backend: kv_cache_layout LATENT (DeepSeek-V2/V3/R1), prologue then one fused attention kernel
(then a merge kernel where a call has several splits).

In absorbed form MLA is MQA with one wide KV head: every query head reads the same 576-channel latent
row (512 compressed channels + 64 rotary ones), and V is that row's first 512 channels. After the
fused prologue (offset RoPE at rotary_offset=512, the latent cache write, quantization), one launch
does the attention (cuda_src/mla.cuh): a CTA owns a row tile -- ``rows`` consecutive (token, head) rows of
one sequence, token-major, so all heads of a token share every latent tile it reads -- and one split
of the key axis. Row tiles are numbered as the prefill kernels number theirs (a ragged batch in one
launch, decode and chunked prefill alike). Each tile cuts its own keys into at most ``tile_splits``
splits (:func:`split_plan`, from static sizes) of at least :data:`MIN_CHUNK` keys, so a tile's split
depends on its own range only and attention_metadata only drops trailing splits (bit-identical results
with absent, tight or loose bounds). Where a call has several splits, ``paged_mla_merge``
(cuda_src/mla_merge.cu) runs next and merges the split tiles' partial states over the whole GPU.

Kernels (:func:`kernel_choice`):

- compute capability 9.0, caches of T, 64-row tiles: ``paged_mla_wgmma`` (cuda_src/mla_wgmma.cu, sm_90a:
  wgmma, TMA, one CTA per SM);
- otherwise ``paged_mla_mma`` (cuda_src/mla_mma.cu, mma.sync, compute capability 8.0+) in the largest
  configuration that fits the device's shared memory (:data:`MMA_CONFIGS`); fp8 latent caches
  always run here (codes widened to T in shared memory).

A decode step of at most 16 heads takes 16-row tiles; everything else 64-row tiles.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from .. import jit
from ..contract import Problem
from ..device import DeviceInfo
from ..errors import fail
from ..options import Options
from . import launch, registry, tma, types
from .backend import CudaBackend
from .launch import POINTER
from .prologue import POINTER_INPUTS, prologue_launcher, q_passthrough
from .types import f32, i32

MLA_HEAD_SIZE = 576    # kv_lora_rank 512 + qk_rope_head_dim 64
MLA_V_HEAD_SIZE = 512  # kv_lora_rank
DTYPES = ("float16", "bfloat16")
CACHE_KINDS = ("T", "fp8")
#: (rows, keys) of paged_mla_mma in order of preference; mirrors MlaMmaConfig in cuda_src/mla_mma.cu.
MMA_CONFIGS = ((64, 64), (64, 32), (16, 64), (16, 32))
STAGES = 2
WGMMA_ROWS = WGMMA_KEYS = 64
WGMMA_THREADS = 256
WGMMA_CAPABILITY = (9, 0)
#: A decode step of at most this many heads takes 16-row tiles (the others 64).
SMALL_TILE_HEADS = 16
#: Splits start at multiples of this (a key tile, and the wgmma kernel's tile origin); MLA_CHUNK_ALIGN in mla.cuh.
CHUNK_ALIGN = 64
#: Fewest keys per split (the merge of partial states costs about one key tile's worth of traffic);
#: MLA_MIN_CHUNK in mla.cuh.
MIN_CHUNK = 256
#: Rows per CTA of the merge kernel (MLA_MERGE_WARPS in cuda_src/mla_merge.cu: one warp a row).
MERGE_WARPS = 8
#: Shared memory the driver reserves per CTA on compute capability 8.0+ (counts against the SM's share).
RESERVED_SHARED = 1024
MAX_GRID_X = (1 << 31) - 1
MAX_GRID_Y = 65535
MAX_ROWS = (1 << 31) - 1        # rows t * H + h are 32-bit in the merge
MAX_SLOTS = (1 << 32) - 1       # cache rows are 32-bit, 0xffffffff marking a masked key
TMA_MIN_BOX = 8                 # box destinations stay 1024-byte aligned for boxes of 8, 16, 32, 64 rows


def mma_threads(rows: int) -> int:
    """Threads of paged_mla_mma: 8 warps for either tile (at most 128 fp32 accumulators a thread)."""
    return 256


def mma_shared_bytes(rows: int, keys: int, quantized: bool) -> int:
    """Dynamic shared memory of paged_mla_mma (mirrors MlaMmaSmem in cuda_src/mla_mma.cu): Q, two stages of
    the key tile as stored, the fp8 tile widened to T, P, the key rows (3 tiles), the per-key-group
    row maxima, four per-row int arrays and the tile record."""
    code = 1 if quantized else 2
    q = rows * MLA_HEAD_SIZE * 2
    stages = STAGES * keys * MLA_HEAD_SIZE * code
    wide = keys * MLA_HEAD_SIZE * 2 if quantized else 0
    p = rows * 64 * 2
    key_rows = (STAGES + 1) * keys * 4
    maxima = (keys // 16) * rows * 4
    return q + stages + wide + p + key_rows + maxima + 4 * rows * 4 + 64


def wgmma_shared_bytes() -> int:
    """Dynamic shared memory of paged_mla_wgmma (mirrors MlaWgSmem in cuda_src/mla_wgmma.cu): Q, two stages of
    the key tile, P, the key rows and their bits (3 slots), the stages' bits, per-row ranges and
    rescale factors, 8 mbarrier slots, the tile record, and the pad to a 1024-byte boundary."""
    rows, keys = WGMMA_ROWS, WGMMA_KEYS
    used = (rows * MLA_HEAD_SIZE * 2 + STAGES * keys * MLA_HEAD_SIZE * 2 + rows * keys * 2 + 3 * keys * 4 + 3 * 2 * 4
            + STAGES * 2 * 4 + 2 * rows * 4 + rows * 4 + 8 * 8 + 64)
    return used + 1024


@dataclass(frozen=True)
class Kernel:
    """One MLA kernel configuration: ``path`` "wgmma" or "mma", the tile's ``rows``, the key tile's ``keys``,
    ``threads`` per CTA, dynamic ``shared`` bytes and the CTAs that fit an SM at once (``resident``)."""

    path: str
    rows: int
    keys: int
    threads: int
    shared: int
    resident: int

    def spec(self, problem: Problem) -> jit.Specialization:
        if self.path == "wgmma":
            return registry.mla_wgmma_spec(problem.dtype)
        return registry.mla_mma_spec(problem.dtype, problem.cache_kind, self.rows, self.keys)


def tile_rows(problem: Problem) -> int:
    """Rows per tile wanted: 16 for a decode step (token_count <= batch_size) of at most 16 heads, else 64."""
    p = problem
    return 16 if p.token_count <= p.batch_size and p.num_heads <= SMALL_TILE_HEADS else 64


def _resident(device: DeviceInfo, threads: int, shared: int) -> int:
    # Registers: the kernels take up to 255 a thread (launch bounds allow one 256-thread CTA, two of 128).
    by_regs = max(1, 65536 // (threads * 256))
    by_smem = max(1, device.shared_per_sm // (shared + RESERVED_SHARED))
    return min(by_regs, by_smem)


def kernel_choice(problem: Problem, device: DeviceInfo, options: Options) -> Optional[Kernel]:
    """The kernel of a call on ``device``: wgmma on compute capability 9.0 for 64-row tiles of a T cache
    (unless ``Options._tuning.mla_wgmma`` is off), else the first :data:`MMA_CONFIGS` entry with the wanted
    rows (then 16 rows) whose shared memory fits ``device.shared_per_block_optin``; None when none fits."""
    p = problem
    rows = tile_rows(p)
    if (device.capability == WGMMA_CAPABILITY and p.cache_kind == "T" and rows == WGMMA_ROWS
            and options._tuning.mla_wgmma and wgmma_shared_bytes() <= device.shared_per_block_optin):
        return Kernel("wgmma", WGMMA_ROWS, WGMMA_KEYS, WGMMA_THREADS, wgmma_shared_bytes(), 1)
    for r, k in sorted(MMA_CONFIGS, key=lambda c: c[0] != rows):
        if rows == 16 and r != 16:
            continue
        shared = mma_shared_bytes(r, k, p.quantized)
        if shared <= device.shared_per_block_optin:
            threads = mma_threads(r)
            return Kernel("mma", r, k, threads, shared, _resident(device, threads, shared))
    return None


def split_plan(problem: Problem, device: DeviceInfo, options: Options, kernel: Kernel) -> tuple:
    """``(tile_splits, num_splits)``. Each row tile cuts its own keys (its rows' admitted ranges, from a multiple
    of :data:`CHUNK_ALIGN`) into at most ``tile_splits`` equal chunks of at least :data:`MIN_CHUNK` keys (one
    where fewer keys; cuda_src/mla.cuh: mla_splits), so a short sequence takes as many splits as a long one,
    each tile's split
    depending on its own keys only. ``tile_splits`` comes from static sizes only (token, head and sequence
    counts, block_table capacity, the SM count): splits are added only where the row tiles alone would leave
    SMs idle, enough to fill ``Options._tuning.mla_waves`` waves of resident CTAs. ``num_splits`` (launched)
    drops, from the bound, the splits no tile can reach."""
    p = problem
    rows = kernel.rows
    tiles = p.token_count * -(-p.num_heads // rows) if p.token_count <= p.batch_size else \
        -(-(p.token_count * p.num_heads) // rows)
    slots = options._tuning.mla_waves * kernel.resident * device.sm_count
    tile_splits = max(1, min(slots // max(1, tiles), p.static_kv_capacity // MIN_CHUNK))
    num_splits = max(1, min(tile_splits, p.max_kv_len_bound // MIN_CHUNK))
    return tile_splits, num_splits


def tile_split(lo: int, hi: int, tile_splits: int, num_splits: int) -> tuple:
    """``(base, chunk, count)``: the split of a tile whose rows admit keys [lo, hi) (mirrors mla_splits in
    cuda_src/mla.cuh): ``count`` chunks of ``chunk`` keys from ``base``, the last one ending at or past hi."""
    if hi <= lo:
        return 0, CHUNK_ALIGN, 1
    base = lo - lo % CHUNK_ALIGN
    span = hi - base
    n = max(1, min(tile_splits, span // MIN_CHUNK))
    chunk = -(-(-(-span // n)) // CHUNK_ALIGN) * CHUNK_ALIGN
    return base, chunk, min(-(-span // chunk), num_splits)


def tma_box(problem: Problem, options: Options) -> int:
    """Rows per TMA box of the wgmma kernel (0: cp.async gathers only): gcd(block_size, 64) when at least 8
    (a box lies in one block, tiles start on 64-key boundaries), the cache's slots fit 32-bit coordinates,
    ``Options.tma`` is on and the driver encodes tensor maps."""
    p = problem
    box = math.gcd(p.block_size, WGMMA_KEYS)
    if box < TMA_MIN_BOX or not 0 < p.num_blocks * p.block_size <= tma.MAX_ROWS:
        return 0
    return box if options.tma and tma.available() else 0


def launch_plan(problem: Problem, device: DeviceInfo, options: Options) -> dict:
    """Kernel, grid and split plan of a call, from static sizes only (never device data)."""
    p = problem
    kernel = kernel_choice(p, device, options)
    if kernel is None:
        return {"kernel": None}
    tile_splits, num_splits = split_plan(p, device, options, kernel)
    num_tiles = (p.token_count * p.num_heads) // kernel.rows + p.batch_size
    zero_ctas = -(-p.token_count // kernel.threads)  # one thread per token checks its ownership
    return {"kernel": kernel, "rows": kernel.rows, "keys": kernel.keys, "threads": kernel.threads,
            "num_tiles": num_tiles, "zero_ctas": zero_ctas, "grid": (zero_ctas + num_tiles, num_splits),
            "tile_splits": tile_splits, "num_splits": num_splits, "shared": kernel.shared,
            "merge_grid": (num_tiles, kernel.rows // MERGE_WARPS) if num_splits > 1 else None}


def workspace_layout(problem: Problem, plan: dict, q_itemsize: int = 2) -> dict:
    """Byte offsets in the call's one workspace: the Q rows the prologue writes (none under
    :func:`cupa.kernels.prologue.q_passthrough`), then with several splits the fp32 partial outputs
    (rows x splits x 512), the partial (max, sum) pairs and one 16-byte record per row tile for the merge
    (MlaTileRecord in cuda_src/mla.cuh; zeroed by the prologue as ``counters_per_token`` ints per token)."""
    p = problem
    q_bytes = 0 if q_passthrough(p) else p.token_count * p.num_heads * p.head_size * q_itemsize
    layout = {"q": 0, "part_o": 0, "part_ml": 0, "records": 0, "counters_per_token": 0}
    nbytes = launch.align(q_bytes)
    if plan["num_splits"] > 1:
        rows = p.token_count * p.num_heads * plan["num_splits"]
        layout["part_o"] = nbytes
        layout["part_ml"] = layout["part_o"] + launch.align(rows * MLA_V_HEAD_SIZE * 4)
        layout["records"] = layout["part_ml"] + launch.align(rows * 8)
        layout["counters_per_token"] = -(-4 * plan["num_tiles"] // p.token_count)
        nbytes = layout["records"] + launch.align(p.token_count * layout["counters_per_token"] * 4)
    layout["nbytes"] = nbytes
    return layout


class MlaBackend(CudaBackend):
    name = "mla"
    verified = True   # tests/gpu/test_mla.py: both kernels against the reference on an H200
    serves = frozenset({"latent", "return_lse"})

    def reasons(self, problem: Problem, device: DeviceInfo, options: Options) -> list:
        p, reasons = problem, []
        if not p.latent:
            return ["kv_cache_layout 'SEPARATE': the MLA backend serves kv_cache_layout='LATENT' (absorbed MLA)"]
        if p.head_size != MLA_HEAD_SIZE or p.v_head_size != MLA_V_HEAD_SIZE:
            reasons.append(f"head_size {p.head_size} / v_head_size {p.v_head_size}: the MLA kernels take "
                           f"{MLA_HEAD_SIZE} / {MLA_V_HEAD_SIZE} (kv_lora_rank 512 + 64 rotary channels)")
        if p.dtype not in DTYPES:
            reasons.append(f"T={p.dtype}: the MLA kernels take float16 or bfloat16")
        if p.cache_kind not in CACHE_KINDS:
            reasons.append(f"{p.cache_kind} latent cache: the MLA kernels take caches of T or float8e4m3fn")
        if p.token_count * p.num_heads > MAX_ROWS:
            reasons.append(f"token_count * num_heads = {p.token_count * p.num_heads} rows exceed {MAX_ROWS}")
        if p.num_blocks * p.block_size >= MAX_SLOTS:
            reasons.append(f"{p.num_blocks * p.block_size} cache slots: the MLA kernels index fewer than {MAX_SLOTS}")
        if reasons:
            return reasons
        plan = launch_plan(p, device, options)
        if plan["kernel"] is None:
            need = min(mma_shared_bytes(r, k, p.quantized) for r, k in MMA_CONFIGS)
            return [f"no MLA kernel configuration fits {device.shared_per_block_optin} B of shared memory per CTA "
                    f"(the smallest needs {need} B)"]
        if plan["grid"][0] > MAX_GRID_X or plan["grid"][1] > MAX_GRID_Y:
            reasons.append(f"grid {plan['grid']} exceeds one launch ({MAX_GRID_X} x {MAX_GRID_Y})")
        return reasons

    def describe(self, problem: Problem, device: DeviceInfo, options: Options) -> str:
        p = problem
        plan = launch_plan(p, device, options)
        k = plan["kernel"]
        if k.path == "wgmma":
            box = tma_box(p, options)
            feed = (f"TMA in boxes of {box} rows where a tile's keys are all mapped and admitted, else cp.async "
                    "gathers" if box else "cp.async gathers")
            engine = (f"Hopper warpgroup MMA (wgmma m64n64k16 / m64n128k16, sm_90a; two warpgroups splitting the "
                      f"512 output channels; loads by {feed})")
        else:
            engine = ("tensor cores (mma.sync m16n8k16" + (", fp8 codes widened in shared memory" if p.quantized
                                                            else "") + ")")
        return (f"absorbed MLA ({p.num_heads} heads sharing one {MLA_HEAD_SIZE}-channel latent row, V its first "
                f"{MLA_V_HEAD_SIZE} channels) on {engine}: one CTA per (tile of {k.rows} (token, head) rows of one "
                f"sequence, split); {plan['num_tiles']} row tiles x {plan['num_splits']} split(s) (each tile's keys "
                f"cut into at most {plan['tile_splits']} of at least {MIN_CHUNK}) + {plan['zero_ctas']} zero-pass "
                f"CTA(s); keys in tiles of {k.keys} through a {STAGES}-stage pipeline; {k.shared} B of shared memory, "
                f"{k.resident} CTA(s) per SM; fused prologue first"
                + ("; the split tiles merged by a kernel of their own" if plan["num_splits"] > 1 else ""))

    def specializations(self) -> list:
        specs = []
        for dtype in DTYPES:
            for kind in CACHE_KINDS:
                specs.append(registry.prologue_spec(dtype, kind))
                specs.extend(registry.mla_mma_spec(dtype, kind, r, k) for r, k in MMA_CONFIGS)
            specs.append(registry.mla_wgmma_spec(dtype))
            specs.append(registry.mla_merge_spec(dtype))
        return specs

    def run(self, plan, inputs: dict, out=None, stream=None):
        p = plan.problem
        call = launch.prepare(p, inputs, out, stream)
        if p.token_count == 0:
            return call.finish()
        if call.output_ptr % 16:
            raise fail("out", f"a device pointer at {call.output_ptr:#x}",
                       "16-byte alignment (the MLA kernels store whole 16-byte chunks)")
        r = plan.state.get("recipe")
        with call:
            if r is None:
                r = plan.state["recipe"] = self._recipe(plan, call)
            # Q workspace and split partials: one allocation, held (by `ws`) until the launches are enqueued,
            # and by a capture for the graph's life.
            ws = launch.workspace(r.layout["nbytes"]) if r.layout["nbytes"] else None
            base = ws.ptr if ws is not None else 0
            lay = r.layout
            extra = [base, call.output_ptr, call.lse_ptr]
            extra += [base + lay["part_o"], base + lay["part_ml"], base + lay["records"]] if r.split else [0, 0, 0]
            ptrs = call.ptrs + extra
            r.launches(ptrs, call.stream.ptr, r.maps(ptrs) if r.maps is not None else ())
        return call.finish()

    def _recipe(self, plan, call) -> "_Recipe":
        """The prologue and attention launches of a plan and its workspace layout (built once per plan, with
        the call's device current). The attention kernel waits for the prologue in every CTA
        (grid_dependency_wait) before it reads Q or cache rows or writes its tile record: a programmatic step;
        so does the merge, before it reads the records and partial states."""
        p, device, options = plan.problem, plan.device, plan.options
        a = p.attrs
        lp = launch_plan(p, device, options)
        k = lp["kernel"]
        r = _Recipe()
        r.split = lp["num_splits"] > 1
        r.layout = workspace_layout(p, lp, call.dev["query"].dtype.itemsize)
        prologue = prologue_launcher(p, device, options, r.layout["counters_per_token"])
        kernel = jit.get_kernel(k.spec(p))
        launch.ensure_shared_memory(kernel, k.shared)
        args = (POINTER,) * len(_ATTEND_POINTERS) + (
            i32(p.token_count), i32(p.num_heads), i32(p.batch_size), i32(p.num_blocks), i32(p.block_size),
            i32(p.max_blocks_per_seq), i32(lp["zero_ctas"]), i32(lp["num_tiles"]), i32(lp["tile_splits"]),
            i32(lp["num_splits"]), i32(p.rotary_max_pos if p.rotary_dim else 0), f32(p.scale), f32(a.softcap),
            i32(a.local_window_size), i32(a.is_causal), i32(types.QUANT_CODE[p.k_quant]))
        r.maps = None
        if k.path == "wgmma":
            box = tma_box(p, options)
            args += (launch.TENSOR_MAP, i32(box))
            r.maps = _maps(p, box)
        attend = launch.Launcher(kernel, lp["grid"], (k.threads,), args, shared_mem=k.shared)
        pointers = list(_ATTEND_POINTERS)
        if q_passthrough(p):
            pointers[0] = _I["query"]  # the prologue only writes the latent rows; the kernel reads `query`
        steps = [(prologue, _PROLOGUE_POINTERS), (attend, pointers, True)]
        if r.split:
            merge = jit.get_kernel(registry.mla_merge_spec(p.dtype))
            steps.append((launch.Launcher(merge, lp["merge_grid"], (MERGE_WARPS * 32,),
                                          (POINTER,) * len(_MERGE_POINTERS) + (
                                              i32(lp["num_splits"]), i32(types.QUANT_CODE[p.k_quant]))),
                          _MERGE_POINTERS, True))
        r.launches = launch.Sequence(steps, _NPOINTERS, route=options.launch, pdl=launch.pdl_allowed(device, options))
        return r


class _Recipe:
    """The launches of one problem on one device (prologue, the MLA kernel, and with several splits the merge),
    the workspace layout (:func:`workspace_layout`) and the tensor maps of a call (None: the kernel takes
    none)."""

    __slots__ = ("launches", "split", "layout", "maps")


_KEY_CACHE = launch.PTR_INDEX["key_cache"]


def _maps(p: Problem, box: int):
    """``maps(ptrs)``: the wgmma kernel's tensor map of one call's latent cache (zeros when ``box`` is 0)."""
    slots = p.num_blocks * p.block_size

    def maps(ptrs):
        return (tma.rows_map(ptrs[_KEY_CACHE], slots, 1, MLA_HEAD_SIZE, box) if box else tma.ZERO_MAP,)

    return maps


# Pointer arguments, as positions in Call.ptrs extended by [q workspace, output, lse, part_o, part_ml, records].
_Q_WS, _OUT, _LSE, _PART_O, _PART_ML, _RECORDS = range(len(launch.PTR_INDEX), len(launch.PTR_INDEX) + 6)
_NPOINTERS = len(launch.PTR_INDEX) + 6
_I = launch.PTR_INDEX
_PROLOGUE_POINTERS = tuple(_I[n] for n in POINTER_INPUTS) + (_Q_WS, _RECORDS)  # (the prologue zeroes the records)
# paged_mla_mma / paged_mla_wgmma: q, key_cache, cum, past, block_table, query_positions, k_scale, out, lse,
# part_o, part_ml, records
_ATTEND_POINTERS = (_Q_WS, _I["key_cache"], _I["cumulative_sequence_length"], _I["past_seqlens"], _I["block_table"],
                    _I["query_positions"], _I["k_scale"], _OUT, _LSE, _PART_O, _PART_ML, _RECORDS)
# paged_mla_merge: records, part_o, part_ml, k_scale, out, lse
_MERGE_POINTERS = (_RECORDS, _PART_O, _PART_ML, _I["k_scale"], _OUT, _LSE)

BACKEND = MlaBackend()
