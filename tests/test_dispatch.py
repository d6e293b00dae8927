"""Backend choice without a GPU: a pure function of the Problem, the device description and the Options.

The device is a :func:`cupa.device.describe_capability` description, so every rule is checked for every
compute capability cupa claims, on a machine without one.
"""

import numpy as np
import pytest

import cupa
from cupa import compile as cupa_compile
from cupa import dispatch, jit
from cupa.device import describe_capability
from cupa.kernels import prefill, prefill_wgmma, prologue, registry, tma
from cupa.options import _Tuning
from tests import util

H200 = describe_capability(9, 0)
DEFAULT = cupa.Options()


def problem_of(rng, metadata=None, **kw):
    args = dict(q_lens=[40, 30], past=[10, 0], H=8, Hk=2, D=128)
    args.update(kw)
    inputs, attrs = util.build(rng, **args)
    if metadata is not None:
        inputs["attention_metadata"] = np.array(metadata, dtype=np.int32)
    op = cupa.PagedAttention(**attrs)
    return op._problem(op._bind((), inputs))


def chosen(rng, device=H200, options=DEFAULT, **kw) -> str:
    return dispatch.choose(problem_of(rng, **kw), device, options).name


def account(rng, device=H200, options=DEFAULT, **kw) -> str:
    return dispatch.account(problem_of(rng, **kw), device, options)


def test_priority_order():
    names = [b.name for b in dispatch.cuda_backends()]
    assert names.index("prefill_wgmma") < names.index("prefill") < names.index("decode")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_wgmma_prefill_for_the_covered_case(rng, dtype):
    assert chosen(rng, dtype=dtype) == "prefill_wgmma"
    text = account(rng, dtype=dtype)
    assert "prefill_wgmma: chosen" in text and "wgmma" in text and "prefill: eligible but not preferred" in text, text
    assert text.startswith("device: ") and "options: Options()" in text


def test_named_backend_through_options(rng):
    assert chosen(rng, options=cupa.Options(backend="prefill")) == "prefill"
    assert chosen(rng, options=cupa.Options(backend="decode")) == "decode"
    text = account(rng, options=cupa.Options(backend="prefill"))
    assert "prefill: chosen" in text and "prefill_wgmma: not considered (options.backend='prefill')" in text
    with pytest.raises(cupa.PagedAttentionError, match="options.backend: 'prefill_wgmma' cannot serve this call: "
                                                       ".*needs compute capability 9.0"):
        chosen(rng, device=describe_capability(8, 0), options=cupa.Options(backend="prefill_wgmma"))
    with pytest.raises(cupa.PagedAttentionError, match="options.backend: got 'reference'"):
        chosen(rng, options=cupa.Options(backend="reference"))


@pytest.mark.parametrize("cc", [(8, 0), (8, 6), (8, 9), (10, 0), (12, 0)])
def test_wgmma_prefill_not_on_other_devices(rng, cc):
    device = describe_capability(*cc)
    assert chosen(rng, device=device) == "prefill"
    assert "needs compute capability 9.0" in account(rng, device=device)


@pytest.mark.parametrize("D", [64, 256])
def test_wgmma_prefill_not_for_other_head_sizes(rng, D):
    assert chosen(rng, D=D) == "prefill"
    assert f"head_size {D}" in account(rng, D=D)


@pytest.mark.parametrize("cache", ["int8", "fp8"])
@pytest.mark.parametrize("quant", ["PER_TENSOR", "PER_CHANNEL"])
def test_wgmma_prefill_for_8bit_caches(rng, monkeypatch, cache, quant):
    """8-bit caches: served (their codes widened in shared memory by the copier warps); while marked
    unverified, auto keeps them on the mma.sync prefill and explain() says why, and
    Options(backend="prefill_wgmma") runs them."""
    kw = dict(cache=cache, k_quant=quant, v_quant=quant)
    monkeypatch.setattr(prefill_wgmma.BACKEND, "unverified", frozenset({"cache8"}))
    assert chosen(rng, **kw) == "prefill"
    text = account(rng, **kw)
    assert "prefill_wgmma: not eligible: caches of 8-bit codes (int8, fp8): not yet verified on a GPU" in text, text
    named = cupa.Options(backend="prefill_wgmma")
    assert chosen(rng, options=named, **kw) == "prefill_wgmma"
    assert "not yet verified on a GPU" in account(rng, options=named, **kw)
    monkeypatch.setattr(prefill_wgmma.BACKEND, "unverified", frozenset())
    assert chosen(rng, **kw) == "prefill_wgmma"
    assert f"{cache} codes widened to float16 in shared memory by the copier warps" in account(rng, **kw)
    spec = prefill_wgmma.BACKEND._spec(problem_of(rng, **kw), H200, DEFAULT)
    assert spec in prefill_wgmma.BACKEND.specializations()
    assert registry.types.cache(cache, "float16") in spec.name_expression


def test_wgmma_prefill_copier_clean_variant(rng):
    """Options._tuning.prefill_ws_copier_clean selects the instance whose copier warps clean V tiles (T caches;
    8-bit caches are cleaned by the copiers in any case), and explain() says so."""
    tuned = cupa.Options(_tuning=_Tuning(prefill_ws_copier_clean=True))
    p = problem_of(rng)
    spec = prefill_wgmma.BACKEND._spec(p, H200, tuned)
    assert spec.name_expression.endswith(", 128, true>") and spec in prefill_wgmma.BACKEND.specializations()
    assert prefill_wgmma.BACKEND._spec(p, H200, DEFAULT).name_expression.endswith(", 128>")
    assert "cleaned by the copier warps" in account(rng, options=tuned)
    assert "cleaned by the copier warps" not in account(rng)
    codes = problem_of(rng, cache="fp8")
    assert prefill_wgmma.BACKEND._spec(codes, H200, tuned) == prefill_wgmma.BACKEND._spec(codes, H200, DEFAULT)
    with pytest.raises(cupa.PagedAttentionError, match="prefill_ws_copier_clean"):
        _Tuning(prefill_ws_copier_clean=1)


@pytest.mark.parametrize("cache,v_cache", [("int4", None), ("fp4", None), ("int4", "fp4")])
def test_wgmma_prefill_not_for_packed_caches(rng, cache, v_cache):
    kw = dict(cache=cache, v_cache=v_cache, packed=True)
    assert chosen(rng, **kw) == "prefill"
    assert "the wgmma prefill takes two caches of T, int8 or fp8 (one kind)" in account(rng, **kw)


def test_tensor_maps_of_8bit_codes():
    """A cache of 8-bit codes is mapped with 128-byte boxes of 128 codes (one slab row per cache row)."""
    assert tma.map_args(4096 * 16, 8, 128, 16, 1) == ((128, 8, 65536), (128, 1024), (128, 1, 16))
    with pytest.raises(ValueError):
        tma.map_args(100, 1, 64, 16, 1)  # (less than one 128-byte row)
    with pytest.raises(ValueError):
        tma.map_args(100, 1, 128, 16, 4)


def test_float32_and_decode_shaped_calls_go_to_decode(rng):
    assert chosen(rng, dtype="float32") == "decode"
    assert chosen(rng, q_lens=[1, 1]) == "decode"  # token_count <= batch_size: decode-shaped


def test_decode_shaped_calls_with_wide_groups_go_to_the_prefill_kernels(rng):
    """A heads-form cascade prefix: one token a sequence, 256 query heads a KV head (64 tokens x 4), 8
    sequences (key splits) x 8 KV heads -- row tiles that fill the device go to the tensor-core prefill."""
    wide = dict(q_lens=[1] * 8, past=[1023] * 8, H=2048, Hk=8, D=128)
    assert chosen(rng, **wide) == "prefill_wgmma"
    assert chosen(rng, device=describe_capability(8, 0), **wide) == "prefill"
    assert chosen(rng, **dict(wide, q_lens=[1], past=[1023])) == "decode"        # 1 sequence: too few tiles
    assert chosen(rng, **dict(wide, H=8 * 63)) == "decode"                         # groups narrower than 64


def test_features_no_fused_backend_serves_are_said_once(rng):
    inputs, _ = util.build(rng, q_lens=[40, 30], past=[10, 0], H=8, Hk=2, D=128)
    op = cupa.PagedAttention(num_heads=8, kv_num_heads=2, qk_output=1)
    problem = op._problem(op._bind((), inputs))
    assert dispatch.choose(problem, H200, DEFAULT).name == "general"
    lines = dispatch.account(problem, H200, DEFAULT).splitlines()
    reason = "output_qk (qk_output != 0) is not served here (the decode and general backends serve it)"
    declining = [b for b in dispatch.cuda_backends() if "output_qk" not in b.serves]
    said = [line for line in lines if f"not eligible: {reason}" in line]
    assert len(said) == len(declining) > 0
    assert sum(reason in line for line in lines) == len(declining)


def test_every_cuda_backend_serves_return_lse(rng):
    for q_lens, past in (([40, 30], [10, 0]), ([1, 1, 1], [100, 7, 3000])):
        inputs, _ = util.build(rng, q_lens=q_lens, past=past, H=8, Hk=2, D=128)
        with_lse = cupa.PagedAttention(num_heads=8, kv_num_heads=2, return_lse=True)
        plain = cupa.PagedAttention(num_heads=8, kv_num_heads=2)
        problem = with_lse._problem(with_lse._bind((), inputs))
        assert (dispatch.choose(problem, H200, DEFAULT).name
                == dispatch.choose(plain._problem(plain._bind((), inputs)), H200, DEFAULT).name)
    for backend in dispatch.cuda_backends():
        assert "return_lse" in backend.serves, backend.name


def test_unverified_backends_are_never_chosen_by_default(rng, monkeypatch):
    from cupa.kernels import prefill_wgmma as module

    monkeypatch.setattr(module.BACKEND, "verified", False, raising=False)
    try:
        assert chosen(rng) == "prefill"
        assert "prefill_wgmma: not eligible: not yet verified on a GPU (select it with " \
               "cupa.Options(backend='prefill_wgmma'))" in account(rng)
        assert chosen(rng, options=cupa.Options(backend="prefill_wgmma")) == "prefill_wgmma"
    finally:
        monkeypatch.undo()


def test_wgmma_launch_plan_and_shared_memory(rng):
    """One persistent CTA per SM (fewer when there are fewer work items, or under _tuning.prefill_ws_ctas)
    after the zero-pass CTAs of 512 threads; 2 Q buffers + 2 stages of 128-key K and V tiles."""
    p = problem_of(rng, [40, 80])
    items = ((40 + 30) * 4 // 128 + 2) * 2
    plan = prefill_wgmma.launch_plan(p, 132)
    assert plan["items"] == items and plan["persistent"] == min(items, 132) and plan["zero_ctas"] == 1
    assert plan["grid"] == plan["zero_ctas"] + plan["persistent"] and plan["threads"] == 512
    assert prefill_wgmma.launch_plan(p, 3)["persistent"] == 3
    assert prefill_wgmma.launch_plan(p, None)["persistent"] == items
    assert prefill_wgmma.shared_bytes(p) == 2 * 128 * 128 * 2 + 2 * 2 * 128 * 128 * 2 + 1024
    assert prefill_wgmma.persistent_ctas(H200, cupa.Options(_tuning=_Tuning(prefill_ws_ctas=7))) == 7
    assert prefill_wgmma.persistent_ctas(H200, cupa.Options(_tuning=_Tuning(prefill_ws_ctas=500))) == 132
    assert prefill_wgmma.persistent_ctas(H200, DEFAULT) == 132


def test_wgmma_row_tiles_under_a_query_bound(rng):
    """max_query_len_bound drops the row tiles that would be empty (contract §4.5): one token of a
    256-head group per sequence is 2 tiles a sequence in the bounded numbering (8 items a KV head here),
    not the 12 of paged_prefill's numbering; where that numbering is as small, it stays. The choice
    between the prefill backends sees the static count either way."""
    kw = dict(q_lens=[1] * 4, past=[300] * 4, H=512, Hk=2, D=128)
    loose, tight = problem_of(rng, **kw), problem_of(rng, metadata=[1, 512], **kw)
    plan = prefill_wgmma.launch_plan(loose, 132)
    assert plan["num_tiles"] == plan["static_tiles"] == 4 * 256 // 128 + 4 and plan["tiles_per_seq"] == 0
    plan = prefill_wgmma.launch_plan(tight, 132)
    assert (plan["num_tiles"], plan["tiles_per_seq"], plan["static_tiles"]) == (8, 2, 12)
    assert plan["items"] == 16 and plan["persistent"] == 16
    assert prefill_wgmma.BACKEND._tail_args(tight, DEFAULT)[-1] == 2
    assert prefill_wgmma.BACKEND._tail_args(loose, DEFAULT)[-1] == 0
    assert "at most 2 a sequence" in prefill_wgmma.BACKEND.describe(tight, H200, DEFAULT)
    assert prefill_wgmma.BACKEND.preferred(tight, H200, DEFAULT) == prefill_wgmma.BACKEND.preferred(loose, H200, DEFAULT)
    p = problem_of(rng, metadata=[40, 0])           # 2 sequences of up to 160 rows: 2 x 2 >= (70 * 4) // 128 + 2
    plan = prefill_wgmma.launch_plan(p, 132)
    assert (plan["num_tiles"], plan["tiles_per_seq"]) == ((70 * 4) // 128 + 2, 0)
    # 4 x 2048 tokens of GQA 4: 256 bounded tiles against 260 -- too few dropped to renumber
    p = problem_of(rng, metadata=[2048, 2048], q_lens=[2048] * 4, past=[0] * 4, H=8, Hk=2)
    assert prefill_wgmma.launch_plan(p, 132)["tiles_per_seq"] == 0


def test_pinned_specializations_and_compile_tasks():
    pinned = [s for s in registry.all_specializations() if s.arch]
    assert len(pinned) == 10 and all(s.arch == "sm_90a" for s in pinned)
    # (the wgmma prefill: fp16 / bf16 x caches of T, int8, fp8, and T with the copiers' clean)
    assert sorted(s.family for s in pinned) == ["mla_wgmma"] * 2 + ["prefill_wgmma_ws"] * 8
    assert "@sm_90a" in str(pinned[0])
    portable = jit.Specialization("decode", "k")
    tasks = cupa_compile.compile_tasks([portable] + pinned, ["sm_80", "sm_90"])
    assert tasks == [(portable, "sm_80"), (portable, "sm_90")] + [(s, "sm_90a") for s in pinned]
    assert cupa_compile.compile_tasks(pinned, ["sm_80"]) == []
    assert cupa_compile.compile_tasks(pinned, ["sm_90", "sm_90a"]) == [(s, "sm_90a") for s in pinned]
    with pytest.raises(ValueError, match="arch"):
        jit.Specialization("decode", "k", arch="sm_90")


def test_pinned_cache_key_follows_options_and_source():
    try:
        jit.nvrtc_version()   # (part of the key)
    except Exception as exc:  # no CuPy or no libnvrtc
        pytest.skip(f"NVRTC unavailable: {exc}")
    a = registry.prefill_wgmma_ws_spec("float16")
    b = jit.Specialization(a.family, a.name_expression, ("-DCUPA_TEST_ONLY=1",), arch=a.arch)
    assert jit.pinned_cache_key(a) == jit.pinned_cache_key(a) != jit.pinned_cache_key(b)
    assert jit.pinned_cache_key(a) != jit.pinned_cache_key(registry.prefill_wgmma_ws_spec("bfloat16"))


def test_wgmma_kernel_compiles_for_sm_90a_without_spills():
    """NVRTC never serializes the wgmma pipeline (C7520 / C7512 / C7514), keeps setmaxnreg (no C7508
    'ignored': 64 registers for the copier, 48 for the scheduler,
    200 for the consumers) and spills nothing, for every cache kind."""
    try:
        jit.nvrtc_version()
    except Exception as exc:  # pragma: no cover - NVRTC missing
        pytest.skip(f"NVRTC unavailable: {exc}")
    for dtype, cache in ((d, c) for d in prefill_wgmma.WGMMA_DTYPES for c in prefill_wgmma.WGMMA_CACHES):
        r = jit.compile_offline(registry.prefill_wgmma_ws_spec(dtype, 128, cache), "sm_90a", keep_cubin=True)
        assert r.ok, r.log
        assert r.cubin and r.lowered_name.startswith("_Z22paged_prefill_wgmma_ws")
        assert "setmaxnreg" not in r.log and "serialized" not in r.log, r.log
        if r.has_stats:
            assert r.registers <= 128 and not r.spills, r.summary()


def test_new_keys_from_inputs_only_where_the_prologue_copies_rows_unchanged(rng):
    """prefill.kv_from_inputs: the attention kernels read new K/V from key/value only when the prologue
    stores them unchanged at positions past + j (unpacked, T cache, no rotary, no QK-norm, derived slots,
    no query_positions); Options(new_kv_from_inputs=False) turns it off. explain() says which."""
    p = problem_of(rng)
    assert prefill.kv_from_inputs(p, DEFAULT)
    assert "new K/V read from key/value" in prefill.prologue_phrase(p, H200, DEFAULT)
    slots = util.derived_slots(util.build(rng, q_lens=[40, 30], past=[10, 0], H=8, Hk=2, D=128)[0], 16)
    for kw in (dict(packed=True), dict(rotary=True), dict(qk_norm=True), dict(cache="int8"), dict(cache="fp8"),
               dict(slot_mapping=slots), dict(query_positions=True)):
        problem = problem_of(rng, **kw)
        assert not prefill.kv_from_inputs(problem, DEFAULT), kw
        assert prefill.prologue_phrase(problem, H200, DEFAULT) == "fused prologue first", kw
    assert not prefill.kv_from_inputs(p, cupa.Options(new_kv_from_inputs=False))


def test_prologue_beside_only_without_a_past_by_the_bounds(rng, monkeypatch):
    """prefill.prologue_beside: the 512-thread prologue on SMs of its own only under kv_from_inputs, with
    attention_metadata bounding kv lengths by the longest new-token run, enough tokens and programmatic
    launch; its launch then has _tuning.prologue_beside_sms CTAs of 512 threads (the token-loop
    specialization)."""
    from cupa.kernels import launch

    monkeypatch.setattr(launch.driver, "launch_kernel_ex", lambda: object())

    def problem(q_lens, past, md=None, **kw):
        inputs, attrs = util.build(rng, q_lens=q_lens, past=past, H=4, Hk=2, D=64, **kw)
        op = cupa.PagedAttention(**attrs)
        return op._problem(op._bind((), dict(inputs, attention_metadata=md)))

    big = [1100, 0, 1000]
    no_past = np.array([1100, 1100], dtype=np.int32)
    assert prefill.prologue_beside(problem(big, [0, 0, 0], no_past), H200, DEFAULT)
    assert "SMs of its own" in prefill.prologue_phrase(problem(big, [0, 0, 0], no_past), H200, DEFAULT)
    assert not prefill.prologue_beside(problem(big, [0, 0, 0]), H200, DEFAULT)                     # no bounds
    assert not prefill.prologue_beside(problem(big, [0, 0, 9], np.array([1100, 1109], np.int32)), H200, DEFAULT)
    assert not prefill.prologue_beside(problem([100, 0, 90], [0, 0, 0], np.array([100, 100], np.int32)), H200,
                                       DEFAULT)
    assert not prefill.prologue_beside(problem(big, [0, 0, 0], no_past, rotary=True), H200, DEFAULT)
    assert not prefill.prologue_beside(problem(big, [0, 0, 0], no_past), describe_capability(8, 0), DEFAULT)
    assert not prefill.prologue_beside(problem(big, [0, 0, 0], no_past), H200,
                                       cupa.Options(programmatic_launch=False))
    eight = cupa.Options(_tuning=_Tuning(prologue_beside_sms=8))
    p = problem(big, [0, 0, 0], no_past)
    assert prefill.prologue_beside(p, H200, eight)
    # the mma.sync prefill runs beside such a prologue; the persistent wgmma prefill never does
    assert prefill.BACKEND._beside(p, H200, DEFAULT) and not prefill_wgmma.BACKEND._beside(p, H200, DEFAULT)
    assert "SMs of its own" not in prefill_wgmma.BACKEND.describe(p, H200, DEFAULT)
    specs = []
    monkeypatch.setattr(prologue.jit, "get_kernel", lambda spec: specs.append(spec) or object())
    launcher = prologue.prologue_launcher(p, H200, eight, beside=True)
    assert specs[0].name_expression.endswith(", true>")
    assert launcher.block[0] == prologue.BESIDE_THREADS and launcher.grid[:2] == (8, 1)


@pytest.mark.parametrize("block_size,box", [(1, 0), (4, 0), (12, 0), (8, 8), (24, 8), (16, 16), (48, 16),
                                            (32, 32), (64, 32), (256, 32), (512, 32)])
def test_tma_boxes_of_cache_rows(rng, monkeypatch, block_size, box):
    """Boxes of gcd(block_size, 32) cache rows (each inside one block, tiles starting on box boundaries)
    where that is at least 8 rows, else cp.async; new K/V rows from key/value in boxes of 32 exactly where
    the kernel reads them there (kv_from_inputs); Options(tma=False), or no driver entry: none."""
    monkeypatch.setattr(tma, "available", lambda: True)
    p = problem_of(rng, block_size=block_size)
    assert prefill_wgmma.tma_plan(p, DEFAULT) == (box, prefill.kv_from_inputs(p, DEFAULT))
    tail = prefill_wgmma.BACKEND._tail_args(p, DEFAULT)
    assert tail[:4] == (prefill_wgmma.launch.TENSOR_MAP,) * 4 and tail[4] == box
    assert tail[5] == int(prefill.kv_from_inputs(p, DEFAULT))
    rotary = problem_of(rng, block_size=block_size, rotary=True)  # new rows rotated: read from the cache
    assert prefill_wgmma.tma_plan(rotary, DEFAULT) == (box, False)
    assert prefill_wgmma.tma_plan(p, cupa.Options(tma=False)) == (0, False)
    monkeypatch.setattr(tma, "available", lambda: False)
    assert prefill_wgmma.tma_plan(p, DEFAULT) == (0, False)


def test_tensor_map_shapes():
    """(head_size, heads, rows) with byte strides of a row of one head and of a whole row; boxes of
    64 columns (the 128-byte swizzle span) x 1 head x box rows; the limits of cuTensorMapEncodeTiled."""
    assert tma.map_args(4096 * 16, 8, 128, 16) == ((128, 8, 65536), (256, 2048), (64, 1, 16))
    assert tma.map_args(100, 1, 128, 32) == ((128, 1, 100), (256, 256), (64, 1, 32))
    for bad in ((0, 8, 128, 16), (10, 8, 100, 16), (10, 8, 128, 0), (10, 8, 128, 257), (1 << 31, 8, 128, 16)):
        with pytest.raises(ValueError):
            tma.map_args(*bad)
    if not tma.available():
        with pytest.raises(RuntimeError, match="cuTensorMapEncodeTiled"):
            tma.rows_map(1 << 20, 100, 1, 128, 32)


def test_wgmma_prefill_reasons_name_its_32_bit_limits(rng, monkeypatch):
    """The wgmma prefill numbers cache slots and work items in 32 bits: past MAX_SLOTS / MAX_ITEMS it
    declines with a reason (the mma.sync prefill serves the call) -- checked with the limits lowered."""
    p = problem_of(rng)
    items = prefill_wgmma.launch_plan(p)["num_tiles"] * p.kv_num_heads
    assert prefill_wgmma.BACKEND.reasons(p, H200, DEFAULT) == []
    monkeypatch.setattr(prefill_wgmma, "MAX_ITEMS", items - 1)
    assert any(f"{items} work items" in r for r in prefill_wgmma.BACKEND.reasons(p, H200, DEFAULT))
    monkeypatch.setattr(prefill_wgmma, "MAX_ITEMS", items)
    monkeypatch.setattr(prefill_wgmma, "MAX_SLOTS", p.num_blocks * p.block_size - 1)
    assert any("cache slots" in r for r in prefill_wgmma.BACKEND.reasons(p, H200, DEFAULT))
    assert dispatch.choose(p, H200, DEFAULT).name == "prefill"
