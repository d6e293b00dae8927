"""Dispatch rules of the Hopper wgmma prefill, without a GPU.

The backend must decline (and explain() must say why) when CUPA_PREFILL_WGMMA=0, or unless the device has
compute capability 9.0, T is float16/bfloat16, the caches hold T and head_size is 128; everything
it declines keeps going to the mma.sync prefill (or decode). The device is faked: dispatch is told
the inputs live on a device and the backend is told the device's compute capability.
"""

import numpy as np
import pytest

import cupa
from cupa import compile as cupa_compile
from cupa import dispatch, jit
from cupa.kernels import prefill_wgmma, registry
from tests import gpu_cases as gc


@pytest.fixture
def fake_device(monkeypatch):
    """Inputs count as device arrays; the device reports compute capability 9.0 unless a test changes it."""
    monkeypatch.setattr(dispatch, "is_host_call", lambda inputs: False)
    state = {"cc": (9, 0)}
    monkeypatch.setattr(prefill_wgmma, "device_capability", lambda: state["cc"])
    monkeypatch.delenv(prefill_wgmma.ENV_VAR, raising=False)
    return state


def problem_of(rng, **kw):
    args = dict(q_lens=[40, 30], past=[10, 0], H=8, Hk=2, D=128)
    args.update(kw)
    inputs, attrs = gc.build(rng, **args)
    op = cupa.PagedAttention(**attrs)
    bound = op._bind((), inputs)
    return op._problem(bound), bound


def chosen(rng, **kw) -> str:
    problem, inputs = problem_of(rng, **kw)
    return dispatch.select_backend(problem, inputs, None).name


def explain(rng, **kw) -> str:
    problem, inputs = problem_of(rng, **kw)
    return dispatch.explain(problem, inputs)


def test_registered_before_the_mma_sync_prefill():
    names = [b.name for b in registry.backends()]
    assert names.index("prefill_wgmma") < names.index("prefill") < names.index("decode")


def test_on_by_default_and_off_with_zero(fake_device, rng, monkeypatch):
    assert chosen(rng) == "prefill_wgmma"
    for value in ("", "1", "yes"):
        monkeypatch.setenv(prefill_wgmma.ENV_VAR, value)
        assert chosen(rng) == "prefill_wgmma", value
    monkeypatch.setenv(prefill_wgmma.ENV_VAR, "0")
    assert chosen(rng) == "prefill"
    text = explain(rng)
    assert "prefill_wgmma: not eligible" in text and "CUPA_PREFILL_WGMMA=0" in text and "prefill: chosen" in text


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_on_for_the_covered_case(fake_device, rng, monkeypatch, dtype):
    assert chosen(rng, dtype=dtype) == "prefill_wgmma"
    text = explain(rng, dtype=dtype)
    assert "prefill_wgmma: chosen" in text and "wgmma" in text and "prefill: eligible but not preferred" in text, text


@pytest.mark.parametrize("cc", [(8, 0), (8, 9), (10, 0), (12, 0), None])
def test_not_on_other_devices(fake_device, rng, monkeypatch, cc):
    fake_device["cc"] = cc
    assert chosen(rng) == "prefill"
    assert "needs compute capability 9.0" in explain(rng)


@pytest.mark.parametrize("D", [64, 256])
def test_not_for_other_head_sizes(fake_device, rng, monkeypatch, D):
    assert chosen(rng, D=D) == "prefill"
    assert f"head_size {D}" in explain(rng, D=D)


@pytest.mark.parametrize("cache", ["int8", "fp8"])
def test_not_for_quantized_caches(fake_device, rng, monkeypatch, cache):
    assert chosen(rng, cache=cache) == "prefill"
    assert f"{cache} cache" in explain(rng, cache=cache)


def test_not_for_float32_or_decode_shaped_calls(fake_device, rng, monkeypatch):
    assert chosen(rng, dtype="float32") == "decode"
    assert chosen(rng, q_lens=[1, 1]) == "decode"  # token_count <= batch_size: decode-shaped


def test_launch_plan_and_shared_memory(rng):
    problem, _ = problem_of(rng, q_lens=[300, 0, 5], past=[0, 0, 0], H=32, Hk=8)
    plan = prefill_wgmma.launch_plan(problem)
    assert plan["rows"] == 128 and plan["threads"] == 256
    assert plan["num_tiles"] == (305 * 4) // 128 + 3
    assert plan["zero_ctas"] == 2 and plan["grid"] == 2 + plan["num_tiles"] * 8
    # Q 32 KB + 2 stages x (K + V) 64 KB + row tables + 1 KB alignment: two CTAs fit an H100/H200 SM.
    assert prefill_wgmma.shared_bytes(problem) == 32768 + 65536 + 3 * 64 * 12 + 3 * 2 * 4 + 1024
    assert 2 * (prefill_wgmma.shared_bytes(problem) + 4096) <= 228 * 1024


def test_pinned_specializations_and_compile_tasks():
    pinned = [s for s in registry.all_specializations() if s.family == "prefill_wgmma_ws"]
    assert len(pinned) == 2 and all(s.arch == "sm_90a" for s in pinned)
    assert "@sm_90a" in str(pinned[0])
    portable = jit.Specialization("decode", "k")
    tasks = cupa_compile.compile_tasks([portable] + pinned, ["sm_80", "sm_90"])
    assert tasks == [(portable, "sm_80"), (portable, "sm_90")] + [(s, "sm_90a") for s in pinned]
    assert cupa_compile.compile_tasks(pinned, ["sm_80"]) == []
    assert cupa_compile.compile_tasks(pinned, ["sm_90", "sm_90a"]) == [(s, "sm_90a") for s in pinned]
    with pytest.raises(ValueError, match="arch"):
        jit.Specialization("decode", "k", arch="sm_90")


def test_pinned_cache_key_follows_options_and_source():
    a = registry.prefill_wgmma_ws_spec("float16")
    b = jit.Specialization(a.family, a.name_expression, ("-DCUPA_TEST_KEY=1",), arch=a.arch)
    assert jit.pinned_cache_key(a) == jit.pinned_cache_key(a) != jit.pinned_cache_key(b)
    assert jit.pinned_cache_key(a) != jit.pinned_cache_key(registry.prefill_wgmma_ws_spec("bfloat16"))


@pytest.mark.parametrize("spec_of, mangled", [(registry.prefill_wgmma_ws_spec, "_Z22paged_prefill_wgmma_ws")])
def test_wgmma_kernels_compile_for_sm_90a_without_spills(spec_of, mangled):
    """The wgmma kernel: NVRTC never serializes the wgmma pipeline (C7520 / C7512 / C7514), keeps
    setmaxnreg (no C7508 'ignored'; 64 registers for the copier and scheduler warpgroups, 192 for the
    consumers) and spills nothing."""
    try:
        jit.nvrtc_version()
    except Exception as exc:  # pragma: no cover - NVRTC missing
        pytest.skip(f"NVRTC unavailable: {exc}")
    for dtype in prefill_wgmma.WGMMA_DTYPES:
        r = jit.compile_offline(spec_of(dtype), "sm_90a", keep_cubin=True)
        assert r.ok, r.log
        assert r.cubin and r.lowered_name.startswith(mangled)
        assert "setmaxnreg" not in r.log and "serialized" not in r.log, r.log
        if r.has_stats:
            assert r.registers <= 128 and not r.spills, r.summary()


def test_new_keys_from_inputs_only_where_the_prologue_copies_rows_unchanged(rng, monkeypatch):
    """prefill.kv_from_inputs: the attention kernels read new K/V from key/value only when the prologue
    stores them unchanged at positions past + j (unpacked, T cache, no rotary, no QK-norm, derived slots,
    no query_positions); CUPA_PREFILL_KV_INPUTS=0 turns it off. explain() says which."""
    from cupa.kernels import prefill

    monkeypatch.delenv(prefill.KV_INPUTS_ENV, raising=False)
    assert prefill.kv_from_inputs(problem_of(rng)[0])
    assert "new K/V read from key/value" in prefill.prologue_phrase(problem_of(rng)[0])
    slots = gc.derived_slots(gc.build(rng, q_lens=[40, 30], past=[10, 0], H=8, Hk=2, D=128)[0], 16)
    for kw in (dict(packed=True), dict(rotary=True), dict(qk_norm=True), dict(cache="int8"), dict(cache="fp8"),
               dict(slot_mapping=slots), dict(query_positions=True)):
        problem = problem_of(rng, **kw)[0]
        assert not prefill.kv_from_inputs(problem), kw
        assert prefill.prologue_phrase(problem) == "fused prologue first", kw
    monkeypatch.setenv(prefill.KV_INPUTS_ENV, "0")
    assert not prefill.kv_from_inputs(problem_of(rng)[0])


def test_prologue_beside_only_without_a_past_by_the_bounds(rng, monkeypatch):
    """prefill.prologue_beside: the 512-thread prologue on SMs of its own only under kv_from_inputs, with
    attention_metadata bounding kv lengths by the longest new-token run, and enough tokens; its launch
    then has beside_sms() CTAs of 512 threads (the token-loop specialization)."""
    import numpy as np

    from cupa.kernels import prefill, prologue

    monkeypatch.delenv(prologue.BESIDE_SMS_ENV, raising=False)
    monkeypatch.delenv(prefill.KV_INPUTS_ENV, raising=False)

    def problem(q_lens, past, md=None, **kw):
        inputs, attrs = gc.build(rng, q_lens=q_lens, past=past, H=4, Hk=2, D=64, **kw)
        op = cupa.PagedAttention(**attrs)
        return op._problem(op._bind((), dict(inputs, attention_metadata=md)))

    big = [1100, 0, 1000]
    no_past = np.array([1100, 1100], dtype=np.int32)
    assert prefill.prologue_beside(problem(big, [0, 0, 0], no_past))
    assert "SMs of its own" in prefill.prologue_phrase(problem(big, [0, 0, 0], no_past))
    assert not prefill.prologue_beside(problem(big, [0, 0, 0]))                                  # no bounds
    assert not prefill.prologue_beside(problem(big, [0, 0, 9], np.array([1100, 1109], np.int32)))  # a past
    assert not prefill.prologue_beside(problem([100, 0, 90], [0, 0, 0], np.array([100, 100], np.int32)))
    assert not prefill.prologue_beside(problem(big, [0, 0, 0], no_past, rotary=True))
    monkeypatch.setenv(prologue.BESIDE_SMS_ENV, "8")
    p = problem(big, [0, 0, 0], no_past)
    assert prefill.prologue_beside(p)
    specs = []
    monkeypatch.setattr(prologue.jit, "get_kernel", lambda spec: specs.append(spec) or object())
    launcher = prologue.prologue_launcher(p, beside=True)
    assert specs[0].name_expression.endswith(", true>")
    assert launcher.block[0] == prologue.BESIDE_THREADS and launcher.grid[:2] == (8, 1)


# ---- the warp-specialized kernel (paged_prefill_wgmma_ws) -------------------------------------------

def ws_problem(rng, metadata, **kw):
    args = dict(q_lens=[40, 30], past=[10, 0], H=8, Hk=2, D=128)
    args.update(kw)
    inputs, attrs = gc.build(rng, **args)
    inputs["attention_metadata"] = np.array(metadata, dtype=np.int32)
    op = cupa.PagedAttention(**attrs)
    return op._problem(op._bind((), inputs))


def test_ws_kernel_by_default_and_off_with_zero(rng, monkeypatch):
    """The warp-specialized kernel serves the backend's calls, with or without a past; "1" is the
    default of CUPA_PREFILL_WGMMA_WS, anything else is an error naming the variable."""
    monkeypatch.delenv(prefill_wgmma.WS_ENV_VAR, raising=False)
    backend = prefill_wgmma.BACKEND
    for problem in (ws_problem(rng, [40, 80]), ws_problem(rng, [40, 50]), problem_of(rng)[0]):
        assert prefill_wgmma.ws_preferred(problem)
        assert backend._spec(problem).family == "prefill_wgmma_ws"
        assert backend._shared_bytes(problem) == prefill_wgmma.ws_shared_bytes(problem)
        assert "warp-specialized" in backend.describe(problem)
    p = ws_problem(rng, [40, 50])
    monkeypatch.setenv(prefill_wgmma.WS_ENV_VAR, "1")
    assert prefill_wgmma.ws_preferred(p)
    monkeypatch.setenv(prefill_wgmma.WS_ENV_VAR, "yes")
    with pytest.raises(cupa.PagedAttentionError, match="CUPA_PREFILL_WGMMA_WS"):
        prefill_wgmma.ws_preferred(p)


def test_ws_launch_plan_and_shared_memory(rng, monkeypatch):
    """One persistent CTA per SM (fewer when there are fewer work items, or under CUPA_PREFILL_WS_CTAS)
    after the zero-pass CTAs of 512 threads; 2 Q buffers + 2 stages of 128-key K and V tiles."""
    p = ws_problem(rng, [40, 80])
    items = ((40 + 30) * 4 // 128 + 2) * 2
    plan = prefill_wgmma.ws_launch_plan(p, 132)
    assert plan["items"] == items and plan["persistent"] == min(items, 132) and plan["zero_ctas"] == 1
    assert plan["grid"] == plan["zero_ctas"] + plan["persistent"] and plan["threads"] == 512
    assert prefill_wgmma.ws_launch_plan(p, 3)["persistent"] == 3
    assert prefill_wgmma.ws_launch_plan(p, None)["persistent"] == items
    assert prefill_wgmma.ws_shared_bytes(p) == 2 * 128 * 128 * 2 + 2 * 2 * 128 * 128 * 2 + 1024
    monkeypatch.setattr(prefill_wgmma, "sm_count", lambda device_id=None: 132)
    monkeypatch.setenv(prefill_wgmma.WS_CTAS_ENV_VAR, "7")
    assert prefill_wgmma.ws_ctas() == 7
    monkeypatch.setenv(prefill_wgmma.WS_CTAS_ENV_VAR, "500")
    assert prefill_wgmma.ws_ctas() == 132
    monkeypatch.setenv(prefill_wgmma.WS_CTAS_ENV_VAR, "0")
    with pytest.raises(cupa.PagedAttentionError, match="CUPA_PREFILL_WS_CTAS"):
        prefill_wgmma.ws_ctas()


@pytest.mark.parametrize("block_size,box", [(1, 0), (4, 0), (12, 0), (8, 8), (24, 8), (16, 16), (48, 16),
                                            (32, 32), (64, 32), (256, 32), (512, 32)])
def test_tma_boxes_of_cache_rows(rng, monkeypatch, block_size, box):
    """Boxes of gcd(block_size, 32) cache rows (each inside one block, tiles starting on box boundaries)
    where that is at least 8 rows, else cp.async; new K/V rows from key/value in boxes of 32 exactly where
    the kernel reads them there (kv_from_inputs); CUPA_PREFILL_TMA=0, or no driver entry: none."""
    from cupa.kernels import prefill, tma

    monkeypatch.setattr(tma, "available", lambda: True)
    monkeypatch.delenv(prefill_wgmma.TMA_ENV_VAR, raising=False)
    p = problem_of(rng, block_size=block_size)[0]
    assert prefill_wgmma.tma_plan(p) == (box, prefill.kv_from_inputs(p))
    tail = prefill_wgmma.BACKEND._tail_args(p)
    assert tail[:4] == (prefill_wgmma.launch.TENSOR_MAP,) * 4 and tail[4] == box
    assert tail[5] == int(prefill.kv_from_inputs(p))
    rotary = problem_of(rng, block_size=block_size, rotary=True)[0]  # new rows rotated: read from the cache
    assert prefill_wgmma.tma_plan(rotary) == (box, False)
    monkeypatch.setenv(prefill_wgmma.TMA_ENV_VAR, "0")
    assert prefill_wgmma.tma_plan(p) == (0, False)
    monkeypatch.setenv(prefill_wgmma.TMA_ENV_VAR, "on")
    with pytest.raises(cupa.PagedAttentionError, match="CUPA_PREFILL_TMA"):
        prefill_wgmma.tma_plan(p)
    monkeypatch.delenv(prefill_wgmma.TMA_ENV_VAR)
    monkeypatch.setattr(tma, "available", lambda: False)
    assert prefill_wgmma.tma_plan(p) == (0, False)


def test_tensor_map_shapes():
    """(head_size, heads, rows) with byte strides of a row of one head and of a whole row; boxes of
    64 columns (the 128-byte swizzle span) x 1 head x box rows; the limits of cuTensorMapEncodeTiled."""
    from cupa.kernels import tma

    assert tma.map_args(4096 * 16, 8, 128, 16) == ((128, 8, 65536), (256, 2048), (64, 1, 16))
    assert tma.map_args(100, 1, 128, 32) == ((128, 1, 100), (256, 256), (64, 1, 32))
    for bad in ((0, 8, 128, 16), (10, 8, 100, 16), (10, 8, 128, 0), (10, 8, 128, 257), (1 << 31, 8, 128, 16)):
        with pytest.raises(ValueError):
            tma.map_args(*bad)
    if not tma.available():
        with pytest.raises(RuntimeError, match="cuTensorMapEncodeTiled"):
            tma.rows_map(1 << 20, 100, 1, 128, 32)
