"""The MLA backend (kv_cache_layout LATENT) on a GPU against the NumPy reference, and seed 17.3 on the device.

Every call names the backend (``Options(backend="mla")``: it is not chosen by default until these tests
have passed on a device) and runs twice on compute capability 9.0: the wgmma kernel and the portable
mma.sync kernel (``_tuning.mla_wgmma=False``). Fresh random data every run; outputs poisoned with NaN,
every element and every cache byte checked; lse against the reference where asked.

    PYTHONPATH=$PWD python -m pytest -q -s tests/gpu/test_mla.py
"""

import math

import numpy as np
import pytest

import cupa
from cupa.options import _Tuning
from tests import util

pytestmark = pytest.mark.gpu

D, DV, ROPE, NOPE = util.MLA_D, util.MLA_DV, util.MLA_ROPE, 128


def _options(path: str) -> cupa.Options:
    return cupa.Options(backend="mla", _tuning=_Tuning(mla_wgmma=path == "wgmma"))


@pytest.fixture(params=["wgmma", "mma"])
def path(request, cp):
    if request.param == "wgmma" and cp.cuda.Device().compute_capability != "90":
        pytest.skip("the wgmma MLA kernel needs compute capability 9.0")
    return request.param


def engine(cp, inputs, attrs, metadata=None) -> str:
    text = cupa.PagedAttention(**attrs).explain(**util.to_device(cp, inputs), attention_metadata=metadata)
    assert "mla: chosen" in text, text
    return "wgmma" if "warpgroup MMA" in text else "mma"


def check_latent(cp, inputs, attrs, *, dtype="float16", cache="T", metadata=None, expect_engine=None):
    """Reference on a copy, the MLA backend on CuPy copies with a NaN-poisoned out=; every output element, the
    cache bytes and (return_lse) lse. Returns (output, lse, device inputs) of the GPU call."""
    ref_in = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in inputs.items()}
    ref = cupa.paged_attention(**ref_in, attention_metadata=metadata, **util.host_attrs(attrs))
    ref_out, ref_lse = ref if attrs.get("return_lse") else (ref, None)
    if expect_engine is not None:
        assert engine(cp, inputs, attrs, metadata) == expect_engine
    dev = util.to_device(cp, inputs)
    N, H = inputs["query"].shape[0], attrs["num_heads"]
    out = cp.full((N, H * DV), np.nan, dtype=dev["query"].dtype)
    got = cupa.paged_attention(**dev, attention_metadata=metadata, out=out, **attrs)
    lse = None
    if attrs.get("return_lse"):
        got, lse = got
    assert got is out or got.data.ptr == out.data.ptr
    cp.cuda.get_current_stream().synchronize()
    host = cp.asnumpy(out)
    caches = [("key_cache", cp.asnumpy(dev["key_cache"]), ref_in["key_cache"])]
    util.assert_matches_reference(host, ref_out, dtype, caches, cache=cache)
    if lse is not None:
        lse = cp.asnumpy(lse)
        assert lse.shape == ref_lse.shape and lse.dtype == np.float32
        assert np.array_equal(np.isinf(lse), np.isinf(ref_lse)), "lse: -inf where the reference has none, or not"
        fin = np.isfinite(ref_lse)
        np.testing.assert_allclose(lse[fin], ref_lse[fin], rtol=1e-3, atol=2e-3)
    return out, lse, dev


def latent(rng, path, **kw):
    inputs, attrs = util.build_latent(rng, **kw)
    attrs["options"] = _options(path)
    return inputs, attrs


# ---- decode steps and prefills against the reference -----------------------------------------

@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("H", [16, 32, 64, 128])
def test_decode(cp, rng, path, dtype, H):
    inputs, attrs = latent(rng, path, B=5, H=H, dtype=dtype, past=[700, 1, 64, 1333, 0], return_lse=True)
    expect = "wgmma" if path == "wgmma" and H > 16 else "mma"
    check_latent(cp, inputs, attrs, dtype=dtype, expect_engine=expect)


@pytest.mark.parametrize("H", [16, 128])
@pytest.mark.parametrize("kq", ["PER_TENSOR", "PER_CHANNEL"])
def test_fp8_latent(cp, rng, path, H, kq):
    inputs, attrs = latent(rng, path, B=4, H=H, cache="fp8", k_quant=kq, past=[900, 3, 2000, 65], return_lse=True)
    check_latent(cp, inputs, attrs, cache="fp8", expect_engine="mma")


@pytest.mark.parametrize("block_size", [1, 16, 24, 64, 128])
def test_block_sizes(cp, rng, path, block_size):
    """Any block size: rows gathered one by one; TMA boxes of gcd(block_size, 64) rows on the wgmma path."""
    inputs, attrs = latent(rng, path, B=3, H=64, block_size=block_size, past=[300, 130, 1])
    check_latent(cp, inputs, attrs)


@pytest.mark.parametrize("H", [16, 128])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_chunked_prefill_with_rotary(cp, rng, path, H, dtype):
    """Prefill-shaped: new tokens over a cached prefix (chunked prefill, prefix caching), a sequence without a
    past, one with no new token; in-op RoPE on channels 512..575 (interleaved, as DeepSeek) for Q and the
    latent rows written."""
    inputs, attrs = latent(rng, path, H=H, dtype=dtype, q_lens=[70, 5, 0, 33], past=[500, 0, 40, 1],
                           rotary=True, interleaved=True, return_lse=True)
    check_latent(cp, inputs, attrs, dtype=dtype)


@pytest.mark.parametrize("mask", ["window", "softcap", "non_causal", "query_positions"])
def test_mask_rules(cp, rng, path, mask):
    kw = {"window": dict(window=100), "softcap": dict(softcap=20.0), "non_causal": dict(is_causal=0),
          "query_positions": dict(query_positions=True)}[mask]
    inputs, attrs = latent(rng, path, H=32, q_lens=[40, 1, 17], past=[300, 900, 0], return_lse=True, **kw)
    check_latent(cp, inputs, attrs)


def test_many_splits_bit_identical_under_bounds_and_reruns(cp, rng, path):
    """A short grid (2 sequences, 128 heads, long keys): each tile cuts its keys into several splits (of
    different sizes for the two lengths) merged by the merge kernel; absent, tight and loose
    attention_metadata give the same bits, and so does a second run."""
    inputs, attrs = latent(rng, path, B=2, H=128, past=[5000, 3100], return_lse=True)
    outs = []
    for md in (None, np.array([1, 5001], dtype=np.int32), np.array([4, 1 << 20], dtype=np.int32), None):
        out, lse, _ = check_latent(cp, inputs, attrs, metadata=md)
        outs.append((cp.asnumpy(out).view(np.uint16), lse.view(np.uint32)))
    for o, l in outs[1:]:
        assert np.array_equal(o, outs[0][0]) and np.array_equal(l, outs[0][1])


def test_undersized_bound_stays_safe_and_writes_every_row(cp, rng, path):
    """contract §4.5: a max_kv_len bound below the sequences' lengths launches fewer splits than the tiles
    want; the keys past them are omitted (the contract is broken), but every owned row is still written
    (the NaN poison replaced, finite values and lse) and nothing is read or written out of bounds (this
    test runs under compute-sanitizer in the device check)."""
    inputs, attrs = latent(rng, path, B=2, H=128, past=[5000, 3100], return_lse=True)
    dev = util.to_device(cp, inputs)
    out = cp.full((inputs["query"].shape[0], 128 * DV), np.nan, dtype=dev["query"].dtype)
    got, lse = cupa.paged_attention(**dev, attention_metadata=np.array([1, 600], dtype=np.int32), out=out, **attrs)
    cp.cuda.get_current_stream().synchronize()
    assert np.isfinite(cp.asnumpy(out).astype(np.float32)).all() and np.isfinite(cp.asnumpy(lse)).all()


# ---- paging ----------------------------------------------------------------------------------

@pytest.mark.parametrize("cache", ["T", "fp8"])
def test_paging_shuffled_shared_unmapped_and_poisoned(cp, rng, path, cache):
    """Shuffled and shared (prefix) blocks, evicted and out-of-range block ids, NaN (fp8: 0x7F) in every cache
    row no sequence reads: they never reach the output."""
    for table in ("shared", "unmapped"):
        inputs, attrs = latent(rng, path, B=4, H=64, block_size=16, cache=cache, block_table=table,
                               past=[200, 170, 3, 81], q_lens=[1, 4, 1, 2])
        assert util.poison_unused_cache_rows(inputs, 16) > 0
        check_latent(cp, inputs, attrs, cache=cache)


@pytest.mark.parametrize("cache", ["T", "fp8"])
def test_slot_mapping_with_skips(cp, rng, path, cache):
    """Explicit slots, some -1 (writes skipped, the cache rows stay as they were; the token still attends)."""
    inputs, attrs = latent(rng, path, B=3, H=32, cache=cache, q_lens=[3, 1, 2], past=[100, 9, 0])
    slots = util.derived_slots(inputs, 64)
    slots[1] = slots[4] = -1
    inputs["slot_mapping"] = np.asarray(slots, dtype=np.int32)
    before = inputs["key_cache"].copy()
    out, _, dev = check_latent(cp, inputs, attrs, cache=cache)
    after = cp.asnumpy(dev["key_cache"]).reshape(-1, D)
    for s in util.derived_slots(inputs, 64):
        if s not in slots:
            np.testing.assert_array_equal(after[s].view(np.uint8), before.reshape(-1, D)[s].view(np.uint8))


def test_tokens_without_owner_and_invalid_sequences(cp, rng, path):
    """Tokens past cum[B] and an invalid sequence (kv_len beyond the table) output zeros and lse -inf."""
    inputs, attrs = latent(rng, path, B=3, H=16, q_lens=[2, 2, 3], past=[40, 10, 5], return_lse=True)
    inputs["cumulative_sequence_length"][-1] -= 2        # the last 2 tokens belong to no sequence
    inputs["past_seqlens"][1] = 10 ** 6                  # sequence 1 is invalid
    out, lse, _ = check_latent(cp, inputs, attrs)
    host = cp.asnumpy(out).reshape(7, -1)
    assert not host[2:4].any() and not host[5:].any()
    assert np.isneginf(lse[2:4]).all() and np.isneginf(lse[5:]).all()


# ---- seed 17.3 on the GPU -------------------------------------------------------------------

def _absorbed_pair(rng, H=16, q_lens=(1, 3, 1), past=(90, 40, 7), bs=16):
    """One problem in both forms, float16, from one random latent: absorbed (576/512, one latent head) and
    non-absorbed (192/192 with V zero-padded past 128, kv_num_heads = H) with random W_UK, W_UV."""
    T = np.float16
    cum, bt, NB = util.paged_layout(rng, q_lens, past, bs, extra_blocks=2, extra_cols=2, unused_cols="neg")
    N = int(sum(q_lens))
    past = np.asarray(past, np.int32)
    W_UK = rng.standard_normal((H, NOPE, DV)) / math.sqrt(DV)
    W_UV = rng.standard_normal((H, NOPE, DV)) / math.sqrt(DV)
    lat = rng.standard_normal((NB, bs, 1, D)).astype(T)                      # k_pe stored rotated already
    c_new = rng.standard_normal((N, D)).astype(T)
    q_nope = rng.standard_normal((N, H, NOPE)).astype(T).astype(np.float64)
    q_pe = rng.standard_normal((N, H, ROPE)).astype(T)

    def decompress(rows):  # latent rows (..., 576) -> K (..., H, 192), V (..., H, 192)
        c = rows[..., :DV].astype(np.float64)
        k = np.concatenate([np.einsum("hcr,...r->...hc", W_UK, c),
                            np.broadcast_to(rows[..., None, DV:], rows.shape[:-1] + (H, ROPE))], axis=-1)
        v = np.concatenate([np.einsum("hcr,...r->...hc", W_UV, c), np.zeros(rows.shape[:-1] + (H, ROPE))], axis=-1)
        return k.astype(T), v.astype(T)

    kc_na, vc_na = decompress(lat[:, :, 0])
    k_new, v_new = decompress(c_new)
    scale = 1.0 / math.sqrt(NOPE + ROPE)
    common = dict(cumulative_sequence_length=cum, past_seqlens=past, block_table=bt)
    q_abs = np.concatenate([np.einsum("nhc,hcr->nhr", q_nope, W_UK).astype(T), q_pe], axis=2)
    absorbed = dict(query=q_abs.reshape(N, H * D), key=c_new, key_cache=lat, **common)
    abs_attrs = dict(num_heads=H, kv_num_heads=1, kv_cache_layout="LATENT", v_head_size=DV, scale=scale)
    nonabs = dict(query=np.concatenate([q_nope.astype(T), q_pe], axis=2).reshape(N, H * (NOPE + ROPE)),
                  key=k_new.reshape(N, -1), value=v_new.reshape(N, -1), key_cache=kc_na, value_cache=vc_na, **common)
    na_attrs = dict(num_heads=H, kv_num_heads=H, scale=scale)
    return absorbed, abs_attrs, nonabs, na_attrs, W_UV, N, H


def test_absorbed_equals_non_absorbed_on_the_gpu(cp, rng, path):
    """Seed 17.3: W_UV applied to the absorbed output (MLA backend) equals the non-absorbed attention over the
    decompressed latent (the decode backend, 192-wide heads), both on the GPU; each also matches its reference."""
    absorbed, abs_attrs, nonabs, na_attrs, W_UV, N, H = _absorbed_pair(rng)
    abs_attrs["options"] = _options(path)
    out_abs, _, _ = check_latent(cp, absorbed, abs_attrs)
    dev = util.to_device(cp, nonabs)
    out_na = cp.asnumpy(cupa.paged_attention(**dev, **na_attrs, options=cupa.Options(backend="decode")))
    ref_na = cupa.paged_attention(**{k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in nonabs.items()},
                                  **na_attrs)
    assert util.rel_err(out_na, ref_na) < util.TOLERANCE["float16"]
    proj = np.einsum("hvr,nhr->nhv", W_UV, cp.asnumpy(out_abs).reshape(N, H, DV).astype(np.float64))
    na = out_na.reshape(N, H, NOPE + ROPE).astype(np.float64)
    err = util.rel_err(proj, na[..., :NOPE])
    assert err < 5e-3, f"absorbed vs non-absorbed: relative error {err:.3g}"
    assert not na[..., NOPE:].any()  # the zero V padding stays zero


# ---- a DeepSeek-V2-Lite-shaped layer --------------------------------------------------------

def _yarn(dim=ROPE, base=10000.0, factor=40.0, original=4096, beta_fast=32.0, beta_slow=1.0, max_pos=512):
    """DeepSeek's YaRN RoPE tables (cos, sin) of rotary_dim/2 columns, and its attention mscale factor."""
    def correction(rot):
        return dim * math.log(original / (rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(math.floor(correction(beta_fast)), 0), min(math.ceil(correction(beta_slow)), dim - 1)
    ramp = np.clip((np.arange(dim // 2) - low) / max(high - low, 1e-3), 0.0, 1.0)
    freq_extra = 1.0 / base ** (np.arange(0, dim, 2) / dim)
    inv_freq = freq_extra / factor * ramp + freq_extra * (1.0 - ramp)
    ang = np.outer(np.arange(max_pos), inv_freq)
    return np.cos(ang), np.sin(ang)


def test_deepseek_v2_lite_layer_prefill_then_decode(cp, rng, path):
    """One DeepSeek-V2-Lite attention layer (hidden 2048, 16 heads, kv_lora_rank 512, qk_nope 128, qk_rope 64,
    v_head 128, YaRN factor 40 with mscale_all_dim 0.707 in the explicit scale) with random weights: a
    ragged prefill of two prompts, then 4 decode steps, in absorbed form through cupa (in-op interleaved RoPE
    at rotary_offset 512) against a float64 NumPy layer in non-absorbed form (decompressed K/V, causal MHA)."""
    hidden, H, R = 2048, 16, DV
    mscale = 0.1 * 0.707 * math.log(40.0) + 1.0
    scale = mscale * mscale / math.sqrt(NOPE + ROPE)
    f64 = np.float64
    W_q = rng.standard_normal((hidden, H * (NOPE + ROPE))) / math.sqrt(hidden)
    W_kva = rng.standard_normal((hidden, R + ROPE)) / math.sqrt(hidden)
    g_kv = 1.0 + 0.1 * rng.standard_normal(R)
    W_UK = rng.standard_normal((H, NOPE, R)) / math.sqrt(R)
    W_UV = rng.standard_normal((H, NOPE, R)) / math.sqrt(R)
    W_o = rng.standard_normal((H * NOPE, hidden)) / math.sqrt(H * NOPE)
    cos, sin = _yarn()
    T = np.float16

    def rope(x, pos):  # interleaved pairs (2i, 2i+1) at positions pos; x (..., 64)
        c, s = cos[pos], sin[pos]
        while c.ndim < x.ndim:
            c, s = c[:, None], s[:, None]
        y = x.copy()
        y[..., 0::2] = x[..., 0::2] * c - x[..., 1::2] * s
        y[..., 1::2] = x[..., 1::2] * c + x[..., 0::2] * s
        return y

    prompts = [37, 20]
    steps = 4
    bs, MB = 16, 8
    NB = 2 * MB
    bt = rng.permutation(NB).astype(np.int32).reshape(2, MB)
    cache = np.zeros((NB, bs, 1, D), T)
    cache_dev = cp.asarray(cache)
    seq_x = [[], []]  # per sequence: hidden states so far (for the reference)
    options = _options(path)
    cos_T, sin_T = cos.astype(T), sin.astype(T)
    op = cupa.PagedAttention(num_heads=H, kv_num_heads=1, kv_cache_layout="LATENT", v_head_size=R, scale=scale,
                             do_rotary=1, rotary_interleaved=1, rotary_offset=R, options=options)
    errors = []
    for step in range(1 + steps):
        q_lens = prompts if step == 0 else [1, 1]
        past = [0, 0] if step == 0 else [prompts[0] + step - 1, prompts[1] + step - 1]
        x = [rng.standard_normal((q, hidden)) for q in q_lens]
        for b in range(2):
            seq_x[b].extend(x[b])
        xt = np.concatenate(x)
        N = xt.shape[0]
        q = (xt @ W_q).reshape(N, H, NOPE + ROPE)
        kva = xt @ W_kva
        c_kv = kva[:, :R] / np.sqrt(np.mean(kva[:, :R] ** 2, axis=-1, keepdims=True) + 1e-6) * g_kv
        latent_row = np.concatenate([c_kv, kva[:, R:]], axis=1)             # k_pe before RoPE
        q_abs = np.concatenate([np.einsum("nhc,hcr->nhr", q[..., :NOPE], W_UK), q[..., NOPE:]], axis=2)
        cum = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        inputs = dict(query=cp.asarray(q_abs.reshape(N, H * D).astype(T)), key=cp.asarray(latent_row.astype(T)),
                      key_cache=cache_dev, cumulative_sequence_length=cp.asarray(cum),
                      past_seqlens=cp.asarray(np.asarray(past, np.int32)), block_table=cp.asarray(bt),
                      cos_cache=cp.asarray(cos_T), sin_cache=cp.asarray(sin_T))
        o_lat = cp.asnumpy(op(**inputs)).reshape(N, H, R).astype(f64)
        got = np.einsum("hvr,nhr->nhv", W_UV, o_lat).reshape(N, H * NOPE) @ W_o
        # float64 reference, non-absorbed, over each sequence's whole history (inputs rounded as cupa saw them)
        want = []
        for b in range(2):
            xs = np.asarray(seq_x[b])
            L = xs.shape[0]
            qs = (xs @ W_q).reshape(L, H, NOPE + ROPE)
            kv_s = xs @ W_kva
            c = kv_s[:, :R] / np.sqrt(np.mean(kv_s[:, :R] ** 2, axis=-1, keepdims=True) + 1e-6) * g_kv
            c = c.astype(T).astype(f64)
            pos = np.arange(L)
            k_pe = rope(kv_s[:, R:].astype(T).astype(f64), pos)
            q_pe = rope(qs[..., NOPE:].astype(T).astype(f64), pos)
            k = np.concatenate([np.einsum("hcr,lr->lhc", W_UK, c), np.broadcast_to(k_pe[:, None], (L, H, ROPE))], -1)
            v = np.einsum("hcr,lr->lhc", W_UV, c)
            qq = np.concatenate([qs[..., :NOPE], q_pe], -1)
            new = range(L - q_lens[b], L)
            for t in new:
                s = np.einsum("hd,lhd->hl", qq[t], k[:t + 1]) * scale
                p = np.exp(s - s.max(-1, keepdims=True))
                p /= p.sum(-1, keepdims=True)
                want.append(np.einsum("hl,lhc->hc", p, v[:t + 1]).reshape(H * NOPE))
        want = np.asarray(want) @ W_o
        errors.append(util.rel_err(got, want))
    print(f"DeepSeek-V2-Lite layer ({path}): relative error per step {['%.2e' % e for e in errors]}")
    assert max(errors) < 1e-2, errors


# ---- CUDA graphs ----------------------------------------------------------------------------

def test_graph_capture_of_a_decode_step(cp, rng, path):
    """cupa.capture_graph of one MLA decode step with replay-wide bounds (split partials and counters in the
    captured workspace), replayed while the KV length grows (new query and latent rows, past_seqlens + 1,
    written in place); every replay matches the reference run of the same step, output and cache."""
    B, H, steps = 4, 128, 4
    inputs, attrs = latent(rng, path, B=B, H=H, past=[300, 17, 1000, 64], max_blocks=32)
    md = np.array([1, 32 * 64], dtype=np.int32)
    host = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in inputs.items()}
    dev = util.to_device(cp, inputs)
    out = cp.empty((B, H * DV), dtype=dev["query"].dtype)
    graph = cupa.capture_graph(lambda: cupa.paged_attention(**dev, attention_metadata=md, out=out, **attrs))
    with graph:
        for step in range(steps):
            with graph.stream:
                if step:
                    host["query"] = rng.standard_normal(host["query"].shape).astype(host["query"].dtype)
                    host["key"] = rng.standard_normal(host["key"].shape).astype(host["key"].dtype)
                    host["past_seqlens"] = host["past_seqlens"] + 1
                    for name in ("query", "key", "past_seqlens"):
                        dev[name].set(host[name])
                out.fill(np.nan)
                graph.replay()
                graph.stream.synchronize()
            ref = cupa.paged_attention(**host, attention_metadata=md, **util.host_attrs(attrs))
            err = util.rel_err(cp.asnumpy(out), ref)
            assert err < util.TOLERANCE["float16"], f"step {step}: relative error {err:.3g}"
            util.assert_cache_close(cp.asnumpy(dev["key_cache"]), host["key_cache"], steps=1, what="key_cache",
                                    fp32_rows=True)


# ---- fp8 on a latent shared by 128 heads (seed 20.8) ------------------------------------------

@pytest.mark.parametrize("kq", ["PER_TENSOR", "PER_CHANNEL"])
def test_fp8_latent_accuracy_report(cp, rng, path, kq):
    """The error fp8 adds on a latent shared by H heads: the GPU output with an fp8 latent cache against the
    float64 reference over the same latent kept in float16 (output relative error, lse error: the logits'
    perturbation), for H = 16 and 128; the kernel's own error (against the reference on the fp8 codes) stays
    within the fp16 tolerance. The numbers are printed for docs/architecture.md."""
    B, L = 8, 2048
    for H in (16, 128):
        inputs, attrs = latent(rng, path, B=B, H=H, past=[L] * B, max_blocks=L // 64 + 1, return_lse=True)
        lat = inputs["key_cache"]
        # The same latent quantized: per-tensor or per-channel scales from the rows' amax (448 at the max).
        amax = np.abs(lat.astype(np.float32)).reshape(-1, D).max(axis=0)
        k_scale = (np.full((1,), amax.max() / 448.0) if kq == "PER_TENSOR" else (amax / 448.0).reshape(1, 1, D))
        k_scale = k_scale.astype(np.float32)
        fp8 = dict(inputs, key_cache=cupa.quantize(lat.astype(np.float32), k_scale, "float8e4m3fn", as_bytes=True),
                   k_scale=k_scale)
        fp8_attrs = dict(attrs, k_quant_type=kq, k_cache_dtype="float8e4m3fn")
        out, lse, _ = check_latent(cp, fp8, fp8_attrs, cache="fp8")  # the kernel on the codes: SPEC tolerance
        exact_out, exact_lse = cupa.paged_attention(**{k: (v.copy() if isinstance(v, np.ndarray) else v)
                                                       for k, v in inputs.items()}, **util.host_attrs(attrs))
        got = cp.asnumpy(out).astype(np.float64)
        err = util.rel_err(got, exact_out)
        dlse = np.abs(lse - exact_lse)
        print(f"fp8 latent {kq:11s} H={H:3d} ({path}): output relative error {err:.3e}, "
              f"max |out - out_fp16| {np.abs(got - exact_out.astype(np.float64)).max():.3e}, "
              f"lse error mean {dlse.mean():.3e} max {dlse.max():.3e}")
        assert err < 0.1, err
