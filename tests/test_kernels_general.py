"""The general CUDA backend without a GPU: dispatch, kernel choice, launch geometry, split plan, workspace,
the output_qk byte limit, and its kernels' offline compile (registers, spills, shared memory).

Devices are :func:`cupa.device.describe_capability` descriptions, so every rule is checked for every compute
capability cupa claims.
"""

import dataclasses
import math

import numpy as np
import pytest

import cupa
from cupa import dispatch, jit
from cupa.device import SHARED_OPTIN_BY_CAPABILITY, describe_capability
from cupa.kernels import backend as kbackend
from cupa.kernels import decode, general, launch, prefill, registry
from tests import util
from tests.test_dispatch import problem_of

H200 = describe_capability(9, 0)
DEFAULT = cupa.Options()
GENERAL = cupa.Options(backend="general")
CAPABILITIES = [cc for cc in sorted(SHARED_OPTIN_BY_CAPABILITY) if cc >= (8, 0)]
FUSED = [name for name in dispatch.CUDA_BACKENDS if name != "general"]


FEATURE_CASES = {
    "bias": dict(bias=(False, False)),
    "scores": dict(qk_output=1),
    "probabilities": dict(qk_output=2, sink=True),
    "lse": dict(return_lse=True),
    "latent": dict(latent=True, D=64, v_head_size=32, scale=0.2),
    "latent_576": dict(latent=True, D=576, v_head_size=512, scale=0.1, H=16),
}


def test_general_is_last_and_serves_every_feature_but_packed_caches():
    assert dispatch.CUDA_BACKENDS[-1] == "general"
    b = dispatch.cuda_backends()[-1]
    assert b is general.BACKEND and b.name == "general"
    assert b.verified  # tests/gpu/test_general.py and the differential fuzz pass on an H200
    assert b.serves == frozenset(kbackend.FEATURES) - {"subbyte"} == {"latent", "bias", "output_qk", "return_lse"}
    assert "general" in cupa.options.BACKEND_NAMES


@pytest.mark.parametrize("case", ["bias", "scores", "probabilities"])
def test_fused_backends_decline_and_the_general_backend_alone_serves(rng, case, monkeypatch):
    """Each fused backend declines with the feature's reason naming the backends that serve it (output_qk: the
    decode backend too, attention_bias: the prefill backend too, which have no reason to decline these fp16
    calls); the general backend has no reason to decline; marked unverified (and the decode backend's
    output_qk and the prefill backend's bias too), the default choice raises the clear error that says so."""
    monkeypatch.setattr(general.BACKEND, "verified", False)
    monkeypatch.setattr(decode.BACKEND, "unverified", frozenset({"output_qk"}))
    monkeypatch.setattr(prefill.BACKEND, "unverified", frozenset({"bias"}))
    p = problem_of(rng, **FEATURE_CASES[case])
    what = {"bias": "attention_bias", "scores": "output_qk", "probabilities": "output_qk"}[case]
    served_by = {"attention_bias": "(the prefill and general backends serve it)",
                 "output_qk": "(the decode and general backends serve it)"}[what]
    for b in dispatch.cuda_backends():
        reasons = b.not_supported_reasons(p, H200, DEFAULT)
        if b.name == "general" or (b.name, what) in (("decode", "output_qk"), ("prefill", "attention_bias")):
            assert reasons == [], reasons
        else:
            assert any(r.startswith(what) and r.endswith(served_by) for r in reasons), reasons
    with pytest.raises(cupa.PagedAttentionError, match=r"no CUDA backend serves this call .*general: not yet "
                                                       r"verified on a GPU \(select it with cupa.Options\(backend="
                                                       r"'general'\)\)"):
        dispatch.choose(p, H200, DEFAULT)
    assert dispatch.choose(p, H200, GENERAL) is general.BACKEND
    text = dispatch.account(p, H200, GENERAL)
    assert "general: chosen (general backend on" in text and "not yet verified on a GPU" in text, text
    for name in FUSED:
        assert f"{name}: not considered (options.backend='general')" in text


@pytest.mark.parametrize("case", ["bias_decode", "bias_fp32", "scores", "probabilities"])
def test_the_default_choice_for_bias_and_output_qk_is_the_general_backend(rng, case):
    """Prefill-shaped fp16/bf16 bias calls are the tensor-core prefill's (tests/test_prefill_bias_host.py);
    decode-shaped or float32 ones, and output_qk, the general backend's."""
    kw = {"bias_decode": dict(bias=(False, False), q_lens=[1, 1]),
          "bias_fp32": dict(bias=(False, False), dtype="float32")}.get(case) or FEATURE_CASES[case]
    p = problem_of(rng, **kw)
    assert dispatch.choose(p, H200, DEFAULT) is general.BACKEND
    text = dispatch.account(p, H200, DEFAULT)
    line = next(x for x in text.splitlines() if x.startswith("general: "))
    assert line.startswith("general: chosen (general backend on") and "not yet verified" not in line, text


@pytest.mark.parametrize("case", ["latent", "latent_576"])
def test_latent_is_served_by_the_general_backend_when_named(rng, case):
    p = problem_of(rng, **FEATURE_CASES[case])
    assert dispatch.choose(p, H200, GENERAL) is general.BACKEND
    assert "CUDA cores (LATENT)" in general.BACKEND.describe(p, H200, GENERAL)


def test_general_wins_only_where_nothing_else_serves(rng):
    """It is chosen for every call that uses a feature only it serves, and never where a fused backend serves
    the call; its preferred() says the same."""
    for case in FEATURE_CASES:
        if case == "lse":   # every fused backend serves return_lse
            continue
        p = problem_of(rng, **FEATURE_CASES[case])
        # a 576/512 latent call is the MLA backend's (verified, before general in priority order), a prefill with
        # a bias over caches of T the tensor-core prefill's
        want = {"latent_576": "mla", "bias": "prefill"}.get(case, "general")
        assert dispatch.choose(p, H200, DEFAULT).name == want, case
        # LATENT alone is the MLA backend's to prefer (FEATURES); without it the general backend still serves
        assert general.BACKEND.preferred(p, H200, DEFAULT) == (not case.startswith("latent"))
    for kw, fused in ((dict(), "prefill_wgmma"), (dict(q_lens=[1, 1]), "decode"), (dict(dtype="float32"), "decode"),
                      (dict(D=256), "prefill"), (dict(D=96), "decode"), (dict(cache="int8"), "prefill"),
                      (dict(return_lse=True), "prefill_wgmma"), (dict(return_lse=True, q_lens=[1, 1]), "decode"),
                      (dict(return_lse=True, cache="int8"), "prefill")):
        p = problem_of(rng, **kw)
        assert dispatch.choose(p, H200, DEFAULT).name == fused, kw
        assert not general.BACKEND.preferred(p, H200, DEFAULT)
        assert "general: eligible but not preferred" in dispatch.account(p, H200, DEFAULT)
    for cc in CAPABILITIES:
        assert dispatch.choose(problem_of(rng), describe_capability(*cc), DEFAULT).name != "general"


@pytest.mark.parametrize("cc", CAPABILITIES)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("cache", ["T", "int8", "fp8"])
def test_tensor_core_kernel_fits_every_device_it_runs_on(rng, cc, dtype, D, cache):
    """fp16/bf16 SEPARATE at head_size 64/128/256 run the tensor-core kernel on every compute capability cupa
    claims: its dynamic and static shared memory fit the device's per-CTA limit (99 KB on sm_86/89/120)."""
    device = describe_capability(*cc)
    p = problem_of(rng, dtype=dtype, D=D, cache=cache, bias=(True, False))
    assert general.uses_mma(p, device)
    plan = general.launch_plan(p, device)
    assert plan["kernel"] == "mma" and plan["shared"] == general.mma_shared_bytes(p, plan["q_split"])
    assert plan["shared"] + general.MMA_STATIC_SHARED <= device.shared_per_block_optin
    # the second Q tile of a per-channel K scale wherever it fits (problem_of: PER_CHANNEL scales)
    fits = general.mma_shared_bytes(p, True) + general.MMA_STATIC_SHARED <= device.shared_per_block_optin
    assert plan["q_split"] == (cache != "T" and fits)


def test_q_split_where_the_shared_memory_allows_it(rng):
    """Q x a per-channel K scale as two T values (QSPLIT): quantized caches with per-channel K scales, on devices
    with room for the second Q tile (all head sizes on sm_80/90/100; head_size 64 only on the 99 KB GPUs);
    never for T caches or per-tensor scales; the launch names the QSPLIT instance."""
    small = describe_capability(8, 9)
    for D, on_small in ((64, True), (128, False), (256, False)):
        p = problem_of(rng, D=D, cache="int8", bias=(True, False))
        assert general.launch_plan(p, H200)["q_split"]
        assert general.launch_plan(p, small)["q_split"] == on_small
        assert general.launch_plan(p, small)["kernel"] == "mma"
        assert general.mma_shared_bytes(p, True) == general.mma_shared_bytes(p) + 64 * D * 2
    assert not general.launch_plan(problem_of(rng, D=128, cache="fp8", k_quant="PER_TENSOR", bias=(True, False)),
                                   H200)["q_split"]
    assert not general.launch_plan(problem_of(rng, D=128, bias=(True, False)), H200)["q_split"]
    assert registry.general_mma_spec("bfloat16", "int8", 128, True).name_expression.endswith(", 128, true>")


def test_tensor_core_shared_memory_mirrors_the_kernel(rng):
    """GeneralMmaSmem: Q tile (64 rows), stages of K and V tiles (codes for 8-bit caches, then a widened tile),
    the row offsets / copy sizes / mapped masks of STAGES + 1 tiles, and the 128-byte alignment pad."""
    assert general.mma_shared_bytes(problem_of(rng, D=128)) == 64 * 128 * 2 + 2 * 2 * 64 * 128 * 2 + 3 * 64 * 12 + 3 * 8 \
        + 128
    assert general.mma_shared_bytes(problem_of(rng, D=256, cache="fp8")) == 64 * 256 * 2 + 2 * 2 * 32 * 256 + \
        2 * 32 * 256 * 2 + 3 * 32 * 12 + 3 * 4 + 128
    assert general.mma_shared_bytes(problem_of(rng, D=64)) == 64 * 64 * 2 + 3 * 2 * 64 * 64 * 2 + 4 * 64 * 12 + 4 * 8 \
        + 128


def test_cuda_core_kernel_for_the_rest(rng):
    """float32, head sizes other than 64/128/256, LATENT, and a device too small for the tensor-core kernel's
    shared memory take the CUDA-core kernel; explain() says why."""
    small = dataclasses.replace(H200, shared_per_block_optin=64 * 1024)
    for kw, why in ((dict(dtype="float32"), "T=float32"), (dict(D=96), "head_size 96"),
                    (FEATURE_CASES["latent"], "LATENT"), (dict(D=8), "head_size 8")):
        p = problem_of(rng, return_lse=True, **kw)
        assert not general.uses_mma(p, H200)
        assert general.launch_plan(p, H200)["kernel"] == "simt"
        assert f"CUDA cores ({why})" in general.BACKEND.describe(p, H200, GENERAL)
    p = problem_of(rng, return_lse=True)
    assert general.uses_mma(p, H200) and not general.uses_mma(p, small)
    assert "of shared memory > the device's 65536 B" in general.BACKEND.describe(p, small, GENERAL)


@pytest.mark.parametrize("D,G,shape", [(8, 1, (1, 1)), (128, 4, (4, 1)), (256, 16, (8, 1)), (64, 3, (4, 1)),
                                       (264, 4, (2, 4)), (512, 128, (2, 4)), (576, 16, (2, 4)), (1024, 1, (2, 4))])
def test_cuda_core_shapes(rng, D, G, shape):
    """(head chunk, 8-channel chunks a lane): head_size <= 256 with the group's heads rounded up to a power of
    two (at most 8), larger (LATENT) heads 4 chunks and 2 heads; every shape a registered specialization."""
    latent = D > 256
    kw = dict(latent=True, v_head_size=min(D, 512), scale=0.1, H=G) if latent else dict(H=2 * G, Hk=2, dtype="float32")
    p = problem_of(rng, q_lens=[1, 1], past=[5, 9], D=D, bias=(False, True), **kw)
    assert general.simt_shape(p) == shape
    gt, cpl = shape
    assert registry.general_simt_spec(p.dtype, p.cache_kind, gt, cpl) in registry.all_specializations()
    plan = general.launch_plan(p, H200)
    assert plan["grid"] == (p.token_count, p.kv_num_heads * math.ceil(G / gt), plan["num_splits"])


def test_head_sizes_beyond_the_cuda_core_kernel_decline(rng):
    p = problem_of(rng, q_lens=[1, 1], past=[5, 9], latent=True, D=1032, v_head_size=512, scale=0.1, H=4)
    reasons = general.BACKEND.not_supported_reasons(p, H200, GENERAL)
    assert reasons == ["head_size 1032 > 1024 (the general backend's largest head)"]
    with pytest.raises(cupa.PagedAttentionError, match="options.backend: 'general' cannot serve this call: "
                                                       "head_size 1032 > 1024"):
        dispatch.choose(p, H200, GENERAL)


def test_compute_capability_below_8_declines(rng):
    old = dataclasses.replace(H200, capability=(7, 5))
    assert general.BACKEND.not_supported_reasons(problem_of(rng, bias=(True, True)), old, GENERAL) == [
        "needs compute capability 8.0+; the device has 7.5"]


def test_split_plan_from_static_sizes_only(rng):
    """Decode-shaped calls are split at multiples of a chunk drawn from the block table's capacity, the grid and
    the SM count; attention_metadata's bound only drops trailing splits (contract §4.5); a big prefill is one split."""
    past = [8000, 3000, 100, 7000, 8100, 5, 4000, 6000]
    kw = dict(q_lens=[1] * 8, past=past, H=32, Hk=8, D=128, block_size=16, qk_output=2, max_blocks=520)
    free = general.launch_plan(problem_of(rng, **kw), H200)
    tight = general.launch_plan(problem_of(rng, metadata=[1, 8101], **kw), H200)
    short = general.launch_plan(problem_of(rng, metadata=[1, 1000], **kw), H200)
    # 8 row tiles x 8 KV heads = 64 CTAs unsplit: 2 * 132 / 64 -> 8 parts of 8320 keys, rounded to 256: 1280
    assert free["chunk"] == tight["chunk"] == short["chunk"] == 1280
    assert free["num_splits"] == math.ceil(520 * 16 / 1280) == 7
    assert tight["num_splits"] == math.ceil(8101 / 1280) and short["num_splits"] == 1
    assert free["grid"] == (64, 7) and free["zero_ctas"] == 0 and short["zero_ctas"] == 1
    big = general.launch_plan(problem_of(rng, q_lens=[2048] * 4, past=[0] * 4, H=32, Hk=8, bias=(False, False)), H200)
    assert big["num_splits"] == 1 and big["grid"] == (math.ceil(8192 / 128) + (8192 * 4 // 64 + 4) * 8, 1)
    assert big["finish_grid"] is None


def test_finish_launch_only_for_splits_or_output_qk(rng):
    assert general.launch_plan(problem_of(rng, bias=(True, True)), H200)["finish_grid"] is None
    p = problem_of(rng, qk_output=1, metadata=[40, 300])
    assert general.launch_plan(p, H200)["finish_grid"] == (70, 2, 1) and p.kv_capacity == p.static_kv_capacity < 300
    p = problem_of(rng, qk_output=2, max_blocks=300)
    assert general.launch_plan(p, H200)["finish_grid"] == (70, 2, math.ceil(300 * 16 / general.FINISH_KEYS))
    split = problem_of(rng, q_lens=[1, 1], past=[3000, 4000], return_lse=True)
    plan = general.launch_plan(split, H200)
    assert plan["num_splits"] > 1 and plan["finish_grid"] == (2, 2, 1)


def test_workspace_layout(rng):
    """The Q workspace only when the prologue transforms Q; lse of one split only for qk_output=2 without
    return_lse; partial states with splits; one allocation of aligned parts."""
    p = problem_of(rng, qk_output=2)
    w = general.workspace_layout(p, general.launch_plan(p, H200), 2)
    assert w == {"q": -1, "lse": 0, "part_o": -1, "part_ml": -1, "nbytes": launch.align(70 * 8 * 4)}
    p = problem_of(rng, qk_output=2, return_lse=True, rotary=True)
    w = general.workspace_layout(p, general.launch_plan(p, H200), 2)
    assert w == {"q": 0, "lse": -1, "part_o": -1, "part_ml": -1, "nbytes": launch.align(70 * 8 * 128 * 2)}
    p = problem_of(rng, q_lens=[1, 1], past=[3000, 4000], qk_output=2)
    plan = general.launch_plan(p, H200)
    S = plan["num_splits"]
    w = general.workspace_layout(p, plan, 2)
    assert w["q"] == -1 and w["lse"] == -1 and w["part_o"] == 0 and w["part_ml"] == launch.align(2 * 8 * S * 128 * 4)
    assert w["nbytes"] == w["part_ml"] + launch.align(2 * 8 * S * 8)


def test_every_launch_is_a_registered_specialization(rng):
    """What a plan launches is in registry.all_specializations(), so the offline check compiles it."""
    specs = set(registry.all_specializations())
    for kw in (dict(), dict(dtype="bfloat16", cache="fp8", D=64), dict(dtype="float32"), dict(D=40, cache="int8"),
               FEATURE_CASES["latent_576"], dict(FEATURE_CASES["latent_576"], cache="fp8", k_quant="PER_TENSOR")):
        p = problem_of(rng, bias=(False, False), **kw)
        plan = general.launch_plan(p, H200)
        spec = (registry.general_mma_spec(p.dtype, p.cache_kind, p.head_size, plan["q_split"]) if plan["kernel"] == "mma" else
                registry.general_simt_spec(p.dtype, p.cache_kind, plan["head_chunk"], plan["chunks_per_lane"]))
        assert {spec, registry.general_finish_spec(p.dtype), registry.prologue_spec(p.dtype, p.cache_kind)} <= specs


def test_build_cases_run_on_the_reference(rng):
    """The GPU tests' cases (bias patterns and capacities, -inf entries, output_qk, lse, LATENT) are valid calls:
    the NumPy reference runs them and returns every output."""
    for kw in (dict(bias=(False, True), bias_pad=(3, 17), qk_output=2, return_lse=True, sink=True, softcap=10.0),
               dict(bias=(True, False), bias_pad=(-5, -9), bias_neg_inf=0.1, qk_output=1, window=20),
               dict(latent=True, D=64, v_head_size=40, scale=0.3, cache="fp8", k_quant="PER_TENSOR",
                    bias=(True, True), return_lse=True)):
        inputs, attrs = util.build(rng, **kw)
        out, *extra = cupa.paged_attention(**inputs, **util.host_attrs(attrs))
        assert out.shape == (inputs["query"].shape[0], attrs["num_heads"] * (kw.get("v_head_size") or kw.get("D", 64)))
        assert len(extra) == bool(kw.get("qk_output")) + bool(kw.get("return_lse"))
        result = util.split_result((out, *extra), attrs.get("qk_output", 0), attrs.get("return_lse", False))
        if "bias_neg_inf" in kw:  # the first query of sequence 0 admits no finite key at head 0: zeros
            assert not np.asarray(result[0][0, :64], dtype=np.float32).any()
            assert np.asarray(result[0][0, 64:], dtype=np.float32).any()


# -- the output_qk byte limit: validated from shapes before anything is allocated -----------------------------

def test_output_qk_byte_limit_is_checked_before_any_allocation(rng, monkeypatch):
    """Options.output_qk_max_bytes: a device call whose output_qk (H * N * kv_capacity float32) exceeds it fails
    in validation naming the size, before a backend is chosen or anything allocated; at the limit it plans."""
    inputs, attrs = util.build(rng, q_lens=[3, 2], past=[5, 9], H=4, Hk=2, D=64, qk_output=2)
    N, H, cap = 5, 4, inputs["block_table"].shape[1] * 16
    size = H * N * cap * 4
    monkeypatch.setattr(dispatch, "call_device", lambda inputs: 0)
    monkeypatch.setattr(dispatch, "device_info", lambda ordinal: H200)

    def no_allocation(*args, **kwargs):
        raise AssertionError("the call allocated its outputs")

    monkeypatch.setattr(launch, "prepare", no_allocation)
    op = cupa.PagedAttention(**attrs, options=cupa.Options(backend="general", output_qk_max_bytes=size - 1))
    with pytest.raises(cupa.PagedAttentionError, match=rf"qk_output: got 2; expected an output_qk of at most "
                                                       rf"{size - 1} bytes \(num_heads\*token_count\*kv_capacity = "
                                                       rf"{H}\*{N}\*{cap} float32 = {size} bytes\)"):
        op(**inputs)
    at_limit = cupa.PagedAttention(**attrs, options=cupa.Options(backend="general", output_qk_max_bytes=size))
    assert at_limit.plan(**inputs).backend is general.BACKEND
    with pytest.raises(AssertionError, match="allocated"):
        at_limit(**inputs)
    # the bound of attention_metadata sets the width, and so the size
    md = np.array([3, 9], dtype=np.int32)
    assert at_limit.plan(**inputs, attention_metadata=md).problem.output_qk_shape == (H, N, 9)
    small = cupa.PagedAttention(**attrs, options=cupa.Options(backend="general", output_qk_max_bytes=H * N * 9 * 4))
    assert small.plan(**inputs, attention_metadata=md).backend is general.BACKEND


# -- offline compile --------------------------------------------------------------------------------------------

def nvrtc_or_skip():
    try:
        return jit.nvrtc_version()
    except Exception as exc:  # pragma: no cover - NVRTC missing
        pytest.skip(f"NVRTC unavailable: {exc}")


@pytest.mark.parametrize("arch", ["sm_86", "sm_90"])
def test_kernels_compile_without_spills_within_their_static_shared_memory(arch):
    """The tensor-core kernel at head_size 128 and 256 (the 99 KB case), a CUDA-core shape of each register
    budget and the finish kernel compile for ``arch`` without spills; the tensor-core kernel's static shared
    memory is within what backend choice counts (MMA_STATIC_SHARED)."""
    nvrtc_or_skip()
    specs = [registry.general_mma_spec("float16", "T", 128), registry.general_mma_spec("bfloat16", "fp8", 256),
             registry.general_simt_spec("float32", "T", 8, 1), registry.general_simt_spec("float16", "int8", 2, 4),
             registry.general_finish_spec("bfloat16")]
    for spec in specs:
        r = jit.compile_offline(spec, arch)
        assert r.ok, r.log
        if r.has_stats:
            assert not r.spills and r.registers <= 255, r.summary()
            if spec.family == "general_mma":
                assert r.shared_bytes <= general.MMA_STATIC_SHARED, r.summary()


# -- the host launch path against a fake CuPy (tests/test_launch_fastpath.py): parameter sizes, pointers -----

FAKE_CASES = {
    # name: (fake_case keywords, attention_bias shape or None, extra attributes, kernel)
    "prefill_bias_mma": (dict(B=2, N=40, L=512, H=8, Hk=2, D=128), (2, 8, 24, 600), dict(), "paged_general_mma"),
    "decode_split_scores_lse": (dict(B=8, L=4096, sink=True), (1, 32, 1, 5000), dict(qk_output=1, return_lse=True),
                                "paged_general_mma"),
    "decode_probabilities_one_split": (dict(B=2, L=100, cache="fp8", rotary=True), None, dict(qk_output=2),
                                       "paged_general_mma"),
    "fp32_cuda_cores": (dict(B=3, N=9, L=700, D=64, dtype=np.float32, H=8, Hk=2), (3, 1, 4, 800),
                        dict(qk_output=2, return_lse=True), "paged_general_simt"),
    "latent_576": (dict(B=4, L=2000, H=16, Hk=1, D=576, cache="int8", quant="PER_TENSOR"), (1, 1, 1, 4000),
                   dict(kv_cache_layout="LATENT", v_head_size=512, scale=0.1, return_lse=True), "paged_general_simt"),
}


def _fake_general_call(fake, case, route):
    from tests.test_launch_fastpath import fake_case

    kw, bias, extra, _ = FAKE_CASES[case]
    x, attrs = fake_case(fake, **kw)
    if bias is not None:
        x["attention_bias"] = fake.empty(bias, x["query"].dtype)
    if extra.get("kv_cache_layout") == "LATENT":
        N, D = x["query"].shape[0], x["key_cache"].shape[-1]
        x["key"] = fake.empty((N, D), x["query"].dtype)
        for name in ("value", "value_cache", "v_scale"):
            x.pop(name, None)
        attrs.pop("v_quant_type", None)
    op = cupa.PagedAttention(**attrs, **extra, options=cupa.Options(backend="general", launch=route))
    result = op(**x)
    return x, op.plan(**x), result


def _pointer(param) -> int:
    return int.from_bytes(param, "little")


@pytest.mark.parametrize("case", sorted(FAKE_CASES))
def test_launch_parameters_match_the_kernels(case):
    """Every launch hands each kernel parameter the size its C signature takes (FakeCupy checks), the same bytes
    on the fast and the rawkernel route; the grids are launch_plan's; pointers go where the kernels read them:
    the bias, output_qk, lse, one workspace, and in LATENT no value cache and the K scale as V's."""
    from tests.test_launch_fastpath import FakeCupy, fake_cupy

    runs = {}
    for route in ("fast", "rawkernel"):
        with fake_cupy(FakeCupy()) as fake:
            x, plan, result = _fake_general_call(fake, case, route)
            runs[route] = [launch_[1:] for launch_ in fake.launches]
            if route == "fast":
                allocations = list(fake.allocations)
                launches = fake.launches
    assert runs["fast"] == runs["rawkernel"]
    p = plan.problem
    geometry = general.launch_plan(p, plan.device)
    kernel = FAKE_CASES[case][3]
    names = [launch_[1] for launch_ in launches]
    assert names == ["paged_prologue", kernel] + (["paged_general_finish"] if geometry["finish_grid"] else [])
    attend = launches[1]
    grid = tuple(geometry["grid"]) + (1,) * (3 - len(geometry["grid"]))
    assert attend[2] == grid and attend[3][0] == (128 if kernel == "paged_general_mma" else 128)
    assert attend[4] == geometry["shared"]
    params = attend[6]
    out, *extra = result if isinstance(result, tuple) else (result,)
    qk = extra.pop(0) if p.attrs.qk_output else None
    lse = extra.pop(0) if p.attrs.return_lse else None
    bias = x.get("attention_bias")
    assert _pointer(params[10]) == (bias.data.ptr if bias is not None else 0)
    assert _pointer(params[11]) == out.data.ptr
    assert _pointer(params[12]) == (qk.data.ptr if qk is not None else 0)
    if lse is not None:
        assert _pointer(params[13]) == lse.data.ptr
    if p.latent:
        assert _pointer(params[2]) == 0 and _pointer(params[9]) == x["k_scale"].data.ptr
    else:
        assert _pointer(params[2]) == x["value_cache"].data.ptr
    w = general.workspace_layout(p, geometry, x["query"].dtype.itemsize)
    expected = [math.prod(p.output_shape) * x["query"].dtype.itemsize]
    expected += [math.prod(p.output_qk_shape) * 4] if qk is not None else []
    expected += [math.prod(p.lse_shape) * 4] if lse is not None else []
    expected += [w["nbytes"]] if w["nbytes"] else []
    assert allocations[-len(expected):] == expected
    if geometry["num_splits"] > 1:
        assert _pointer(params[14]) and _pointer(params[15]) == _pointer(params[14]) + w["part_ml"]
    if geometry["finish_grid"]:
        finish = launches[2]
        assert finish[2] == geometry["finish_grid"] and finish[3][0] == 32 * general.FINISH_WARPS
        fp = finish[6]
        assert _pointer(fp[5]) == (bias.data.ptr if bias is not None else 0)
        assert _pointer(fp[8]) == out.data.ptr and _pointer(fp[9]) == (qk.data.ptr if qk is not None else 0)
        assert [_pointer(fp[i]) for i in (6, 7)] == [_pointer(params[i]) for i in (14, 15)]
