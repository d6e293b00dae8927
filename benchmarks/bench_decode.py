"""Decode benchmark: one new token per sequence over a paged cache, the whole call timed.

Shapes of contract §7 (fp16, GQA 32/8, D=128, block 16) plus MHA 32/32 and GQA 64/8, int8 and
fp8 PER_CHANNEL caches, and a call without attention_metadata. Block tables are sized for twice
the longest sequence, as a server sizes them for its maximum length. L2 is cold before each run:
flushed by a 2 GiB write and read (cold and clean, as input rotation leaves it; the headline), and
again by a 2 GiB memset (cold, full of dirty lines whose write-back lands in the call; reported
beside it, the method of sessions 1-9). The read roofline is measured in the same run. Peers: torch SDPA on
a dense cache, timed both ways.

    python benchmarks/bench_decode.py --out benchmarks/results/decode.json [--quick]
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import cupa  # noqa: E402
from common import Timer, environment, read_roofline, write_json  # noqa: E402

# contract §7: the peers measured on the same kind of machine (us).
SPEC_PEERS = {
    "gqa32/8 B=64 L=4096": {"onnxruntime_cuda": 322, "flashinfer_0.6.7": 288, "target_us": 275},
    "gqa32/8 B=16 L=32768": {"onnxruntime_cuda": 575, "flashinfer_0.6.7": 547, "target_us": 530},
    "gqa32/8 B=8 L=8192": {"onnxruntime_cuda": 117, "flashinfer_0.6.7": 108, "target_us": 80},
    "int8 per-channel B=64 L=4096": {"onnxruntime_cuda": 6046, "target_us": 150},
    "fp8 per-channel B=64 L=4096": {"flashinfer_0.6.7": 252, "target_us": 150},
    "no metadata B=8 L=8192": {"onnxruntime_cuda": 2867},
}


def make_case(cp, B, L, H, Hk, D, block_size, cache="float16", rng_seed=0):
    rs = cp.random.RandomState(rng_seed)
    blocks_per_seq = math.ceil(L / block_size)
    num_blocks = B * blocks_per_seq
    shape = (num_blocks, block_size, Hk, D)
    if cache == "float16":
        kc = rs.standard_normal(shape, dtype=cp.float32).astype(cp.float16)
        vc = rs.standard_normal(shape, dtype=cp.float32).astype(cp.float16)
        extra = {}
    else:
        def codes():
            if cache == "int8":
                return rs.randint(-127, 128, size=shape, dtype=cp.int32).astype(cp.int8)
            mag = rs.randint(0, 0x7F, size=shape, dtype=cp.int32).astype(cp.uint8)  # 0x7F is NaN
            sign = (rs.randint(0, 2, size=shape, dtype=cp.int32).astype(cp.uint8) << 7)
            return mag | sign
        kc, vc = codes(), codes()
        qmax = 127.0 if cache == "int8" else 448.0
        ks = (rs.uniform(0.5, 1.5, size=(Hk, 1, D)).astype(cp.float32) * 3.0 / qmax).astype(cp.float32)
        vs = (rs.uniform(0.5, 1.5, size=(Hk, 1, D)).astype(cp.float32) * 3.0 / qmax).astype(cp.float32)
        extra = {"k_scale": ks, "v_scale": vs, "k_quant_type": "PER_CHANNEL", "v_quant_type": "PER_CHANNEL"}
        if cache == "fp8":
            extra.update(k_cache_dtype="float8e4m3fn", v_cache_dtype="float8e4m3fn")
    perm = cp.asarray(np.random.default_rng(rng_seed).permutation(num_blocks).astype(np.int32))
    bt = cp.full((B, 2 * blocks_per_seq), -1, dtype=cp.int32)
    bt[:, :blocks_per_seq] = perm.reshape(B, blocks_per_seq)
    q = rs.standard_normal((B, H * D), dtype=cp.float32).astype(cp.float16)
    k = rs.standard_normal((B, Hk * D), dtype=cp.float32).astype(cp.float16)
    v = rs.standard_normal((B, Hk * D), dtype=cp.float32).astype(cp.float16)
    cum = cp.arange(B + 1, dtype=cp.int32)
    past = cp.full((B,), L - 1, dtype=cp.int32)
    kv_bytes = 2 * B * L * Hk * D * kc.itemsize
    return dict(q=q, k=k, v=v, kc=kc, vc=vc, cum=cum, past=past, bt=bt, extra=extra, kv_bytes=kv_bytes)


def bench_cupa(cp, timer, case, H, Hk, L, metadata=True, reps=30, mode=None):
    extra = dict(case["extra"])
    scales = {k: extra.pop(k) for k in ("k_scale", "v_scale") if k in extra}
    op = cupa.PagedAttention(num_heads=H, kv_num_heads=Hk, **extra)
    md = np.array([1, L], dtype=np.int32) if metadata else None
    out = cp.empty_like(case["q"])

    def call():
        op(case["q"], case["k"], case["v"], case["kc"], case["vc"], case["cum"], case["past"], case["bt"],
           attention_metadata=md, out=out, **scales)

    res = timer.time_us(call, reps=reps, mode=mode)
    res["explain"] = op.explain(case["q"], case["k"], case["v"], case["kc"], case["vc"], case["cum"],
                                case["past"], case["bt"], attention_metadata=md, **scales)
    return res


def bench_sdpa(timer, B, L, H, Hk, D, reps=30, modes=("read",)):
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return None
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, H, 1, D, device="cuda", dtype=torch.float16, generator=g)
    k = torch.randn(B, Hk, L, D, device="cuda", dtype=torch.float16, generator=g)
    v = torch.randn(B, Hk, L, D, device="cuda", dtype=torch.float16, generator=g)

    def call():
        F.scaled_dot_product_attention(q, k, v, enable_gqa=(H != Hk))

    # torch runs on its own current stream; time it on that stream.
    import cupy as cp

    with cp.cuda.Stream.from_external(torch.cuda.current_stream()) if hasattr(cp.cuda.Stream, "from_external") \
            else cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
        res = {m: timer.time_us(call, reps=reps, mode=m) for m in modes}
    del q, k, v
    torch.cuda.empty_cache()
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/decode.json")
    ap.add_argument("--quick", action="store_true", help="fewer reps and cases (smoke run)")
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--only", default="", help="comma-separated substrings: run the cases whose name has one")
    args = ap.parse_args(argv)
    import cupy as cp

    reps = 10 if args.quick else 30
    timer = Timer(cp)
    roof = read_roofline(cp, timer)
    roof_memset = read_roofline(cp, timer, mode="memset")
    D, bs = 128, 16
    cases = [
        ("gqa32/8 B=64 L=4096", 64, 4096, 32, 8, "float16", True),
        ("gqa32/8 B=16 L=32768", 16, 32768, 32, 8, "float16", True),
        ("gqa32/8 B=8 L=8192", 8, 8192, 32, 8, "float16", True),
        ("no metadata B=8 L=8192", 8, 8192, 32, 8, "float16", False),
        ("int8 per-channel B=64 L=4096", 64, 4096, 32, 8, "int8", True),
        ("fp8 per-channel B=64 L=4096", 64, 4096, 32, 8, "fp8", True),
        ("mha32/32 B=16 L=4096", 16, 4096, 32, 32, "float16", True),
        ("gqa64/8 B=32 L=4096", 32, 4096, 64, 8, "float16", True),
    ]
    if args.quick:
        cases = [c for c in cases if c[0] in ("gqa32/8 B=64 L=4096", "gqa32/8 B=8 L=8192",
                                              "no metadata B=8 L=8192", "int8 per-channel B=64 L=4096")]
    if args.only:
        cases = [c for c in cases if any(part and part in c[0] for part in args.only.split(","))]
    results = []
    best_bw = 0.0
    for name, B, L, H, Hk, cache, md in cases:
        case = make_case(cp, B, L, H, Hk, D, bs, cache)
        r = bench_cupa(cp, timer, case, H, Hk, L, metadata=md, reps=reps)
        rm = bench_cupa(cp, timer, case, H, Hk, L, metadata=md, reps=reps, mode="memset")
        rm.pop("explain", None)
        row = {"case": name, "B": B, "L": L, "H": H, "Hk": Hk, "D": D, "block_size": bs, "cache": cache,
               "attention_metadata": md, "kv_bytes": case["kv_bytes"], "cupa": r, "cupa_memset_flush": rm,
               "cupa_tb_per_s": case["kv_bytes"] / r["median_us"] / 1e6, "spec_peers_us": SPEC_PEERS.get(name)}
        best_bw = max(best_bw, row["cupa_tb_per_s"])
        del case
        cp.get_default_memory_pool().free_all_blocks()
        if not args.no_peers and cache == "float16" and md:
            s = bench_sdpa(timer, B, L, H, Hk, D, reps=reps, modes=("read", "memset"))
            if s is not None:
                row["torch_sdpa_dense"] = s["read"]
                row["torch_sdpa_dense_memset_flush"] = s["memset"]
                row["sdpa_tb_per_s"] = row["kv_bytes"] / s["read"]["median_us"] / 1e6
                best_bw = max(best_bw, row["sdpa_tb_per_s"])
        results.append(row)
    roofline = max(roof["tb_per_s"], best_bw)
    for row in results:
        row["floor_us"] = row["kv_bytes"] / roofline / 1e6
        row["fraction_of_roofline"] = row["cupa_tb_per_s"] / roofline
    payload = {"benchmark": "decode", "environment": environment(cp), "flush": timer.mode,
               "read_probe": roof, "read_probe_memset_flush": roof_memset, "roofline_tb_per_s": roofline,
               "results": results}
    write_json(args.out, payload)
    print(f"read probe {roof['tb_per_s']:.2f} TB/s ({roof_memset['tb_per_s']:.2f} after a memset flush); "
          f"roofline used {roofline:.2f} TB/s")
    print("L2 flushed by a write and a read before each run (cold, clean); (m): by a memset alone, which "
          "leaves dirty lines for the call to write back")
    print(f"{'case':34s} {'cupa us':>9s} {'(m)':>7s} {'TB/s':>6s} {'roof%':>6s} {'floor':>7s} {'sdpa us':>8s} "
          f"{'(m)':>7s} {'target':>7s}")

    def us(r):
        return "-" if r is None else f"{r['median_us']:.1f}"

    for row in results:
        tgt = (row["spec_peers_us"] or {}).get("target_us")
        print(f"{row['case']:34s} {row['cupa']['median_us']:9.1f} {us(row['cupa_memset_flush']):>7s} "
              f"{row['cupa_tb_per_s']:6.2f} {100 * row['fraction_of_roofline']:5.1f}% {row['floor_us']:7.1f} "
              f"{us(row.get('torch_sdpa_dense')):>8s} {us(row.get('torch_sdpa_dense_memset_flush')):>7s} {tgt!s:>7s}")


if __name__ == "__main__":
    main()
