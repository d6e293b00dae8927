"""A few decode calls of one shape, for a profiler (ncu) to look at.

    ncu --clock-control none -k regex:paged_decode -c 2 python benchmarks/profile_decode.py --B 64 --L 4096
"""

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import cupa  # noqa: E402
from bench_decode import make_case  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--B", type=int, default=64)
    ap.add_argument("--L", type=int, default=4096)
    ap.add_argument("--H", type=int, default=32)
    ap.add_argument("--Hk", type=int, default=8)
    ap.add_argument("--cache", default="float16")
    ap.add_argument("--calls", type=int, default=3)
    args = ap.parse_args()
    import cupy as cp

    case = make_case(cp, args.B, args.L, args.H, args.Hk, 128, 16, args.cache)
    extra = dict(case["extra"])
    scales = {k: extra.pop(k) for k in ("k_scale", "v_scale") if k in extra}
    op = cupa.PagedAttention(num_heads=args.H, kv_num_heads=args.Hk, **extra)
    md = np.array([1, args.L], dtype=np.int32)
    for _ in range(args.calls):
        op(case["q"], case["k"], case["v"], case["kc"], case["vc"], case["cum"], case["past"], case["bt"],
           attention_metadata=md, **scales)
    cp.cuda.get_current_stream().synchronize()
    print(op.explain(case["q"], case["k"], case["v"], case["kc"], case["vc"], case["cum"], case["past"],
                     case["bt"], attention_metadata=md, **scales))


if __name__ == "__main__":
    main()
