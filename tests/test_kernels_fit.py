"""Every kernel fits every GPU it is launched on: static plus dynamic shared memory within the device's
limit per CTA, for the variant each backend chooses there (contract: compute capability 8.0 and newer).

The specializations are compiled offline with NVRTC (no GPU): every registered one for sm_90 (static
shared memory and spills from ptxas), and the ones chosen on 99 KB GPUs for sm_86, whose static
shared memory must equal sm_90's (so the figure stands for sm_80/89/100/120 too, which the offline
check ``python -m cupa.compile --check --arch sm_80,sm_86,sm_89,sm_90,sm_100,sm_120`` confirms).
For each architecture, each backend's choice (prefill.tile_for, decode.mma_stages, the wgmma
prefill on 9.0 only) must fit, the Python mirrors of the static shared memory must bound ptxas's
figure, and no kernel may spill on sm_90 beyond the known cases listed in KNOWN_SPILLS.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from cupa import jit
from cupa.device import describe_capability
from cupa.kernels import decode, prefill, prefill_wgmma, prologue, registry, types

ARCHS = {"sm_80": (8, 0), "sm_86": (8, 6), "sm_89": (8, 9), "sm_90": (9, 0), "sm_100": (10, 0), "sm_120": (12, 0)}
#: The architecture whose ptxas figures stand for each one (static shared memory does not depend on it).
COMPILED_AS = {"sm_80": "sm_90", "sm_86": "sm_86", "sm_89": "sm_86", "sm_90": "sm_90", "sm_100": "sm_90",
               "sm_120": "sm_86"}
#: Spills on sm_90 known and accepted: the 8-bit head-major decode loop at D=128 under its 128-register cap
#: (4 CTAs per SM): 20 B of stores, 28 B of loads per thread, in its key loop; the int8 prologue (8 B, outside
#: any loop of the copy). Everything else must not spill.
KNOWN_SPILLS = {
    str(registry.decode_mma_spec(dt, kind, 128, stages)): None
    for dt in ("float16", "bfloat16") for kind in ("int8", "fp8") for stages in decode.MMA_STAGES
}
KNOWN_SPILLS.update({str(registry.prologue_spec(dt, "int8")): None for dt in types.ACT_CXX})
#: The packed 4-bit caches (none on the target loop, keys as M): the head-major decode loop at D=128 (4 B of stores,
#: 8 B of loads), the CUDA-core decode at 2 heads a CTA (8 B / 8 B, ptxas holds it at 96 registers) and the prologue of
#: a mixed pair or of float32 int4 (16 B / 12 B).
_PACKED = [(k, v) for k, v in types.KV_KINDS if k in types.PACKED_KINDS]
KNOWN_SPILLS.update({str(registry.decode_mma_spec(dt, k, 128, stages, v_cache_kind=v)): None
                     for dt in ("float16", "bfloat16") for k, v in _PACKED for stages in decode.MMA_STAGES})
KNOWN_SPILLS.update({str(registry.decode_spec(dt, k, 2, v)): None for dt in types.ACT_CXX for k, v in _PACKED})
KNOWN_SPILLS.update({str(registry.prologue_spec(dt, k, v_cache_kind=v)): None for dt in types.ACT_CXX
                     for k, v in _PACKED if k != v or (dt == "float32" and k == "int4")})
#: The mma.sync prefill of 16-bit caches at D=128, tile 128 x 64 (255 registers): one 4-byte spill pair in the
#: key loop (a reload and a store a tile).
KNOWN_SPILLS.update({str(registry.prefill_spec(dt, "T", 128, (128, 64))): None for dt in ("float16", "bfloat16")})


def nvrtc_or_skip():
    try:
        jit.nvrtc_version()
        jit.cuda_include_dirs()
    except Exception as exc:  # pragma: no cover - NVRTC or headers missing
        pytest.skip(f"NVRTC unavailable: {exc}")


def chosen(arch: str) -> list:
    """(spec, dynamic shared bytes) of every kernel a backend launches on a GPU of ``arch``."""
    device = describe_capability(*ARCHS[arch])
    out = []
    pairs = types.KV_KINDS
    for dt in types.ACT_CXX:
        for kind, v_kind in pairs:
            out.append((registry.prologue_spec(dt, kind, v_cache_kind=v_kind), (prologue.PROLOGUE_THREADS // 32) * 256 * 4))
            out.extend((registry.decode_spec(dt, kind, heads, v_kind), 0) for heads in types.HEAD_CHUNKS)
    for dt in prefill.PREFILL_DTYPES:
        out.append((registry.prologue_spec(dt, "T", token_loop=True), (prologue.BESIDE_THREADS // 32) * 256 * 4))
        for kind, v_kind in pairs:
            quantized, packed = kind != "T", kind in types.PACKED_KINDS
            for d in decode.MMA_HEAD_SIZES:
                stages = decode.mma_stages(d, quantized, device, 2, packed)
                assert stages is not None, (arch, d, kind)
                for keys_as_m in ((False, True) if quantized else (False,)):
                    out.append((registry.decode_mma_spec(dt, kind, d, stages, keys_as_m, v_kind),
                                decode.mma_shared_bytes(d, quantized, stages, packed)))
            for d in prefill.PREFILL_HEAD_SIZES:
                tile = prefill.tile_for(d, quantized, device, packed)
                assert tile is not None, (arch, d, kind)
                out.append((registry.prefill_spec(dt, kind, d, tile, v_kind),
                            prefill.shared_bytes(d, quantized, tile, packed)))
            for d in prefill.PREFILL_HEAD_SIZES:  # attention_bias; where none fits, the backend declines
                tile = prefill.tile_for(d, quantized, device, packed, bias=True)
                if tile is not None:
                    out.append((registry.prefill_spec(dt, kind, d, tile, v_kind, bias=True),
                                prefill.shared_bytes(d, quantized, tile, packed, bias=True)))
    if ARCHS[arch] == prefill_wgmma.CAPABILITY:
        for dt in prefill_wgmma.WGMMA_DTYPES:
            out.append((registry.prefill_wgmma_ws_spec(dt), prefill_wgmma.shared_bytes(SimpleNamespace(head_size=128))))
    return out


@pytest.fixture(scope="module")
def stats():
    """{(str(spec), compiled arch): OfflineResult} for every registered spec (sm_90 or its pinned arch) and
    the specs chosen on 99 KB GPUs (sm_86)."""
    nvrtc_or_skip()
    os.environ.setdefault("CUDA_CACHE_DISABLE", "1")
    tasks = [(s, s.arch or "sm_90") for s in registry.all_specializations()]
    tasks += [(s, "sm_86") for s, _ in chosen("sm_86") if not s.arch]
    tasks = list(dict.fromkeys(tasks))
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        results = list(pool.map(lambda t: jit.compile_offline(*t), tasks))
    out = {}
    for (spec, arch), r in zip(tasks, results):
        assert r.ok, f"{spec} for {arch}:\n{r.log[-3000:]}"
        assert r.has_stats, f"{spec} for {arch}: no ptxas statistics (set CUDA_CACHE_DISABLE=1)"
        out[(str(spec), "sm_90" if arch == "sm_90a" else arch)] = r
    return out


def test_every_choice_fits_its_gpu(stats):
    for arch in ARCHS:
        limit = describe_capability(*ARCHS[arch]).shared_per_block_optin
        for spec, dynamic in chosen(arch):
            r = stats[(str(spec), COMPILED_AS[arch])]
            assert r.shared_bytes + dynamic <= limit, (
                f"{spec} on {arch}: {r.shared_bytes} B static + {dynamic} B dynamic > {limit} B")


def test_static_shared_memory_is_the_same_on_sm_86_and_sm_90_and_within_the_mirrors(stats):
    for (text, arch), r in stats.items():
        if arch == "sm_86":
            assert r.shared_bytes == stats[(text, "sm_90")].shared_bytes, text
    for d, tiles in prefill.TILES.items():
        for tile in tiles:
            for dt in prefill.PREFILL_DTYPES:
                for kind in types.CACHE_CXX:
                    r = stats[(str(registry.prefill_spec(dt, kind, d, tile)), "sm_90")]
                    assert r.shared_bytes <= prefill.static_shared_bound(d, tile), (d, tile, kind, r.shared_bytes)
    for dt in ("float16", "bfloat16"):
        for d in decode.MMA_HEAD_SIZES:
            for stages in decode.MMA_STAGES:
                assert stats[(str(registry.decode_mma_spec(dt, "T", d, stages)), "sm_90")].shared_bytes == 0
    for dt in prefill_wgmma.WGMMA_DTYPES:
        r = stats[(str(registry.prefill_wgmma_ws_spec(dt)), "sm_90")]
        assert r.shared_bytes <= prefill_wgmma.STATIC_SHARED_BOUND


def test_no_spills_on_sm_90_but_the_known_ones(stats):
    spilled = {text for (text, arch), r in stats.items() if arch == "sm_90" and r.spills}
    assert spilled <= set(KNOWN_SPILLS), sorted(spilled - set(KNOWN_SPILLS))
    for text in spilled:
        r = stats[(text, "sm_90")]
        assert r.spill_store_bytes <= 32 and r.spill_load_bytes <= 32, r.summary()
