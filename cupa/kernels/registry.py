"""The explicit, small set of kernel specializations, and the CUDA backends in priority order.

Every specialization the dispatcher can ask for is listed here, so ``python -m cupa.compile
--check`` compiles exactly what can run. Head size, GQA group and block size are run-time
parameters of the decode kernel; T, the cache type and the head chunk are template values.
The prefill kernel is specialized on T, the cache type and the head size (its tile shape). The
wgmma prefill (sm_90a only) is pinned to its arch: ``Specialization.arch``.
"""

from __future__ import annotations

from ..jit import Specialization
from . import types


def prologue_spec(dtype: str, cache_kind: str, token_loop: bool = False) -> Specialization:
    """The fused prologue; ``token_loop``: the 512-thread variant that runs beside the prefill kernel
    (prologue.py beside_launcher), each warp copying several tokens' plain K/V rows."""
    args = f"{types.act(dtype)}, {types.cache(cache_kind, dtype)}" + (", true" if token_loop else "")
    return Specialization("prologue", f"paged_prologue<{args}>")


def decode_spec(dtype: str, cache_kind: str, head_chunk: int) -> Specialization:
    return Specialization("decode", f"paged_decode<{types.act(dtype)}, {types.cache(cache_kind, dtype)}, {head_chunk}>")


def decode_mma_spec(dtype: str, cache_kind: str, head_size: int, keys_as_m: bool = False,
                    stages: int = 3) -> Specialization:
    """``keys_as_m``: the 8-bit caches' loop with keys as the MMA's M dimension (GQA groups of <= 8 heads);
    ``stages``: the K/V pipeline depth (3, or 2 where shared memory is short: decode.py chooses)."""
    return Specialization(
        "decode_mma", f"paged_decode_mma<{types.act(dtype)}, {types.cache(cache_kind, dtype)}, {head_size}, "
                      f"{stages}, {'true' if keys_as_m else 'false'}>")


#: head_size -> the (rows, keys) tiles of paged_prefill (PrefillConfig in prefill.cu), the default first; the
#: others are compact tiles for GPUs with less shared memory per CTA or SM (prefill.py chooses).
PREFILL_TILES = {64: ((128, 64),), 128: ((128, 64), (128, 32)), 256: ((128, 32), (64, 32))}


def prefill_spec(dtype: str, cache_kind: str, head_size: int, tile: tuple = None) -> Specialization:
    """``tile``: (query rows, keys) of a CTA's tile, one of :data:`PREFILL_TILES` (default: the first)."""
    rows, keys = tile or PREFILL_TILES[head_size][0]
    return Specialization(
        "prefill", f"paged_prefill<{types.act(dtype)}, {types.cache(cache_kind, dtype)}, {head_size}, {rows}, {keys}>")


def prefill_wgmma_ws_spec(dtype: str, head_size: int = 128) -> Specialization:
    """The warp-specialized persistent wgmma prefill (producer warpgroup + two consumer warpgroups, setmaxnreg;
    T caches only), pinned to sm_90a: compiled offline and loaded as a cubin."""
    return Specialization(
        "prefill_wgmma_ws", f"paged_prefill_wgmma_ws<{types.act(dtype)}, {types.cache('T', dtype)}, {head_size}>",
        arch="sm_90a")


def all_specializations() -> list:
    specs = []
    for dtype in types.ACT_CXX:
        for kind in types.CACHE_CXX:
            specs.append(prologue_spec(dtype, kind))
            specs.extend(decode_spec(dtype, kind, gt) for gt in types.HEAD_CHUNKS)
    from .decode import MMA_HEAD_SIZES
    MMA_STAGES = (3, 2)  # decode.py picks the deepest that fits the device (STAGES in decode_mma.cu)

    for dtype in ("float16", "bfloat16"):
        for kind in types.CACHE_CXX:
            for stages in MMA_STAGES:
                specs.extend(decode_mma_spec(dtype, kind, d, stages=stages) for d in MMA_HEAD_SIZES)
                if kind != "T":
                    specs.extend(decode_mma_spec(dtype, kind, d, keys_as_m=True, stages=stages) for d in MMA_HEAD_SIZES)
    from .prefill import PREFILL_DTYPES, PREFILL_HEAD_SIZES

    for dtype in PREFILL_DTYPES:
        specs.append(prologue_spec(dtype, "T", token_loop=True))
        for kind in types.CACHE_CXX:
            specs.extend(prefill_spec(dtype, kind, d, tile) for d in PREFILL_HEAD_SIZES for tile in PREFILL_TILES[d])
    from .prefill_wgmma import WGMMA_DTYPES, WGMMA_HEAD_SIZES

    specs.extend(prefill_wgmma_ws_spec(dtype, d) for dtype in WGMMA_DTYPES for d in WGMMA_HEAD_SIZES)
    return specs


def backends() -> list:
    """CUDA backends in priority order: the first that supports and prefers a call runs it."""
    from .decode import BACKEND as decode
    from .prefill import BACKEND as prefill
    from .prefill_wgmma import BACKEND as prefill_wgmma

    # prefill_wgmma serves fp16/bf16 calls with T caches and head_size 128 on a compute-capability-9.0
    # device (unless CUPA_PREFILL_WGMMA=0); whatever it declines goes to the mma.sync prefill.
    return [prefill_wgmma, prefill, decode]
