"""The general CUDA backend: attention_bias, output_qk and lse for the calls the fused backends decline.

It serves every call (every layout, cache type but the packed 4-bit ones, head size up to
:data:`MAX_HEAD_SIZE`, mask rule, head_sink, softcap, split) and sits last in :data:`cupa.dispatch.CUDA_BACKENDS`: it prefers only the
calls that use a feature :data:`cupa.kernels.backend.FEATURES` names it the server of, so it wins only
where nothing else serves the call. Three launches, after the fused prologue (the cache write and
the Q workspace, :mod:`cupa.kernels.prologue`):

- the attention kernel: ``paged_general_mma`` (cuda_src/general_mma.cu; tensor cores) for fp16/bf16,
  SEPARATE, head_size 64/128/256, where its shared memory fits the device (:func:`uses_mma`), else
  ``paged_general_simt`` (cuda_src/general_simt.cu; CUDA cores: float32, other head sizes, LATENT);
  bias entries are read for admitted keys only (contract §4.3), scores go to output_qk as they are made;
- KV splits (:func:`split_plan`) where the grid would be short: cut at multiples of a ``chunk`` drawn
  from static sizes only (the bound decides how many trailing splits are launched, contract §4.5), their
  partial states merged in split order by ``paged_general_finish`` (cuda_src/general_finish.cu);
- ``paged_general_finish``, under several splits or output_qk: the merge, the zeros of output_qk outside
  each row's admitted range and, under qk_output=2, the scores turned into probabilities.

Verified on an H200 (tests/gpu/test_general.py, the isolation tests, the differential fuzz and
compute-sanitizer memcheck): ``Options(backend="auto")`` gives it the calls only it serves
(attention_bias, output_qk, LATENT shapes the mla backend declines) and any call the fused backends
decline.
"""

from __future__ import annotations

import math

import numpy as np

from .. import jit
from ..contract import Problem
from ..device import DeviceInfo
from ..errors import fail
from ..options import Options
from . import launch, registry, types
from .backend import FEATURES, CudaBackend, features_of
from .launch import POINTER
from .prologue import POINTER_INPUTS, prologue_launcher, q_passthrough
from .types import f32, i32

MMA_DTYPES = ("float16", "bfloat16")
MMA_HEAD_SIZES = (64, 128, 256)
#: head_size -> (keys per shared-memory tile, cp.async stages); mirrors GeneralMmaConfig in general_mma.cu
MMA_TILES = {64: (64, 3), 128: (64, 2), 256: (32, 2)}
MMA_ROWS = 64     # query rows of a CTA (4 warps of one m16 tile)
MMA_THREADS = 128
#: Static shared memory of paged_general_mma (1568 bytes on sm_80 and sm_90), counted with the dynamic part
#: against the device's per-CTA limit (tests/test_kernels_general.py checks the compiled kernels stay within it).
MMA_STATIC_SHARED = 1600
SIMT_THREADS = 128
#: 8-channel chunks per lane -> the head chunks the CUDA-core kernel is compiled for: head_size <= 256 with
#: 1 to 8 heads a CTA, and (LATENT) head_size <= 1024 with 2 (registers for 4 chunks of 2 heads' Q and O)
SIMT_SHAPES = {1: (1, 2, 4, 8), 4: (2,)}
#: The largest head_size (and v_head_size) of the CUDA-core kernel: 4 chunks of 8 channels a lane.
MAX_HEAD_SIZE = 32 * 8 * max(SIMT_SHAPES)
FINISH_WARPS = 4      # mirrors general_finish.cu
FINISH_KEYS = 2048
MIN_CHUNK = 256       # split granularity (a multiple of every tile's KEYS)
CTAS_PER_SM = 2       # the split plan's aim over the static KV capacity
MAX_GRID_X = (1 << 31) - 1
MAX_GRID_YZ = (1 << 16) - 1
CAPABILITY = (8, 0)


def mma_shared_bytes(problem: Problem, q_split: bool = False) -> int:
    """Dynamic shared memory of paged_general_mma (mirrors GeneralMmaSmem in general_mma.cu); ``q_split``: the
    QSPLIT instance's (a second Q tile)."""
    D = problem.head_size
    keys, stages = MMA_TILES[D]
    code = 1 if problem.quantized else 2
    q_bytes = MMA_ROWS * D * 2
    q_lo = q_bytes if q_split else 0
    stage = 2 * keys * D * code
    wide = 2 * keys * D * 2 if problem.quantized else 0
    tables = (stages + 1) * keys * (8 + 4) + (stages + 1) * (keys // 32) * 4
    return q_bytes + q_lo + stages * stage + wide + tables + 128


def mma_q_split(problem: Problem, device: DeviceInfo) -> bool:
    """Whether the tensor-core kernel keeps Q x the K scale as two T values: a quantized cache with per-channel K
    scales, where the second Q tile fits the device's shared memory (on 99 KB GPUs it does not at head_size 128
    and 256, and Q x scale is rounded to T once)."""
    return (problem.quantized and problem.k_quant == "PER_CHANNEL"
            and mma_shared_bytes(problem, True) + MMA_STATIC_SHARED <= device.shared_per_block_optin)


def mma_fits(problem: Problem, device: DeviceInfo) -> bool:
    """Whether paged_general_mma's shared memory (dynamic and static) fits one CTA of ``device``."""
    return mma_shared_bytes(problem) + MMA_STATIC_SHARED <= device.shared_per_block_optin


def uses_mma(problem: Problem, device: DeviceInfo) -> bool:
    """The tensor-core kernel: fp16/bf16, SEPARATE, head_size 64/128/256, its shared memory within the device's
    limit and its grid within a launch; else the CUDA-core kernel."""
    p = problem
    return (p.dtype in MMA_DTYPES and not p.latent and p.head_size in MMA_HEAD_SIZES and mma_fits(p, device)
            and mma_zero_ctas(p) + mma_tiles(p) * p.kv_num_heads <= MAX_GRID_X)


def mma_tiles(problem: Problem) -> int:
    """Row tiles on the shared axis (prefill_tiles.cuh): floor(N * G / 64) + B."""
    return problem.token_count * problem.group_size // MMA_ROWS + problem.batch_size


def mma_zero_ctas(problem: Problem) -> int:
    return math.ceil(problem.token_count / MMA_THREADS)


def simt_shape(problem: Problem) -> tuple:
    """``(head_chunk, chunks_per_lane)`` of the CUDA-core kernel: chunks of 8 channels a lane for head_size, and
    the group's heads a CTA holds (a power of two, as many as the chunks leave registers for)."""
    cpl = next(c for c in sorted(SIMT_SHAPES) if problem.head_size <= 256 * c)
    want = types.head_chunk(problem.group_size)
    return next((gt for gt in SIMT_SHAPES[cpl] if gt >= want), SIMT_SHAPES[cpl][-1]), cpl


def split_plan(problem: Problem, ctas: int, sm_count: int) -> tuple:
    """``(chunk, num_splits)``: split keys at multiples of ``chunk`` (static sizes only: the block table's
    capacity, the unsplit grid of ``ctas`` CTAs, the SM count), as many splits as the kv bound needs."""
    p = problem
    want = 1 << max(0, math.ceil(math.log2(max(1.0, CTAS_PER_SM * sm_count / max(ctas, 1)))))
    chunk = max(MIN_CHUNK, -(-math.ceil(p.static_kv_capacity / want) // MIN_CHUNK) * MIN_CHUNK)
    return chunk, max(1, math.ceil(p.max_kv_len_bound / chunk))


def launch_plan(problem: Problem, device: DeviceInfo) -> dict:
    """The launches of one call on ``device``, from static sizes and the bounds only.

    Returns a dict: ``kernel`` ("mma" or "simt"), ``grid`` / ``block`` / ``shared`` of the attention kernel,
    ``chunk`` and ``num_splits``, ``zero_ctas`` and ``num_tiles`` (mma), ``head_chunk`` and
    ``chunks_per_lane`` (simt), and ``finish_grid`` (None when no finish kernel runs: one split and no
    output_qk).
    """
    p = problem
    plan = {}
    if uses_mma(p, device):
        tiles = mma_tiles(p)
        chunk, splits = split_plan(p, tiles * p.kv_num_heads, device.sm_count)
        zero = mma_zero_ctas(p) if splits == 1 else 0  # with splits the finish kernel writes every row
        q_split = mma_q_split(p, device)
        plan.update(kernel="mma", num_tiles=tiles, zero_ctas=zero, grid=(zero + tiles * p.kv_num_heads, splits),
                    block=(MMA_THREADS,), shared=mma_shared_bytes(p, q_split), keys=MMA_TILES[p.head_size][0],
                    stages=MMA_TILES[p.head_size][1], q_split=q_split)
    else:
        gt, cpl = simt_shape(p)
        chunks = p.kv_num_heads * math.ceil(p.group_size / gt)
        chunk, splits = split_plan(p, p.token_count * chunks, device.sm_count)
        plan.update(kernel="simt", head_chunk=gt, chunks_per_lane=cpl, grid=(p.token_count, chunks, splits),
                    block=(SIMT_THREADS,), shared=0)
    plan.update(chunk=chunk, num_splits=splits)
    finish = splits > 1 or p.attrs.qk_output != 0
    qk_ctas = math.ceil(p.kv_capacity / FINISH_KEYS) if p.attrs.qk_output else 1
    plan["finish_grid"] = (p.token_count, math.ceil(p.num_heads / FINISH_WARPS), qk_ctas) if finish else None
    return plan


def workspace_layout(problem: Problem, plan: dict, itemsize: int) -> dict:
    """Byte offsets in the call's workspace: ``q`` (the Q workspace, unless the kernels read ``query``),
    ``lse`` (lse of one split for qk_output=2 without return_lse), ``part_o`` and ``part_ml`` (split partial
    states), each -1 when absent, and ``nbytes`` in all."""
    p, a = problem, problem.attrs
    rows = p.token_count * p.num_heads
    sizes = {"q": 0 if q_passthrough(p) else rows * p.head_size * itemsize,
             "lse": rows * 4 if plan["num_splits"] == 1 and a.qk_output == 2 and not a.return_lse else 0,
             "part_o": rows * plan["num_splits"] * p.v_head_size * 4 if plan["num_splits"] > 1 else 0,
             "part_ml": rows * plan["num_splits"] * 8 if plan["num_splits"] > 1 else 0}
    layout, at = {}, 0
    for name, size in sizes.items():
        layout[name] = at if size else -1
        at += launch.align(size)
    layout["nbytes"] = at
    return layout


def _servers(feature: str) -> tuple:
    """The backends :data:`FEATURES` names as serving ``feature``."""
    where = FEATURES[feature][1]
    return where if isinstance(where, tuple) else (where,) if where else ()


class GeneralBackend(CudaBackend):
    """Every call, on tensor cores or CUDA cores (:func:`launch_plan`); preferred only for the features no fused
    backend serves."""

    name = "general"
    verified = True   # tests/gpu/test_general.py, tests/gpu/test_isolation.py, python -m tests.fuzz on an H200
    serves = frozenset(FEATURES) - {"subbyte"}   # its kernels read caches of whole-byte codes

    def reasons(self, problem: Problem, device: DeviceInfo, options: Options) -> list:
        p, reasons = problem, []
        if device.capability < CAPABILITY:
            reasons.append(f"needs compute capability 8.0+; the device has {device.capability[0]}."
                           f"{device.capability[1]}")
        if p.head_size > MAX_HEAD_SIZE:
            reasons.append(f"head_size {p.head_size} > {MAX_HEAD_SIZE} (the general backend's largest head)")
            return reasons
        plan = launch_plan(p, device)
        if plan["kernel"] == "simt" and plan["grid"][1] > MAX_GRID_YZ:
            reasons.append(f"{plan['grid'][1]} CTAs per token exceed a launch's grid y ({MAX_GRID_YZ})")
        finish = plan["finish_grid"]
        if finish is not None and max(finish[1:]) > MAX_GRID_YZ:
            reasons.append(f"the finish grid {finish} exceeds a launch's grid y/z ({MAX_GRID_YZ})")
        return reasons

    def preferred(self, problem: Problem, device: DeviceInfo = None, options: Options = None) -> bool:
        # Every call is served here, but a fused backend is faster where it serves: prefer only the calls that use
        # a feature this backend serves (FEATURES names who does; LATENT alone is the MLA backend's). Backends
        # earlier in priority order that serve the feature too and prefer the call take it first (output_qk:
        # the decode backend's decode-shaped calls).
        return any(self.name in _servers(f) for f in features_of(problem))

    def describe(self, problem: Problem, device: DeviceInfo, options: Options) -> str:
        p, plan = problem, launch_plan(problem, device)
        if plan["kernel"] == "mma":
            what = (f"tensor cores (mma.sync m16n8k16): one CTA per (tile of {MMA_ROWS} (token, group head) rows, "
                    f"KV head, split); {plan['num_tiles']} row tiles x {p.kv_num_heads} KV heads; keys in tiles of "
                    f"{plan['keys']} through a {plan['stages']}-stage cp.async pipeline")
        else:
            why = ("LATENT" if p.latent else f"T={p.dtype}" if p.dtype not in MMA_DTYPES else
                   f"head_size {p.head_size}" if p.head_size not in MMA_HEAD_SIZES else
                   f"its {mma_shared_bytes(p) + MMA_STATIC_SHARED} B of shared memory > the device's "
                   f"{device.shared_per_block_optin} B")
            what = (f"CUDA cores ({why}): one CTA per (token, KV head, {plan['head_chunk']}-head chunk, split), "
                    f"{plan['chunks_per_lane']} 8-channel chunk(s) a lane")
        used = ", ".join(FEATURES[f][0] for f in features_of(p)) or "no feature beyond the fused backends'"
        jobs = (["merges the splits"] if plan["num_splits"] > 1 else []) + (
            [f"writes the rest of output_qk{' as probabilities' if p.attrs.qk_output == 2 else ''}"]
            if p.attrs.qk_output else [])
        finish = f"; a finish kernel {' and '.join(jobs)}" if jobs else ""
        return (f"general backend on {what}; {plan['num_splits']} split(s) of {plan['chunk']} key positions; "
                f"fused prologue first{finish}; serves {used}"
                + ("" if self.verified else "; not yet verified on a GPU"))

    def specializations(self) -> list:
        specs = []
        for dtype in types.ACT_CXX:
            for kind in types.BYTE_KINDS:
                specs.append(registry.prologue_spec(dtype, kind))
                for cpl, chunks in SIMT_SHAPES.items():
                    specs.extend(registry.general_simt_spec(dtype, kind, gt, cpl) for gt in chunks)
                if dtype in MMA_DTYPES:
                    specs.extend(registry.general_mma_spec(dtype, kind, d) for d in MMA_HEAD_SIZES)
                    if kind != "T":
                        specs.extend(registry.general_mma_spec(dtype, kind, d, True) for d in MMA_HEAD_SIZES)
            specs.append(registry.general_finish_spec(dtype))
        return specs

    def run(self, plan, inputs: dict, out=None, stream=None):
        p = plan.problem
        call = launch.prepare(p, inputs, out, stream)
        if p.token_count == 0:
            return call.finish()
        r = plan.state.get("recipe")
        with call:
            if r is None:
                r = plan.state["recipe"] = self._recipe(plan, call)
            if r.aligned_out and call.output_ptr % 16:
                raise fail("out", f"a device pointer at {call.output_ptr:#x}",
                           "16-byte alignment (the tensor-core kernel stores whole 16-byte chunks)")
            # One allocation for the Q workspace, the lse of qk_output=2 and the split partials, held (by `ws`)
            # until the launches are enqueued, and by a capture for the graph's life.
            w = r.workspace
            ws = launch.workspace(w["nbytes"]) if w["nbytes"] else None

            def at(name):
                return ws.ptr + w[name] if w[name] >= 0 else 0

            lse = call.lse_ptr or at("lse")
            r.launches(call.ptrs + [at("q"), call.output_ptr, call.qk_ptr, lse, at("part_o"), at("part_ml"), 0],
                       call.stream.ptr)
        return call.finish()

    def _recipe(self, plan_, call) -> "_Recipe":
        """The launches of a plan (built once per plan, with the call's device current): the prologue, the
        attention kernel (a programmatic step: every CTA with rows waits for the prologue before reading Q or
        the cache) and the finish kernel."""
        p, device, options = plan_.problem, plan_.device, plan_.options
        a = p.attrs
        plan = launch_plan(p, device)
        bias_dims = p.bias_shape if p.has_bias else (1, 1, 0, 0)
        rotary_max_pos = p.rotary_max_pos if p.rotary_dim else 0
        masks = (i32(rotary_max_pos), f32(p.scale), f32(a.softcap), i32(a.local_window_size), i32(a.is_causal),
                 i32(types.QUANT_CODE[p.k_quant]), i32(types.QUANT_CODE[p.v_quant]),
                 *(i32(d) for d in bias_dims), i32(a.qk_output), i32(p.kv_capacity))
        pointers = (POINTER,) * len(_ATTEND)
        if plan["kernel"] == "mma":
            spec = registry.general_mma_spec(p.dtype, p.cache_kind, p.head_size, plan["q_split"])
            scalars = (i32(p.token_count), i32(p.num_heads), i32(p.kv_num_heads), i32(p.batch_size), i32(p.num_blocks),
                       i32(p.block_size), i32(p.max_blocks_per_seq), i32(plan["zero_ctas"]), i32(plan["num_tiles"]),
                       i32(plan["chunk"]), i32(plan["num_splits"]))
        else:
            spec = registry.general_simt_spec(p.dtype, p.cache_kind, plan["head_chunk"], plan["chunks_per_lane"])
            scalars = (i32(p.token_count), i32(p.num_heads), i32(p.kv_num_heads), i32(p.head_size),
                       i32(p.v_head_size), i32(p.batch_size), i32(p.num_blocks), i32(p.block_size),
                       i32(p.max_blocks_per_seq), i32(plan["chunk"]), i32(plan["num_splits"]))
        kernel = jit.get_kernel(spec)
        launch.ensure_shared_memory(kernel, plan["shared"])
        attend = launch.Launcher(kernel, plan["grid"], plan["block"], pointers + scalars + masks,
                                 shared_mem=plan["shared"])
        sources = {}
        if q_passthrough(p):
            sources["q"] = _I["query"]  # the prologue only writes K/V; the kernels read `query` itself
        if p.latent:  # one cache: V is the leading v_head_size channels of the K row, k_scale describes it
            sources.update(value_cache=_NULL, v_scale=_I["k_scale"])
        steps = [(prologue_launcher(p, device, options), _PROLOGUE_POINTERS),
                 (attend, _pointers(_ATTEND, sources), True)]
        if plan["finish_grid"] is not None:
            finish = launch.Launcher(
                jit.get_kernel(registry.general_finish_spec(p.dtype)), plan["finish_grid"], (FINISH_WARPS * 32,),
                (POINTER,) * len(_FINISH) + (
                    i32(p.token_count), i32(p.num_heads), i32(p.kv_num_heads), i32(p.head_size), i32(p.v_head_size),
                    i32(p.batch_size), np.int64(p.static_kv_capacity), i32(plan["chunk"]),
                    i32(plan["num_splits"]), i32(rotary_max_pos), i32(a.local_window_size), i32(a.is_causal),
                    i32(types.QUANT_CODE[p.v_quant]), i32(bias_dims[2]), i32(bias_dims[3]), i32(a.qk_output),
                    i32(p.kv_capacity)))
            steps.append((finish, _pointers(_FINISH, sources)))
        r = _Recipe()
        r.launches = launch.Sequence(steps, _NPOINTERS, route=options.launch, pdl=launch.pdl_allowed(device, options))
        r.workspace = workspace_layout(p, plan, call.dev["query"].dtype.itemsize)
        r.aligned_out = plan["kernel"] == "mma"
        return r


class _Recipe:
    """The launches of one problem on one device, the workspace layout (:func:`workspace_layout`) and whether the
    output must be 16-byte aligned (the tensor-core kernel's stores)."""

    __slots__ = ("launches", "workspace", "aligned_out")


# Pointer arguments, as positions in Call.ptrs extended by
# [Q workspace, output, output_qk, lse (output or workspace), part_o, part_ml, a null pointer].
_Q_WS, _OUT, _QK, _LSE, _PART_O, _PART_ML, _NULL = range(len(launch.PTR_INDEX), len(launch.PTR_INDEX) + 7)
_NPOINTERS = len(launch.PTR_INDEX) + 7
_I = launch.PTR_INDEX
# The prologue: its inputs, the Q workspace, and no split counters (null).
_PROLOGUE_POINTERS = tuple(_I[n] for n in POINTER_INPUTS) + (_Q_WS, _NULL)
# The pointer parameters of paged_general_mma / paged_general_simt and of paged_general_finish, in order: the
# kernel's name for each and where it comes from by default.
_ATTEND = {"q": _Q_WS, **{n: _I[n] for n in ("key_cache", "value_cache", "cumulative_sequence_length",
                                              "past_seqlens", "block_table", "query_positions", "head_sink",
                                              "k_scale", "v_scale", "attention_bias")},
           "out": _OUT, "output_qk": _QK, "lse": _LSE, "part_o": _PART_O, "part_ml": _PART_ML}
_FINISH = {**{n: _I[n] for n in ("cumulative_sequence_length", "past_seqlens", "query_positions", "head_sink",
                                 "v_scale", "attention_bias")},
           "part_o": _PART_O, "part_ml": _PART_ML, "out": _OUT, "output_qk": _QK, "lse": _LSE}


def _pointers(params: dict, sources: dict) -> tuple:
    """The pointer-list positions of a kernel's pointer parameters, ``sources`` replacing some defaults."""
    return tuple(sources.get(name, slot) for name, slot in params.items())

BACKEND = GeneralBackend()
