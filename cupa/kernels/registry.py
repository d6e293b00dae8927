"""The name of every kernel specialization, and the list of all of them for the offline compile check.

Each backend lists the specializations it can launch (``BACKEND.specializations()``);
:func:`all_specializations` collects them, so ``python -m cupa.compile --check`` compiles exactly
what can run. Head size, GQA group and block size are run-time
parameters of the CUDA-core decode kernel; T, the cache type and the head chunk are template values.
The tensor-core decode kernel is specialized on T, the cache type, the head size, its pipeline depth
and its loop (keys as the MMA's M dimension or not); the prefill kernel on T, the cache type, the head
size and its tile (query rows x keys). The wgmma prefill (sm_90a only) is pinned to its arch:
``Specialization.arch``. The merge of attention states (cuda_src/states.cu) is specialized on T,
the sink's type and the vector width.
"""

from __future__ import annotations

from ..jit import Specialization
from . import types


def prologue_spec(dtype: str, cache_kind: str, token_loop: bool = False, v_cache_kind: str = None) -> Specialization:
    """The fused prologue; ``token_loop``: the 512-thread variant that runs beside the prefill kernel
    (prologue.py beside_launcher), each warp copying several tokens' plain K/V rows; ``v_cache_kind``:
    value_cache's kind where it differs from key_cache's (two packed 4-bit kinds)."""
    v = types.v_cache_arg(cache_kind, v_cache_kind, dtype)
    args = f"{types.act(dtype)}, {types.cache(cache_kind, dtype)}" + (", true" if token_loop else (", false" if v else ""))
    return Specialization("prologue", f"paged_prologue<{args}{v}>")


def decode_spec(dtype: str, cache_kind: str, head_chunk: int, v_cache_kind: str = None) -> Specialization:
    return Specialization("decode", f"paged_decode<{types.act(dtype)}, {types.cache(cache_kind, dtype)}, {head_chunk}"
                                    f"{types.v_cache_arg(cache_kind, v_cache_kind, dtype)}>")


def decode_mma_spec(dtype: str, cache_kind: str, head_size: int, stages: int, keys_as_m: bool = False,
                    v_cache_kind: str = None, qk: bool = False) -> Specialization:
    """``stages``: the K/V pipeline depth (STAGES in decode_mma.cu); ``keys_as_m``: the quantized caches' loop with
    keys as the MMA's M dimension (GQA groups of <= 8 heads); ``qk``: the instance that also writes output_qk's
    scores (head-major loop only)."""
    if qk and keys_as_m:
        raise ValueError("decode_mma_spec: the output_qk instances use the head-major loop (keys_as_m=False)")
    v_arg = types.v_cache_arg(cache_kind, v_cache_kind, dtype)
    if qk:  # VCache spelled out before the trailing QK argument
        v_arg = f", {types.cache(v_cache_kind or cache_kind, dtype)}, true"
    return Specialization(
        "decode_mma", f"paged_decode_mma<{types.act(dtype)}, {types.cache(cache_kind, dtype)}, {head_size}, "
                      f"{stages}, {'true' if keys_as_m else 'false'}{v_arg}>")


def prefill_spec(dtype: str, cache_kind: str, head_size: int, tile: tuple, v_cache_kind: str = None,
                 bias: bool = False) -> Specialization:
    """``tile``: (query rows, keys) of a CTA's tile (PrefillConfig in prefill.cu); ``bias``: the instance that
    adds attention_bias (its VCache always spelled out)."""
    rows, keys = tile
    v_arg = types.v_cache_arg(cache_kind, v_cache_kind, dtype)
    if bias:
        v_arg = f", {types.cache(v_cache_kind or cache_kind, dtype)}, true"
    return Specialization(
        "prefill", f"paged_prefill<{types.act(dtype)}, {types.cache(cache_kind, dtype)}, {head_size}, {rows}, {keys}"
                   f"{v_arg}>")


def prefill_wgmma_ws_spec(dtype: str, head_size: int = 128, cache_kind: str = "T",
                          copier_clean: bool = False) -> Specialization:
    """The warp-specialized persistent wgmma prefill (producer warpgroup + two consumer warpgroups, setmaxnreg;
    caches of T, int8 or fp8 codes), pinned to sm_90a: compiled offline and loaded as a cubin. ``copier_clean``
    (T caches): the copier warps clean the V tiles with keys to clean (``_Tuning.prefill_ws_copier_clean``)."""
    extra = ", true" if copier_clean else ""
    return Specialization(
        "prefill_wgmma_ws",
        f"paged_prefill_wgmma_ws<{types.act(dtype)}, {types.cache(cache_kind, dtype)}, {head_size}{extra}>",
        arch="sm_90a")


def general_mma_spec(dtype: str, cache_kind: str, head_size: int, q_split: bool = False) -> Specialization:
    """The general backend's tensor-core kernel (attention_bias, output_qk, lse; cuda_src/general_mma.cu);
    ``q_split``: Q x a per-channel K scale as two T values (quantized caches)."""
    extra = ", true" if q_split else ""
    return Specialization(
        "general_mma", f"paged_general_mma<{types.act(dtype)}, {types.cache(cache_kind, dtype)}, {head_size}{extra}>")


def general_simt_spec(dtype: str, cache_kind: str, head_chunk: int, chunks_per_lane: int) -> Specialization:
    """The general backend's CUDA-core kernel: ``head_chunk`` query heads a CTA, ``chunks_per_lane`` 8-channel
    chunks a lane (head_size <= 256 * chunks_per_lane; cuda_src/general_simt.cu)."""
    return Specialization(
        "general_simt",
        f"paged_general_simt<{types.act(dtype)}, {types.cache(cache_kind, dtype)}, {head_chunk}, {chunks_per_lane}>")


def general_finish_spec(dtype: str) -> Specialization:
    """The general backend's split merge and output_qk pass (cuda_src/general_finish.cu)."""
    return Specialization("general_finish", f"paged_general_finish<{types.act(dtype)}>")


def merge_states_spec(dtype: str, sink_dtype: str, vec: int) -> Specialization:
    """The merge of attention states (cupa.merge_states); ``vec``: channels per lane access (8 or 1)."""
    return Specialization("states", f"merge_states<{types.act(dtype)}, {types.act(sink_dtype)}, {vec}>")


def cascade_inputs_spec() -> Specialization:
    """The index arrays of a cascade step (cupa.CascadeAttention)."""
    return Specialization("states", "cascade_inputs")


def all_specializations() -> list:
    """Every specialization cupa can launch (each backend lists its own, then the attention-state
    kernels of :mod:`cupa.kernels.states`), without repeats."""
    from .. import dispatch
    from . import states

    specs = []
    for backend in dispatch.cuda_backends():
        specs.extend(backend.specializations())
    specs.extend(states.specializations())
    return list(dict.fromkeys(specs))


def mla_mma_spec(dtype: str, cache_kind: str, rows: int, keys: int) -> Specialization:
    """The portable absorbed-MLA kernel (mma.sync): ``rows`` (16, 64) per tile, ``keys`` (32, 64) per key tile."""
    return Specialization(
        "mla_mma", f"paged_mla_mma<{types.act(dtype)}, {types.cache(cache_kind, dtype)}, {rows}, {keys}>")


def mla_merge_spec(dtype: str) -> Specialization:
    """The split merge of the MLA kernels (cuda_src/mla_merge.cu)."""
    return Specialization("mla_merge", f"paged_mla_merge<{types.act(dtype)}>")


def mla_wgmma_spec(dtype: str) -> Specialization:
    """The Hopper absorbed-MLA kernel (wgmma, T caches), pinned to sm_90a."""
    return Specialization("mla_wgmma", f"paged_mla_wgmma<{types.act(dtype)}, {types.cache('T', dtype)}>",
                          arch="sm_90a")
