"""The general backend's targets (attention_bias, output_qk): the whole call timed, L2 cold, same run as its
fused references.

- prefill: causal B=4 x 2048 new tokens, fp16 GQA 32/8 D=128, block 16, a full (B, H, 2048, 2048) fp16
  attention_bias: TFLOP/s (causal FLOPs = 4*H*D*sum_b(q_b*(q_b+1)/2)); target >= 150. Beside it the same call
  without bias on the library's own choice (the fused prefill) and on the general backend.
- decode: B=8, L=8192, fp16 GQA 32/8 D=128, block 16, qk_output=2 (probabilities into a (32, 8, 8192) float32
  output_qk): target <= 1.5 x (the fused decode call without output_qk + output_qk's bytes at the write
  bandwidth measured in the same run, a 2 GiB CuPy fill). Beside it qk_output=1 and a bias-only decode.
- informative: LATENT 576/512, H=16, B=8, L=4096, block 64, with a (1, 1, 1, 4096) bias (CUDA-core kernel).

    python benchmarks/bench_general.py --out benchmarks/results/general.json [--quick]
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import cupa  # noqa: E402
import bench_decode  # noqa: E402
import bench_prefill  # noqa: E402
from common import Timer, environment, read_roofline, write_json  # noqa: E402

H, HK, D = 32, 8, 128
PREFILL_TARGET_TFLOPS = 150.0
DECODE_TARGET_RATIO = 1.5
GENERAL = cupa.Options(backend="general")


def write_bandwidth(cp, timer, nbytes: int = 2 << 30) -> dict:
    """Bytes written per second by a CuPy fill of ``nbytes`` (TB/s)."""
    x = cp.empty(nbytes, dtype=cp.uint8)
    t = timer.time_us(lambda: x.fill(7), reps=20)
    del x
    return {"bytes": nbytes, "median_us": t["median_us"], "tb_per_s": nbytes / t["median_us"] / 1e6}


def time_call(cp, timer, op, args, kwargs, reps):
    """The median time of ``op(*args, **kwargs)`` with explain()'s account of the backend."""
    res = timer.time_us(lambda: op(*args, **kwargs), reps=reps)
    text = op.explain(*args, **{k: v for k, v in kwargs.items() if k != "out"})
    res["backend"] = next(line.split(":")[0] for line in text.splitlines() if ": chosen" in line)
    res["explain"] = text
    return res


def bench_prefill_bias(cp, timer, reps, block_size=16):
    B, q = 4, 2048
    inputs, attrs = bench_prefill.make_case(cp, B, q, 0, block_size, "float16", "T")
    rs = cp.random.RandomState(1)
    bias = rs.standard_normal((B, H, q, q), dtype=cp.float32).astype(cp.float16)
    md = np.array([q, q], dtype=np.int32)
    out = cp.empty_like(inputs["query"])
    flops = bench_prefill.causal_flops(B, q, 0)
    rows = {}
    for name, options, extra in (("general_bias", GENERAL, {"attention_bias": bias}),
                                 ("general_no_bias", GENERAL, {}), ("fused_no_bias", None, {})):
        op = cupa.PagedAttention(num_heads=H, kv_num_heads=HK, options=options, **attrs)
        r = time_call(cp, timer, op, (), dict(inputs, attention_metadata=md, out=out, **extra), reps)
        r["tflops"] = flops / r["median_us"] / 1e6
        rows[name] = r
    del bias, inputs
    cp.get_default_memory_pool().free_all_blocks()
    return {"case": f"prefill causal B=4x2048 fp16 32/8 D=128 block {block_size}, full bias", "causal_flops": flops,
            "bias_bytes_read_causal": B * H * q * (q + 1) // 2 * 2, **rows,
            "target_tflops": PREFILL_TARGET_TFLOPS,
            "meets_target": rows["general_bias"]["tflops"] >= PREFILL_TARGET_TFLOPS,
            "bias_cost_vs_general_no_bias": rows["general_bias"]["median_us"] / rows["general_no_bias"]["median_us"]}


def bench_decode_qk(cp, timer, reps, write_bw):
    B, L = 8, 8192
    case = bench_decode.make_case(cp, B, L, H, HK, D, 16)
    extra = dict(case["extra"])
    md = np.array([1, L], dtype=np.int32)
    args = (case["q"], case["k"], case["v"], case["kc"], case["vc"], case["cum"], case["past"], case["bt"])
    out = cp.empty_like(case["q"])
    fused = time_call(cp, timer, cupa.PagedAttention(num_heads=H, kv_num_heads=HK, **extra), args,
                      dict(attention_metadata=md, out=out), reps)
    qk_bytes = H * B * L * 4
    floor_us = fused["median_us"] + qk_bytes / write_bw["tb_per_s"] / 1e6
    rows = {"fused_no_qk": fused}
    bias = cp.random.RandomState(2).standard_normal((B, H, 1, L), dtype=cp.float32).astype(cp.float16)
    for name, attributes, inputs in (("general_qk2", dict(qk_output=2), {}), ("general_qk1", dict(qk_output=1), {}),
                                     ("general_bias", {}, {"attention_bias": bias}), ("general_plain", {}, {})):
        op = cupa.PagedAttention(num_heads=H, kv_num_heads=HK, options=GENERAL, **attributes, **extra)
        r = time_call(cp, timer, op, args, dict(attention_metadata=md, out=out, **inputs), reps)
        r["ratio_to_floor"] = r["median_us"] / floor_us
        rows[name] = r
    del case, bias
    cp.get_default_memory_pool().free_all_blocks()
    return {"case": "decode B=8 L=8192 fp16 32/8 D=128 block 16, qk_output=2", "kv_bytes": 2 * B * L * HK * D * 2,
            "output_qk_bytes": qk_bytes, "floor_us": floor_us, **rows, "target_ratio": DECODE_TARGET_RATIO,
            "meets_target": rows["general_qk2"]["median_us"] <= DECODE_TARGET_RATIO * floor_us}


def bench_latent_bias(cp, timer, reps):
    B, L, Hl, Dl, Dv, bs = 8, 4096, 16, 576, 512, 64
    rs = cp.random.RandomState(3)
    blocks = B * L // bs
    kc = rs.standard_normal((blocks, bs, 1, Dl), dtype=cp.float32).astype(cp.float16)
    bt = cp.asarray(np.random.default_rng(3).permutation(blocks).astype(np.int32).reshape(B, L // bs))
    q = rs.standard_normal((B, Hl * Dl), dtype=cp.float32).astype(cp.float16)
    k = rs.standard_normal((B, Dl), dtype=cp.float32).astype(cp.float16)
    bias = rs.standard_normal((1, 1, 1, L), dtype=cp.float32).astype(cp.float16)
    op = cupa.PagedAttention(num_heads=Hl, kv_num_heads=1, kv_cache_layout="LATENT", v_head_size=Dv, scale=0.07,
                             options=GENERAL)
    kwargs = dict(query=q, key=k, key_cache=kc, cumulative_sequence_length=cp.arange(B + 1, dtype=cp.int32),
                  past_seqlens=cp.full((B,), L - 1, dtype=cp.int32), block_table=bt, attention_bias=bias,
                  attention_metadata=np.array([1, L], dtype=np.int32))
    r = time_call(cp, timer, op, (), kwargs, reps)
    r["latent_bytes"] = B * L * Dl * 2
    return {"case": "LATENT 576/512 H=16 B=8 L=4096 block 64, (1, 1, 1, 4096) bias", "general": r}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/general.json")
    ap.add_argument("--quick", action="store_true", help="fewer reps")
    args = ap.parse_args(argv)
    import cupy as cp

    reps = 10 if args.quick else 30
    timer = Timer(cp)
    roof = read_roofline(cp, timer)
    write_bw = write_bandwidth(cp, timer)
    prefill = bench_prefill_bias(cp, timer, reps)
    decode = bench_decode_qk(cp, timer, reps, write_bw)
    latent = bench_latent_bias(cp, timer, reps)
    write_json(args.out, {"benchmark": "general", "environment": environment(cp), "read_probe": roof,
                          "write_bandwidth": write_bw, "results": [prefill, decode, latent]})
    print(f"read probe {roof['tb_per_s']:.2f} TB/s, write (CuPy fill) {write_bw['tb_per_s']:.2f} TB/s")
    p = prefill
    print(f"{p['case']}: general {p['general_bias']['median_us']:.1f} us = {p['general_bias']['tflops']:.1f} TFLOP/s "
          f"(target >= {PREFILL_TARGET_TFLOPS:.0f}: {'met' if p['meets_target'] else 'NOT met'}); without bias: general "
          f"{p['general_no_bias']['tflops']:.1f}, {p['fused_no_bias']['backend']} {p['fused_no_bias']['tflops']:.1f}")
    d = decode
    print(f"{d['case']}: general {d['general_qk2']['median_us']:.1f} us, floor {d['floor_us']:.1f} us (fused "
          f"{d['fused_no_qk']['median_us']:.1f} us + output_qk write), ratio {d['general_qk2']['ratio_to_floor']:.2f} "
          f"(target <= {DECODE_TARGET_RATIO}: {'met' if d['meets_target'] else 'NOT met'}); qk_output=1 "
          f"{d['general_qk1']['median_us']:.1f} us, bias only {d['general_bias']['median_us']:.1f} us, plain "
          f"{d['general_plain']['median_us']:.1f} us")
    print(f"{latent['case']}: {latent['general']['median_us']:.1f} us")


if __name__ == "__main__":
    main()
