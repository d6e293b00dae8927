"""MLA (kv_cache_layout="LATENT") on the NumPy reference: seed section 17.3.

* absorbed (576/512, kv_num_heads 1, rotary_offset 512) == non-absorbed (192/128, kv_num_heads = H)
  built from random W_UK / W_UV;
* in-op offset RoPE == RoPE applied before the call with do_rotary=0 (bit for bit);
* V aliases the leading v_head_size channels of the latent K row;
* the scale guard and the rejected combinations fail with clear PagedAttentionErrors.
"""

import math

import numpy as np
import pytest

import cupa
from tests import util

H = 4               # small num_heads keeps the test fast
R, ROPE, NOPE = 512, 64, 128
D_ABS, DV_ABS = R + ROPE, R
D_NA, DV_NA = NOPE + ROPE, 128
SCALE = 1.0 / math.sqrt(D_NA)


def _mla_problem(rng, q_lens=(3, 1, 0, 2), past=(5, 9, 3, 0), bs=4, interleaved=False):
    """Random latent problem plus both spellings' inputs (float32)."""
    f32 = np.float32
    q_lens, past = np.asarray(q_lens), np.asarray(past)
    B, N = len(q_lens), int(q_lens.sum())
    kv = past + q_lens
    need = [max(1, -(-int(L) // bs)) for L in kv]
    MB, NB = max(need) + 1, sum(need) + 2
    phys = rng.permutation(NB)
    bt = np.full((B, MB), -1, np.int32)
    used = 0
    for b in range(B):
        bt[b, :need[b]] = phys[used:used + need[b]]
        used += need[b]
    cum = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    max_pos = int(kv.max()) + 3
    cos, sin = cupa.rope_cache(max_pos, ROPE, base=10000.0, dtype=f32)

    W_UK = (rng.standard_normal((H, NOPE, R)) / math.sqrt(R)).astype(np.float64)
    W_UV = (rng.standard_normal((H, DV_NA, R)) / math.sqrt(R)).astype(np.float64)
    c_new = rng.standard_normal((N, R)).astype(f32)
    kpe_new = rng.standard_normal((N, ROPE)).astype(f32)
    q_nope = rng.standard_normal((N, H, NOPE)).astype(f32)
    q_pe = rng.standard_normal((N, H, ROPE)).astype(f32)

    # cached history: latent rows and (already rotated) k_pe at their positions
    lat_cache = rng.standard_normal((NB, bs, 1, D_ABS)).astype(f32)       # garbage elsewhere
    k_na = rng.standard_normal((NB, bs, H, D_NA)).astype(f32)
    v_na = rng.standard_normal((NB, bs, H, D_NA)).astype(f32)
    for b in range(B):
        for p in range(past[b]):
            blk, off = bt[b, p // bs], p % bs
            c = rng.standard_normal(R).astype(f32)
            kpe = util.apply_rope(rng.standard_normal(ROPE).astype(f32), cos[p], sin[p], 0, interleaved).astype(f32)
            lat_cache[blk, off, 0] = np.concatenate([c, kpe])
            k_na[blk, off, :, :NOPE] = (W_UK @ c.astype(np.float64)).astype(f32)
            k_na[blk, off, :, NOPE:] = kpe
            v_na[blk, off, :, :DV_NA] = (W_UV @ c.astype(np.float64)).astype(f32)

    common = dict(cumulative_sequence_length=cum, past_seqlens=past.astype(np.int32), block_table=bt,
                  cos_cache=cos, sin_cache=sin)
    q_abs = np.concatenate([np.einsum("nhc,hcr->nhr", q_nope.astype(np.float64), W_UK), q_pe], axis=2)
    absorbed = dict(query=q_abs.astype(f32).reshape(N, H * D_ABS),
                    key=np.concatenate([c_new, kpe_new], axis=1), key_cache=lat_cache, **common)
    abs_attrs = dict(num_heads=H, kv_num_heads=1, kv_cache_layout="LATENT", v_head_size=DV_ABS, scale=SCALE,
                     do_rotary=1, rotary_offset=R, rotary_interleaved=int(interleaved))
    k_new = np.concatenate([np.einsum("hcr,nr->nhc", W_UK, c_new.astype(np.float64)),
                            np.broadcast_to(kpe_new[:, None, :], (N, H, ROPE))], axis=2)
    v_new = np.concatenate([np.einsum("hcr,nr->nhc", W_UV, c_new.astype(np.float64)),
                            rng.standard_normal((N, H, D_NA - DV_NA))], axis=2)
    nonabs = dict(query=np.concatenate([q_nope, q_pe], axis=2).reshape(N, H * D_NA),
                  key=k_new.astype(f32).reshape(N, H * D_NA), value=v_new.astype(f32).reshape(N, H * D_NA),
                  key_cache=k_na, value_cache=v_na, **common)
    na_attrs = dict(num_heads=H, kv_num_heads=H, scale=SCALE, do_rotary=1, rotary_offset=NOPE,
                    rotary_interleaved=int(interleaved))
    return dict(absorbed=absorbed, abs_attrs=abs_attrs, nonabs=nonabs, na_attrs=na_attrs, W_UV=W_UV, N=N,
                bt=bt, past=past, q_lens=q_lens, bs=bs)


@pytest.mark.parametrize("interleaved", [False, True])
def test_absorbed_equals_non_absorbed(rng, interleaved):
    m = _mla_problem(rng, interleaved=interleaved)
    N = m["N"]
    out_abs = cupa.paged_attention(**m["absorbed"], **m["abs_attrs"])
    out_na = cupa.paged_attention(**m["nonabs"], **m["na_attrs"])
    assert out_abs.shape == (N, H * DV_ABS) and out_na.shape == (N, H * D_NA)
    proj = np.einsum("hvr,nhr->nhv", m["W_UV"], out_abs.reshape(N, H, DV_ABS).astype(np.float64))
    ref = out_na.reshape(N, H, D_NA)[:, :, :DV_NA].astype(np.float64)
    util.assert_rel(proj, ref, "float32")
    # the written latent rows carry the same rotated k_pe as every non-absorbed head
    slots = util.derived_slots(m["absorbed"], m["bs"])
    lat = m["absorbed"]["key_cache"].reshape(-1, D_ABS)[slots]
    kna = m["nonabs"]["key_cache"].reshape(-1, H, D_NA)[slots]
    for h in range(H):
        np.testing.assert_array_equal(lat[:, R:], kna[:, h, NOPE:])
    np.testing.assert_array_equal(lat[:, :R], m["absorbed"]["key"][:, :R])


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("interleaved", [False, True])
def test_in_op_offset_rope_equals_pre_applied(rng, dtype, interleaved):
    case = util.make_case(rng, latent=True, num_heads=H, head_size=D_ABS, v_head_size=DV_ABS, scale=SCALE,
                          rotary="interleaved" if interleaved else "half", rotary_offset=R, rotary_dim=ROPE,
                          q_lens=(2, 0, 3), past=(4, 2, 1), block_size=4, dtype=dtype)
    T = util.T_DTYPES[dtype]
    pre = case.copy()
    pos = case.info["positions"]
    cos, sin = case.inputs["cos_cache"][pos], case.inputs["sin_cache"][pos]
    N = case.token_count
    q = case.inputs["query"].reshape(N, H, D_ABS)
    pre.inputs["query"] = util.apply_rope(q, cos[:, None, :], sin[:, None, :], R, interleaved).astype(T).reshape(N, -1)
    pre.inputs["key"] = util.apply_rope(case.inputs["key"], cos, sin, R, interleaved).astype(T)
    pre.inputs["cos_cache"] = pre.inputs["sin_cache"] = None
    for k in ("do_rotary", "rotary_interleaved", "rotary_offset"):
        pre.attrs.pop(k, None)
    out_in_op, out_pre = case.run(), pre.run()
    np.testing.assert_array_equal(out_in_op.view(np.uint8), out_pre.view(np.uint8))
    np.testing.assert_array_equal(case.inputs["key_cache"].view(np.uint8), pre.inputs["key_cache"].view(np.uint8))


def test_v_aliases_leading_channels_of_k(rng):
    Dv = 48
    case = util.make_case(rng, latent=True, num_heads=H, head_size=64, v_head_size=Dv, scale=0.2, qk_output=2,
                          cache="int8", k_quant="PER_CHANNEL", q_lens=(2, 3), past=(5, 0), block_size=4)
    out, probs = case.run()
    kc = case.inputs["key_cache"]
    ks = case.inputs["k_scale"]
    bt, bs = case.inputs["block_table"], 4
    owner = np.repeat(np.arange(2), case.q_lens)
    N = case.token_count
    expect = np.zeros((N, H, Dv))
    for t in range(N):
        b = owner[t]
        for k in range(probs.shape[2]):
            if probs[:, t, k].any():
                row = kc[bt[b, k // bs], k % bs, 0].astype(np.float64) * ks[0, 0].astype(np.float64)
                expect[t] += probs[:, t, k, None].astype(np.float64) * row[None, :Dv]
    np.testing.assert_allclose(out.reshape(N, H, Dv).astype(np.float64), expect, rtol=5e-3, atol=2e-3)


def test_mla_paging_fp8_latent_matches_dense(rng):
    case = util.make_case(rng, latent=True, num_heads=2, head_size=D_ABS, v_head_size=DV_ABS, scale=SCALE,
                          rotary="interleaved", rotary_offset=R, rotary_dim=ROPE, cache="fp8_bytes",
                          k_quant="PER_CHANNEL", slot_mapping="skip", q_lens=(2, 1, 3), past=(6, 0, 3),
                          block_size=4, dtype="bfloat16")
    util.check_against_dense(case, case.run(), util.dense_attention(case))


def _latent_kwargs(rng, **over):
    case = util.make_case(rng, latent=True, num_heads=H, head_size=D_ABS, v_head_size=DV_ABS, scale=SCALE,
                          q_lens=(1, 2), past=(3, 0), block_size=4, dtype="float32")
    kw = case.kwargs()
    kw.update(over)
    return kw, case


def test_scale_guard(rng):
    kw, _ = _latent_kwargs(rng)
    kw.pop("scale")
    with pytest.raises(cupa.PagedAttentionError, match="scale"):
        cupa.paged_attention(**kw)


def test_value_cache_rejected_in_latent(rng):
    kw, case = _latent_kwargs(rng)
    with pytest.raises(cupa.PagedAttentionError, match="value_cache"):
        cupa.paged_attention(**kw, value_cache=case.inputs["key_cache"])       # even the same tensor
    with pytest.raises(cupa.PagedAttentionError, match="value_cache"):
        cupa.paged_attention(**kw, value_cache=case.inputs["key_cache"].copy())


def test_other_latent_rejections(rng):
    kw, case = _latent_kwargs(rng)
    N = case.token_count
    with pytest.raises(cupa.PagedAttentionError, match="value"):
        cupa.paged_attention(**kw, value=np.ones((N, D_ABS), np.float32))
    with pytest.raises(cupa.PagedAttentionError, match="head_sink"):
        cupa.paged_attention(**kw, head_sink=np.ones(H, np.float32))
    with pytest.raises(cupa.PagedAttentionError, match="norm_weight"):
        cupa.paged_attention(**kw, q_norm_weight=np.ones(D_ABS, np.float32), k_norm_weight=np.ones(D_ABS, np.float32))
