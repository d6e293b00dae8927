"""MLA benchmark (kv_cache_layout LATENT, 576/512, one latent head, block 64): the whole call timed.

The cases of the MLA issue: fp16 decode at H=128 (B=64 x 4096: compute-bound; B=8 x 8192), at H=16
(memory-bound), an fp8 latent at H=16, and a chunked prefill of 4 sequences x (4096 cached + 512 new)
at H=128. Block tables are as wide as the longest sequence; attention_metadata carries tight bounds.
L2 is cold before each run (benchmarks/common.py); the read roofline is measured in the same run.
Floors: latent bytes at the roofline and FLOPs (2 * (576 + 512) per key, row) at the tensor-core rate
given by --tflops. Each case runs the kernel the backend chooses; --portable adds the mma.sync kernel
on compute capability 9.0 (Options._tuning.mla_wgmma=False) beside it.

    python benchmarks/bench_mla.py --out benchmarks/results/mla.json [--quick] [--portable]
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import cupa  # noqa: E402
from cupa.options import _Tuning  # noqa: E402
from common import Timer, environment, read_roofline, write_json  # noqa: E402

D, DV, BLOCK = 576, 512, 64
#: The MLA issue's targets and peers on the H200 (us; TFLOP/s for the prefill).
TARGETS = {
    "fp16 H=128 B=64 L=4096": {"target_us": 105, "flashinfer_mla_us": 151, "onnxruntime_unfused_us": 59734},
    "fp16 H=128 B=8 L=8192": {"target_us": 35, "flashinfer_mla_us": 58, "onnxruntime_unfused_us": 14328},
    "fp16 H=16 B=64 L=4096": {"target_us": 75},
    "fp8 H=16 B=64 L=4096": {"target_us": 42},
    "chunked prefill H=128 4x(4096+512)": {"target_tflops": 450},
}


def make_case(cp, rng, B, past, q_len, H, cache):
    """Device inputs: B sequences of `past` cached + `q_len` new tokens, shuffled blocks."""
    L = past + q_len
    per_seq = -(-L // BLOCK)
    num_blocks = B * per_seq
    N = B * q_len
    bt = rng.permutation(num_blocks).astype(np.int32).reshape(B, per_seq)
    f = cp.float16
    inputs = {"query": cp.random.standard_normal((N, H * D), dtype=cp.float32).astype(f),
              "key": cp.random.standard_normal((N, D), dtype=cp.float32).astype(f),
              "cumulative_sequence_length": cp.asarray(np.arange(B + 1, dtype=np.int32) * q_len),
              "past_seqlens": cp.full((B,), past, dtype=cp.int32), "block_table": cp.asarray(bt)}
    attrs = dict(num_heads=H, kv_num_heads=1, kv_cache_layout="LATENT", v_head_size=DV, scale=0.1147)
    shape = (num_blocks, BLOCK, 1, D)
    if cache == "fp8":
        # e4m3 codes up to +-240 (no NaN codes), scale 1/64
        mag = cp.random.randint(0, 0x78, size=shape, dtype=cp.int32)
        sign = cp.random.randint(0, 2, size=shape, dtype=cp.int32) << 7
        inputs["key_cache"] = (mag | sign).astype(cp.uint8)
        inputs["k_scale"] = cp.full((1,), 1 / 64, dtype=cp.float32)
        attrs.update(k_quant_type="PER_TENSOR", k_cache_dtype="float8e4m3fn")
        elem = 1
    else:
        inputs["key_cache"] = cp.random.standard_normal(shape, dtype=cp.float32).astype(f)
        elem = 2
    md = np.array([q_len, L], dtype=np.int32)
    kv_bytes = B * L * D * elem
    flops = 2 * (D + DV) * H * B * (q_len * past + q_len * (q_len + 1) // 2)
    return inputs, attrs, md, kv_bytes, flops


def bench(cp, timer, inputs, attrs, md, options, reps):
    op = cupa.PagedAttention(**attrs, options=options)
    N = inputs["query"].shape[0]
    out = cp.empty((N, attrs["num_heads"] * DV), dtype=cp.float16)

    def call():
        op(**inputs, attention_metadata=md, out=out)

    res = timer.time_us(call, reps=reps)
    res["explain"] = op.explain(**inputs, attention_metadata=md)
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/mla.json")
    ap.add_argument("--quick", action="store_true", help="fewer reps")
    ap.add_argument("--portable", action="store_true", help="also time the mma.sync kernel on compute capability 9.0")
    ap.add_argument("--tflops", type=float, default=790.0, help="tensor-core rate of the compute floor (TFLOP/s)")
    ap.add_argument("--only", default="", help="comma-separated substrings of case names")
    args = ap.parse_args(argv)
    import cupy as cp

    rng = np.random.default_rng(0)
    reps = 10 if args.quick else 30
    timer = Timer(cp)
    roof = read_roofline(cp, timer)
    cases = [
        ("fp16 H=128 B=64 L=4096", 64, 4095, 1, 128, "T"),
        ("fp16 H=128 B=8 L=8192", 8, 8191, 1, 128, "T"),
        ("fp16 H=16 B=64 L=4096", 64, 4095, 1, 16, "T"),
        ("fp8 H=16 B=64 L=4096", 64, 4095, 1, 16, "fp8"),
        ("chunked prefill H=128 4x(4096+512)", 4, 4096, 512, 128, "T"),
    ]
    if args.only:
        cases = [c for c in cases if any(part and part in c[0] for part in args.only.split(","))]
    paths = [("chosen", cupa.Options(backend="mla"))]
    if args.portable and cp.cuda.Device().compute_capability == "90":
        paths.append(("mma.sync", cupa.Options(backend="mla", _tuning=_Tuning(mla_wgmma=False))))
    results = []
    best_bw = roof["tb_per_s"]
    for name, B, past, q_len, H, cache in cases:
        inputs, attrs, md, kv_bytes, flops = make_case(cp, rng, B, past, q_len, H, cache)
        row = {"case": name, "B": B, "past": past, "q_len": q_len, "H": H, "cache": cache, "block_size": BLOCK,
               "kv_bytes": kv_bytes, "flops": flops, "targets": TARGETS.get(name)}
        for label, options in paths:
            r = bench(cp, timer, inputs, attrs, md, options, reps)
            r["tb_per_s"] = kv_bytes / r["median_us"] / 1e6
            r["tflops"] = flops / r["median_us"] / 1e6
            best_bw = max(best_bw, r["tb_per_s"])
            row[label] = r
        results.append(row)
        del inputs
        cp.get_default_memory_pool().free_all_blocks()
    for row in results:
        row["memory_floor_us"] = row["kv_bytes"] / best_bw / 1e6
        row["compute_floor_us"] = row["flops"] / args.tflops / 1e6
    payload = {"benchmark": "mla", "environment": environment(cp), "flush": timer.mode, "read_probe": roof,
               "roofline_tb_per_s": best_bw, "compute_floor_tflops": args.tflops, "results": results}
    write_json(args.out, payload)
    print(f"read probe {roof['tb_per_s']:.2f} TB/s; roofline used {best_bw:.2f} TB/s; compute floor at "
          f"{args.tflops:.0f} TFLOP/s")
    head = (f"{'case':36s} {'path':9s} {'us':>9s} {'TB/s':>6s} {'TFLOP/s':>8s} {'mem floor':>9s} "
            f"{'flop floor':>10s}  target")
    print(head)
    for row in results:
        for label, _ in paths:
            r = row[label]
            print(f"{row['case']:36s} {label:9s} {r['median_us']:9.1f} {r['tb_per_s']:6.2f} {r['tflops']:8.1f} "
                  f"{row['memory_floor_us']:9.1f} {row['compute_floor_us']:10.1f}  {row['targets']}")


if __name__ == "__main__":
    main()
