"""The MLA backend's planning without a GPU: eligibility, kernel choice per device, splits, grids, workspace.

Problems are derived from shapes alone (contract.validate on ArrayInfo), so DeepSeek-sized calls cost
nothing here; devices are cupa.device.describe_capability descriptions of every capability cupa claims.
"""

import math

import numpy as np
import pytest

import cupa
from cupa import contract, dispatch, jit
from cupa.contract import ArrayInfo
from cupa.device import describe_capability
from cupa.kernels import launch, mla, registry, tma
from cupa.options import _Tuning

H200 = describe_capability(9, 0)
A100 = describe_capability(8, 0)
L40 = describe_capability(8, 9)
DEFAULT = cupa.Options()
MLA = cupa.Options(backend="mla")


def latent_problem(*, N=64, B=64, H=128, L=4096, block_size=64, dtype="float16", cache="T", k_quant="PER_TENSOR",
                   max_blocks=None, metadata=None, D=576, Dv=512, rotary=False, **attrs):
    """The Problem of a LATENT call: B sequences of kv length L (N new tokens in all), shapes only."""
    max_blocks = max_blocks or -(-L // block_size)
    num_blocks = B * max_blocks + 1
    cdt = {"T": dtype, "fp8": "uint8", "int8": "int8"}[cache]
    infos = {"query": ArrayInfo((N, H * D), dtype), "key": ArrayInfo((N, D), dtype),
             "key_cache": ArrayInfo((num_blocks, block_size, 1, D), cdt),
             "cumulative_sequence_length": ArrayInfo((B + 1,), "int32"), "past_seqlens": ArrayInfo((B,), "int32"),
             "block_table": ArrayInfo((B, max_blocks), "int32")}
    kw = dict(num_heads=H, kv_num_heads=1, kv_cache_layout="LATENT", v_head_size=Dv, scale=0.1)
    if cache != "T":
        infos["k_scale"] = ArrayInfo((1,) if k_quant == "PER_TENSOR" else (1, 1, D), "float32")
        kw.update(k_quant_type=k_quant, k_cache_dtype="float8e4m3fn" if cache == "fp8" else "")
    if rotary:
        infos["cos_cache"] = infos["sin_cache"] = ArrayInfo((L + 8, 32), dtype)
        kw.update(do_rotary=1, rotary_offset=512)
    kw.update(attrs)
    return contract.validate(contract.Attributes(**kw), infos, metadata)


def test_mla_comes_before_decode_and_serves_latent_and_lse():
    names = [b.name for b in dispatch.cuda_backends()]
    assert names.index("mla") < names.index("decode")
    assert mla.BACKEND.serves == {"latent", "return_lse"} and mla.BACKEND.verified


def test_not_chosen_by_default_while_unverified_and_selectable_by_name(monkeypatch):
    monkeypatch.setattr(mla.BACKEND, "verified", False)
    p = latent_problem()
    assert dispatch.choose(p, H200, DEFAULT).name == "general"   # it serves every LATENT call, more slowly
    text = dispatch.account(p, H200, DEFAULT)
    assert "mla: not eligible: not yet verified on a GPU (select it with cupa.Options(backend='mla'))" in text, text
    for name in ("prefill_wgmma", "prefill", "decode"):
        assert f"{name}: not eligible: kv_cache_layout='LATENT' (absorbed MLA) is not served here (the mla backend " \
               "serves it)" in text, text
    assert dispatch.choose(p, H200, MLA).name == "mla"
    text = dispatch.account(p, H200, MLA)
    assert "mla: chosen (absorbed MLA (128 heads sharing one 576-channel latent row" in text, text
    assert "decode: not considered (options.backend='mla')" in text


def test_auto_picks_mla_once_verified(monkeypatch):
    monkeypatch.setattr(mla.BACKEND, "verified", True)
    assert dispatch.choose(latent_problem(), H200, DEFAULT).name == "mla"
    assert dispatch.choose(latent_problem(N=4 * 512, B=4), A100, DEFAULT).name == "mla"


@pytest.mark.parametrize("over,reason", [
    (dict(D=64, Dv=48), "head_size 64 / v_head_size 48: the MLA kernels take 576 / 512"),
    (dict(Dv=448), "head_size 576 / v_head_size 448"),
    (dict(dtype="float32"), "T=float32: the MLA kernels take float16 or bfloat16"),
    (dict(cache="int8"), "int8 latent cache: the MLA kernels take caches of T or float8e4m3fn"),
    (dict(qk_output=1), "output_qk (qk_output != 0) is not served here"),
])
def test_other_latent_shapes_keep_a_reason(over, reason):
    p = latent_problem(**over)
    reasons = mla.BACKEND.not_supported_reasons(p, H200, DEFAULT)
    assert any(reason in r for r in reasons), reasons
    with pytest.raises(cupa.PagedAttentionError, match="options.backend: 'mla' cannot serve this call"):
        dispatch.choose(p, H200, MLA)


def test_separate_calls_are_declined():
    infos = {"query": ArrayInfo((8, 8 * 128), "float16"), "key": ArrayInfo((8, 2 * 128), "float16"),
             "value": ArrayInfo((8, 2 * 128), "float16"), "key_cache": ArrayInfo((9, 16, 2, 128), "float16"),
             "value_cache": ArrayInfo((9, 16, 2, 128), "float16"),
             "cumulative_sequence_length": ArrayInfo((3,), "int32"), "past_seqlens": ArrayInfo((2,), "int32"),
             "block_table": ArrayInfo((2, 4), "int32")}
    p = contract.validate(contract.Attributes(num_heads=8, kv_num_heads=2), infos)
    assert mla.BACKEND.not_supported_reasons(p, H200, DEFAULT) == [
        "kv_cache_layout 'SEPARATE': the MLA backend serves kv_cache_layout='LATENT' (absorbed MLA)"]
    assert dispatch.choose(p, H200, DEFAULT).name != "mla"


@pytest.mark.parametrize("cc,H,N,B,cache,expect", [
    ((9, 0), 128, 64, 64, "T", ("wgmma", 64, 64)),      # Hopper, a 64-row tile
    ((9, 0), 128, 2048, 4, "T", ("wgmma", 64, 64)),     # chunked prefill
    ((9, 0), 16, 64, 64, "T", ("mma", 16, 64)),         # a decode step of 16 heads: 16-row tiles
    ((9, 0), 16, 256, 4, "T", ("wgmma", 64, 64)),       # 16 heads, prefill-shaped: 4 tokens a tile
    ((9, 0), 128, 64, 64, "fp8", ("mma", 64, 64)),      # fp8 latent: codes widened in shared memory
    ((9, 0), 16, 64, 64, "fp8", ("mma", 16, 64)),
    ((8, 0), 128, 64, 64, "T", ("mma", 64, 32)),        # A100: 163 KB
    ((8, 0), 16, 64, 64, "fp8", ("mma", 16, 32)),
    ((8, 6), 128, 64, 64, "T", ("mma", 16, 32)),        # 99 KB devices: 16-row tiles only
    ((8, 9), 128, 64, 64, "fp8", ("mma", 16, 32)),
    ((12, 0), 64, 64, 64, "T", ("mma", 16, 32)),
    ((10, 0), 128, 64, 64, "T", ("mma", 64, 64)),       # no sm_90a wgmma on Blackwell
])
def test_kernel_choice_per_device(cc, H, N, B, cache, expect):
    device = describe_capability(*cc)
    p = latent_problem(H=H, N=N, B=B, L=1024, cache=cache)
    k = mla.kernel_choice(p, device, DEFAULT)
    assert (k.path, k.rows, k.keys) == expect
    assert k.shared <= device.shared_per_block_optin
    assert mla.BACKEND.not_supported_reasons(p, device, DEFAULT) == []
    engine = "wgmma" if k.path == "wgmma" else "mma.sync"
    assert engine in mla.BACKEND.describe(p, device, DEFAULT)


def test_wgmma_off_through_tuning_runs_the_portable_kernel():
    p = latent_problem()
    k = mla.kernel_choice(p, H200, cupa.Options(_tuning=_Tuning(mla_wgmma=False)))
    assert (k.path, k.rows, k.keys) == ("mma", 64, 64)


def test_shared_memory_mirrors_the_kernels():
    """Byte sizes of MlaMmaSmem / MlaWgSmem (cuda_src/mla_mma.cu, mla_wgmma.cu), and which devices each fits."""
    assert mla.mma_shared_bytes(64, 64, False) == 73728 + 147456 + 8192 + 768 + 1024 + 1024 + 64 == 232256
    assert mla.mma_shared_bytes(64, 64, True) == 73728 + 73728 + 73728 + 8192 + 768 + 1024 + 1024 + 64
    assert mla.mma_shared_bytes(64, 32, False) == 157632 <= A100.shared_per_block_optin
    assert mla.mma_shared_bytes(16, 64, False) == 169280 > A100.shared_per_block_optin
    assert mla.mma_shared_bytes(16, 32, True) == 95040 <= L40.shared_per_block_optin == 101376
    assert mla.wgmma_shared_bytes() == 231080 + 1024 <= H200.shared_per_block_optin
    for rows, keys in mla.MMA_CONFIGS:
        for quantized in (False, True):
            assert mla.mma_shared_bytes(rows, keys, quantized) <= H200.shared_per_block_optin


@pytest.mark.parametrize("H,B,L,N,splits", [
    (128, 64, 4096, 64, 1),    # 128 tiles fill 132 SMs: no split (compute-bound)
    (128, 8, 8192, 8, 8),      # 16 tiles: up to 8 splits a tile -> 128 CTAs
    (16, 64, 4096, 64, 2),     # 64 tiles of 16 rows: 2 splits
    (128, 4, 4608, 2048, 1),   # chunked prefill: 4096 tiles
])
def test_split_plan_fills_one_wave(H, B, L, N, splits):
    p = latent_problem(H=H, B=B, L=L, N=N)
    plan = mla.launch_plan(p, H200, DEFAULT)
    assert plan["num_splits"] == plan["tile_splits"] == splits
    assert splits <= -(-p.static_kv_capacity // mla.MIN_CHUNK)
    k = plan["kernel"]
    assert plan["num_tiles"] == N * H // k.rows + B and plan["zero_ctas"] == math.ceil(N / k.threads)
    assert plan["grid"] == (plan["zero_ctas"] + plan["num_tiles"], splits)
    assert plan["merge_grid"] == ((plan["num_tiles"], k.rows // mla.MERGE_WARPS) if splits > 1 else None)
    if splits > 1:
        tiles = N * -(-H // k.rows)
        assert tiles * splits <= k.resident * H200.sm_count


def test_bounds_only_drop_trailing_splits():
    """SPEC 4.5: each tile's split comes from its own keys and tile_splits (static sizes); attention_metadata
    decides only how many splits launch, never fewer than a tile within the bound uses."""
    base = mla.launch_plan(latent_problem(H=128, B=8, L=8192, N=8), H200, DEFAULT)
    for bound, splits in ((8192, 8), (3000, 8), (1024, 4), (767, 2), (300, 1), (256, 1), (1, 1), (10**6, 8)):
        plan = mla.launch_plan(latent_problem(H=128, B=8, L=8192, N=8, metadata=[1, bound]), H200, DEFAULT)
        assert plan["tile_splits"] == base["tile_splits"] == 8 and plan["num_splits"] == splits
        for lo in (0, 1, 63, 64, 200):
            for hi in range(lo + 1, min(bound, 8192) + 1, 97):
                assert mla.tile_split(lo, hi, 8, splits) == mla.tile_split(lo, hi, 8, 8), (bound, lo, hi)


@pytest.mark.parametrize("tile_splits", [1, 2, 3, 8, 33])
def test_tile_split_covers_the_keys_in_aligned_chunks(tile_splits):
    """mla.tile_split (the mirror of mla_splits in cuda_src/mla.cuh): chunks of CHUNK_ALIGN multiples from lo
    rounded down, covering [lo, hi), none empty, at most tile_splits, at least MIN_CHUNK keys unless one."""
    assert mla.tile_split(5, 5, tile_splits, 8) == (0, mla.CHUNK_ALIGN, 1)  # no keys: split 0 writes the rows
    for lo in (0, 1, 64, 100, 4095):
        for span in (1, 63, 255, 256, 257, 1000, 4096, 8191, 100000):
            hi = lo + span
            base, chunk, count = mla.tile_split(lo, hi, tile_splits, 10**6)
            assert base == lo - lo % mla.CHUNK_ALIGN and chunk % mla.CHUNK_ALIGN == 0
            assert 1 <= count <= tile_splits
            assert base + (count - 1) * chunk < hi <= base + count * chunk  # covered, the last chunk not empty
            assert count == 1 or chunk >= mla.MIN_CHUNK
            assert count > 1 or tile_splits == 1 or hi - base < 2 * mla.MIN_CHUNK  # split where it can be
    assert mla.tile_split(0, 8192, 8, 3) == (0, 1024, 3)  # an undersized bound: the splits past it are dropped


def test_more_waves_through_tuning():
    p = latent_problem(H=128, B=8, L=8192, N=8)
    assert mla.launch_plan(p, H200, cupa.Options(_tuning=_Tuning(mla_waves=2)))["num_splits"] == 16


def test_workspace_layout():
    p = latent_problem(H=128, B=8, L=8192, N=8, rotary=True)
    plan = mla.launch_plan(p, H200, DEFAULT)
    lay = mla.workspace_layout(p, plan)
    rows = 8 * 128 * plan["num_splits"]
    assert lay["q"] == 0 and lay["part_o"] == 8 * 128 * 576 * 2  # the rotated Q rows first
    assert lay["part_ml"] == lay["part_o"] + rows * 512 * 4
    assert lay["records"] == lay["part_ml"] + rows * 8 and lay["records"] % 16 == 0
    assert p.token_count * lay["counters_per_token"] >= 4 * plan["num_tiles"]  # the prologue zeroes every record
    assert lay["nbytes"] == lay["records"] + launch.align(8 * lay["counters_per_token"] * 4)
    one = latent_problem(H=128, B=64, L=4096, N=64)  # no rotary (query read in place), one split: no workspace
    assert mla.workspace_layout(one, mla.launch_plan(one, H200, DEFAULT))["nbytes"] == 0


def test_tma_boxes(monkeypatch):
    monkeypatch.setattr(tma, "available", lambda: True)
    for block_size, box in ((64, 64), (128, 64), (16, 16), (8, 8), (24, 8), (4, 0), (1, 0)):
        assert mla.tma_box(latent_problem(block_size=block_size, L=512), DEFAULT) == box
    assert mla.tma_box(latent_problem(), cupa.Options(tma=False)) == 0
    assert "TMA in boxes of 64 rows" in mla.BACKEND.describe(latent_problem(), H200, MLA)
    monkeypatch.setattr(tma, "available", lambda: False)
    assert mla.tma_box(latent_problem(), DEFAULT) == 0
    assert "loads by cp.async gathers" in mla.BACKEND.describe(latent_problem(), H200, MLA)


def test_index_limits_keep_a_reason():
    p = latent_problem(N=1 << 24, B=1 << 24, H=128, L=64)
    assert any("rows exceed" in r for r in mla.BACKEND.not_supported_reasons(p, H200, DEFAULT))


def test_specializations_cover_every_kernel_choice():
    specs = set(mla.BACKEND.specializations())
    assert specs <= set(registry.all_specializations())
    for cc in ((8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0)):
        device = describe_capability(*cc)
        for dtype in mla.DTYPES:
            for cache in mla.CACHE_KINDS:
                for H, N, B in ((16, 8, 8), (128, 8, 8), (16, 64, 2)):
                    p = latent_problem(H=H, N=N, B=B, L=512, dtype=dtype, cache=cache)
                    assert mla.kernel_choice(p, device, DEFAULT).spec(p) in specs
                    assert registry.prologue_spec(dtype, p.cache_kind) in specs
    pinned = [s for s in specs if s.arch]
    assert sorted(s.name_expression for s in pinned) == [
        "paged_mla_wgmma<__half, CacheSame<__half>>", "paged_mla_wgmma<__nv_bfloat16, CacheSame<__nv_bfloat16>>"]


def test_kernels_compile_without_spills():
    """The wgmma kernel for sm_90a (NVRTC never serializes its wgmma: no C7520 'serialized' note) and one portable
    configuration for sm_80, offline, without spills (the whole matrix: python -m cupa.compile --check)."""
    try:
        jit.nvrtc_version()
    except Exception as exc:  # pragma: no cover - NVRTC missing
        pytest.skip(f"NVRTC unavailable: {exc}")
    cases = ((registry.mla_wgmma_spec("float16"), "sm_90a"), (registry.mla_mma_spec("bfloat16", "fp8", 16, 32), "sm_80"))
    for spec, arch in cases:
        r = jit.compile_offline(spec, arch)
        assert r.ok, r.log
        assert "serialized" not in r.log, r.log
        if r.has_stats:
            assert not r.spills and r.registers <= 255, r.summary()


def test_reference_runs_the_latent_builder(rng):
    """tests/util.build_latent on the NumPy reference: the shapes the GPU tests use, lse included."""
    from tests import util

    inputs, attrs = util.build_latent(rng, B=3, H=16, q_lens=[1, 3, 0], past=[5, 70, 9], rotary=True, cache="fp8",
                                    return_lse=True)
    out, lse = cupa.paged_attention(**inputs, **attrs)
    assert out.shape == (4, 16 * 512) and lse.shape == (4, 16) and np.isfinite(lse).all()
