"""The paged flash-decoding backend: prologue, split-KV attention over pages with an fp32 merge of the splits.

Split layout (contract §4.5): keys are cut at absolute positions that are multiples of ``chunk``,
a value drawn only from static sizes (block_table capacity, token and head counts, the SM
count), never from attention_metadata. The bound only decides how many trailing splits are
launched, so absent, tight and loose bounds give bit-identical results; a launched split with
no admitted key exits after reading its token's lengths.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

from .. import jit
from ..contract import Problem
from ..device import DeviceInfo
from ..options import Options
from . import launch, registry, types
from .backend import CudaBackend, ctas_per_sm, packed_cache_reasons, shared_reason
from .general import FINISH_KEYS, FINISH_WARPS, MAX_GRID_YZ
from .launch import POINTER
from .prologue import POINTER_INPUTS, prologue_launcher, q_passthrough
from .types import f32, i32

DECODE_THREADS = 128
MIN_CHUNK = 256
MMA_ROWS = 16  # query heads per tensor-core CTA (the m16n8k16 tile's rows)
MMA_HEAD_SIZES = (64, 128)
MMA_MAX_ROWS = (1 << 32) - 1  # cache rows the tensor-core kernel can index (decode_mma.cu NO_ROW)
MMA_STAGES = (3, 2)  # pipeline depths of paged_decode_mma (STAGES), deepest first
MMA_WARPS, MMA_KEY_TILE = 4, 64


def uses_mma(problem: Problem) -> bool:
    """Tensor-core kernel: fp16/bf16 activations and head_size 64 or 128; else CUDA cores.

    The tensor-core kernel names cache rows by 32-bit indices (0xffffffff: masked), so caches of
    2**32 - 1 rows (num_blocks * block_size * kv_num_heads) or more take the CUDA-core kernel.
    """
    rows = problem.num_blocks * problem.block_size * problem.kv_num_heads
    return problem.dtype in ("float16", "bfloat16") and problem.head_size in MMA_HEAD_SIZES and rows < MMA_MAX_ROWS


KEYS_AS_M_HEADS = 8  # query heads per CTA of the quantized caches' keys-as-M loop (one n-tile)


def uses_keys_as_m(problem: Problem, options: Options) -> bool:
    """The quantized caches' tensor-core loop with keys as the MMA's M dimension: GQA groups of at most 8 heads
    (output_qk calls take the head-major loop)."""
    return (options._tuning.decode_keys_as_m and uses_mma(problem) and problem.quantized
            and problem.group_size <= KEYS_AS_M_HEADS and not problem.attrs.qk_output)


def qk_finish_grid(problem: Problem) -> tuple:
    """The grid of paged_general_finish (general_finish.cu) completing output_qk after the decode kernel: one warp
    per (token, query head), FINISH_KEYS keys of its row per CTA along z."""
    return (problem.token_count, math.ceil(problem.num_heads / FINISH_WARPS),
            math.ceil(problem.kv_capacity / FINISH_KEYS))


def heads_per_cta(problem: Problem, options: Options) -> int:
    if uses_mma(problem):
        return KEYS_AS_M_HEADS if uses_keys_as_m(problem, options) else MMA_ROWS
    return types.head_chunk(problem.group_size)


def mma_shared_bytes(head_size: int, quantized: bool, stages: int, packed: bool = False) -> int:
    """Dynamic shared memory of paged_decode_mma (mirrors MmaDecodeSmem in decode_mma.cu; the kernel has
    no static shared memory): Q, then ``stages`` K/V tiles of 64 keys and the row indices of stages + 1
    tiles; after the key loop, the warps' m and l and their o rows (padded to D + 4 floats). ``packed``:
    packed 4-bit caches (rows of D / 2 bytes)."""
    D = head_size
    q_bytes = MMA_ROWS * D * 2
    row_bytes = D // 2 if packed else D * (1 if quantized else 2)
    loop = q_bytes + stages * 2 * MMA_KEY_TILE * row_bytes + (stages + 1) * MMA_KEY_TILE * 4
    combine = 2 * MMA_WARPS * MMA_ROWS * 4 + MMA_WARPS * MMA_ROWS * (D + 4) * 4
    return max(loop, q_bytes + combine)


def mma_stages(head_size: int, quantized: bool, device: DeviceInfo, ctas_target: int,
               packed: bool = False) -> Optional[int]:
    """The pipeline depth of paged_decode_mma on ``device``: the deepest of :data:`MMA_STAGES` that fits a
    CTA and keeps ``ctas_target`` CTAs per SM (the split plan's aim, ``Options._tuning.decode_ctas_per_sm``),
    else the one of them that fits the most CTAs per SM; None when none fits a CTA (the backend declines)."""
    D = head_size
    need = {s: mma_shared_bytes(D, quantized, s, packed) for s in MMA_STAGES}
    fits = [s for s in MMA_STAGES if need[s] <= device.shared_per_block_optin]
    if not fits:
        return None
    for s in fits:
        if ctas_per_sm(need[s], device) >= ctas_target:
            return s
    return max(fits, key=lambda s: (ctas_per_sm(need[s], device), s))


def split_plan(problem: Problem, sm_count: int, options: Options) -> tuple:
    """(chunk, num_splits, heads_per_cta): chunk from static sizes only, splits from the bound."""
    p = problem
    heads = heads_per_cta(p, options)
    ctas = p.token_count * p.kv_num_heads * math.ceil(p.group_size / heads)
    cap = p.static_kv_capacity
    # A power-of-two number of equal parts of the capacity keeps splits equal when lengths are too.
    target = options._tuning.decode_ctas_per_sm
    want = 1 << max(0, math.ceil(math.log2(max(1.0, target * sm_count / max(ctas, 1)))))
    chunk = max(MIN_CHUNK, -(-math.ceil(cap / want) // MIN_CHUNK) * MIN_CHUNK)
    num_splits = max(1, math.ceil(p.max_kv_len_bound / chunk))
    return chunk, num_splits, heads


class DecodeBackend(CudaBackend):
    name = "decode"
    # output_qk: the tensor-core kernel's QK instances (16-bit caches) write the scores of the keys each CTA
    # reads, and paged_general_finish (the general backend's finish kernel) writes the rest of every row and,
    # under qk_output=2, the probabilities.
    # (tests/gpu/test_decode_qk.py passes on an H200)
    serves = frozenset({"return_lse", "subbyte", "output_qk"})

    def reasons(self, problem: Problem, device: DeviceInfo, options: Options) -> list:
        reasons = packed_cache_reasons(problem)
        if problem.head_size > 256:
            reasons.append(f"head_size {problem.head_size} > 256")
        elif uses_mma(problem) and self._stages(problem, device, options) is None:
            need = mma_shared_bytes(problem.head_size, problem.quantized, MMA_STAGES[-1], problem.packed)
            reasons.append(shared_reason("paged_decode_mma", need, device))
        if problem.attrs.qk_output:
            if not uses_mma(problem) or problem.quantized:
                reasons.append("output_qk is written by the tensor-core kernel with fp16/bf16 activations, head_size "
                               "64 or 128 and 16-bit caches only (the general backend serves the rest)")
            elif max(qk_finish_grid(problem)[1:]) > MAX_GRID_YZ:
                reasons.append(f"output_qk's finish grid {qk_finish_grid(problem)} exceeds a launch's grid y/z "
                               f"({MAX_GRID_YZ})")
        return reasons

    def preferred(self, problem: Problem, device: DeviceInfo, options: Options) -> bool:
        # Seed 4.7: token_count <= batch_size comes here (prefill is tried first and declines those);
        # calls prefill cannot serve (fp32, odd head sizes) come here too: this kernel is exact for any input.
        # With output_qk, only decode-shaped calls: the general backend's row tiles serve longer queries.
        return not problem.attrs.qk_output or problem.token_count <= problem.batch_size

    def describe(self, problem: Problem, device: DeviceInfo, options: Options) -> str:
        chunk, splits, heads = split_plan(problem, device.sm_count, options)
        engine = "tensor cores (mma.sync m16n8k16)" if uses_mma(problem) else "CUDA cores"
        if uses_keys_as_m(problem, options):
            engine += ", keys as M"
        if uses_mma(problem):
            engine += f", a {self._stages(problem, device, options)}-stage K/V pipeline"
        qk = ""
        if problem.attrs.qk_output:
            qk = ("; the scores also go to output_qk, whose rows paged_general_finish completes "
                  f"(grid {qk_finish_grid(problem)})")
        return (f"paged flash-decoding on {engine}: one CTA per (token, KV head, {heads}-head chunk, split); "
                f"{splits} split(s) of {chunk} key positions; fused prologue first{qk}")

    @staticmethod
    def _stages(p: Problem, device: DeviceInfo, options: Options) -> Optional[int]:
        return mma_stages(p.head_size, p.quantized, device, options._tuning.decode_ctas_per_sm, p.packed)

    def _spec(self, p: Problem, device: DeviceInfo, options: Options):
        """The attention kernel of a call: paged_decode_mma (tensor cores) or paged_decode."""
        if uses_mma(p):
            return registry.decode_mma_spec(p.dtype, p.cache_kind, p.head_size, self._stages(p, device, options),
                                            keys_as_m=uses_keys_as_m(p, options), v_cache_kind=p.v_cache_kind,
                                            qk=bool(p.attrs.qk_output))
        return registry.decode_spec(p.dtype, p.cache_kind, heads_per_cta(p, options), p.v_cache_kind)

    def specializations(self) -> list:
        specs = []
        for dtype in types.ACT_CXX:
            for kind, v_kind in types.KV_KINDS:
                specs.append(registry.prologue_spec(dtype, kind, v_cache_kind=v_kind))
                specs.extend(registry.decode_spec(dtype, kind, heads, v_kind) for heads in types.HEAD_CHUNKS)
        for dtype in ("float16", "bfloat16"):
            for kind, v_kind in types.KV_KINDS:
                for stages in MMA_STAGES:
                    specs.extend(registry.decode_mma_spec(dtype, kind, d, stages, v_cache_kind=v_kind)
                                 for d in MMA_HEAD_SIZES)
                    if kind != "T":
                        specs.extend(registry.decode_mma_spec(dtype, kind, d, stages, keys_as_m=True,
                                                              v_cache_kind=v_kind) for d in MMA_HEAD_SIZES)
            for stages in MMA_STAGES:
                specs.extend(registry.decode_mma_spec(dtype, "T", d, stages, qk=True) for d in MMA_HEAD_SIZES)
            specs.append(registry.general_finish_spec(dtype))
        return specs

    def run(self, plan, inputs: dict, out=None, stream=None):
        p = plan.problem
        call = launch.prepare(p, inputs, out, stream, plan.options)
        if p.token_count == 0:
            return call.finish()
        r = plan.state.get("recipe")
        with call:
            if r is None:
                r = plan.state["recipe"] = self._recipe(plan, call)
            # Q workspace (unless the kernel reads `query` itself), split partials and (qk_output=2) the rows' lse:
            # one allocation, held (by `ws`) until the launches are enqueued, and by a capture for the graph's life.
            ws = launch.workspace(r.nbytes) if r.nbytes else None
            r.launches(launch_pointers(r, call, ws.ptr if ws is not None else 0), call.stream.ptr)
        return call.finish()

    def _recipe(self, plan, call) -> "_Recipe":
        """Everything about the launches of a plan that does not change per call.

        Built once per plan, with the call's device current (kernels are per device).
        """
        p, device, options = plan.problem, plan.device, plan.options
        a = p.attrs
        chunk, num_splits, heads = split_plan(p, device.sm_count, options)
        head_chunks = math.ceil(p.group_size / heads)
        r = _Recipe()
        counters_per_token = p.kv_num_heads * head_chunks if num_splits > 1 else 0
        passthrough = q_passthrough(p)  # the decode kernel reads `query` itself: no Q workspace
        q_bytes = 0 if passthrough else p.token_count * p.num_heads * p.head_size * call.dev["query"].dtype.itemsize
        r.nbytes = launch.align(q_bytes)
        r.part_o = r.part_ml = r.counters = 0
        if num_splits > 1:
            rows = p.token_count * p.num_heads * num_splits
            r.part_o = r.nbytes
            r.part_ml = r.part_o + launch.align(rows * p.head_size * 4)      # float part_o[rows][D]
            r.counters = r.part_ml + launch.align(rows * 2 * 4)              # float2 part_ml[rows]
            r.nbytes = r.counters + launch.align(p.token_count * counters_per_token * 4)  # int counters
        r.lse = -1  # qk_output=2 without return_lse: the rows' lse for the finish kernel, in the workspace
        if a.qk_output == 2 and not a.return_lse:
            r.lse = r.nbytes
            r.nbytes = r.lse + launch.align(p.token_count * p.num_heads * 4)
        common = (POINTER,) * len(_DECODE_POINTERS) + (i32(p.num_heads), i32(p.kv_num_heads))
        tail = (
            i32(p.batch_size), i32(p.num_blocks), i32(p.block_size), i32(p.max_blocks_per_seq), i32(chunk),
            i32(num_splits), i32(p.rotary_max_pos if p.rotary_dim else 0), f32(p.scale), f32(a.softcap),
            i32(a.local_window_size), i32(a.is_causal), i32(types.QUANT_CODE[p.k_quant]),
            i32(types.QUANT_CODE[p.v_quant]), i32(passthrough))
        grid = (p.token_count, p.kv_num_heads * head_chunks, num_splits)
        kernel = jit.get_kernel(self._spec(p, device, options))
        decode_pointers = ((_I["query"],) + _DECODE_POINTERS[1:]) if passthrough else _DECODE_POINTERS
        if uses_mma(p):
            shared = mma_shared_bytes(p.head_size, p.quantized, self._stages(p, device, options), p.packed)
            launch.ensure_shared_memory(kernel, shared)
            qk = (POINTER, i32(a.qk_output), i32(p.kv_capacity if a.qk_output else 0))  # output_qk, qk_mode, qk_width
            decode = launch.Launcher(kernel, grid, (DECODE_THREADS,), common + tail + qk, shared_mem=shared)
            decode_pointers += (_QK,)
        else:
            decode = launch.Launcher(kernel, grid, (DECODE_THREADS,), common + (i32(p.head_size),) + tail)
        r.split = num_splits > 1
        # The decode kernel waits for the prologue in every CTA (grid_dependency_wait): programmatic launch.
        # No prologue where it would only store rows and none is stored (no Q rows, no split counters).
        if passthrough and not r.split and not plan.writes:
            steps = [(decode, decode_pointers)]
        else:
            prologue = prologue_launcher(p, device, options, counters_per_token)
            steps = [(prologue, _PROLOGUE_POINTERS), (decode, decode_pointers, True)]
        if a.qk_output:
            steps.append((self._qk_finish(p, chunk), _FINISH_POINTERS))
        r.launches = launch.Sequence(steps, _NPOINTERS, route=options.launch, pdl=launch.pdl_allowed(device, options))
        return r

    @staticmethod
    def _qk_finish(p: Problem, chunk: int) -> "launch.Launcher":
        """paged_general_finish in its one-split form: output_qk's entries outside each row's admitted range (zeros)
        and, under qk_output=2, probabilities from the lse the decode kernel wrote."""
        a = p.attrs
        return launch.Launcher(
            jit.get_kernel(registry.general_finish_spec(p.dtype)), qk_finish_grid(p), (FINISH_WARPS * 32,),
            (POINTER,) * len(_FINISH_POINTERS) + (
                i32(p.token_count), i32(p.num_heads), i32(p.kv_num_heads), i32(p.head_size), i32(p.v_head_size),
                i32(p.batch_size), np.int64(p.static_kv_capacity), i32(chunk), i32(1),
                i32(p.rotary_max_pos if p.rotary_dim else 0), i32(a.local_window_size), i32(a.is_causal),
                i32(types.QUANT_CODE[p.v_quant]), i32(0), i32(0), i32(a.qk_output), i32(p.kv_capacity)))


def launch_pointers(r: "_Recipe", call, base: int) -> list:
    """The pointer list of a call's launches: the call's pointers, then the workspace's parts (at ``base``), the
    output, lse (the call's, or a workspace row under qk_output=2), output_qk and a null pointer."""
    lse = call.lse_ptr or (base + r.lse if r.lse >= 0 else 0)
    if r.split:
        return call.ptrs + [base, call.output_ptr, base + r.part_o, base + r.part_ml, base + r.counters, lse,
                            call.qk_ptr, 0]
    return call.ptrs + [base, call.output_ptr, 0, 0, 0, lse, call.qk_ptr, 0]


class _Recipe:
    """The launches of one problem on one device (prologue, then decode, whose last split CTA of each
    token merges the splits, then under output_qk the finish kernel) and the workspace layout: ``nbytes`` in
    all, Q first, then (``split``) the split partials and arrival counters at byte offsets ``part_o``,
    ``part_ml``, ``counters``, then (``lse`` >= 0) the rows' lse of a qk_output=2 call that does not return it."""

    __slots__ = ("launches", "split", "nbytes", "part_o", "part_ml", "counters", "lse")


# Pointer arguments, as positions in Call.ptrs extended by
# [q workspace, output, part_o, part_ml, counters, lse, output_qk, a null pointer].
_Q_WS, _OUT, _PART_O, _PART_ML, _COUNTERS, _LSE, _QK, _NULL = range(len(launch.PTR_INDEX), len(launch.PTR_INDEX) + 8)
_NPOINTERS = len(launch.PTR_INDEX) + 8
_I = launch.PTR_INDEX
_PROLOGUE_POINTERS = tuple(_I[n] for n in POINTER_INPUTS) + (_Q_WS, _COUNTERS)
# paged_decode / paged_decode_mma: q, key_cache, value_cache, cum, past, block_table, query_positions,
# head_sink, k_scale, v_scale, out, part_o, part_ml, counters, lse (0 unless the call asks for it)
_DECODE_POINTERS = (_Q_WS, _I["key_cache"], _I["value_cache"], _I["cumulative_sequence_length"],
                    _I["past_seqlens"], _I["block_table"], _I["query_positions"], _I["head_sink"], _I["k_scale"],
                    _I["v_scale"], _OUT, _PART_O, _PART_ML, _COUNTERS, _LSE)

# paged_general_finish in its one-split form: cum, past, query_positions, head_sink, v_scale, attention_bias (null),
# part_o and part_ml (null), out, output_qk, lse
_FINISH_POINTERS = (_I["cumulative_sequence_length"], _I["past_seqlens"], _I["query_positions"], _I["head_sink"],
                    _I["v_scale"], _NULL, _NULL, _NULL, _OUT, _QK, _LSE)


BACKEND = DecodeBackend()
