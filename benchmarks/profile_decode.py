"""A few decode calls of one shape, for a profiler (ncu) to look at.

    ncu --clock-control none -k regex:paged_decode -c 2 python benchmarks/profile_decode.py --B 64 --L 4096
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import cupa  # noqa: E402
from cupa.bench.cases import build, decode  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--B", type=int, default=64)
    ap.add_argument("--L", type=int, default=4096)
    ap.add_argument("--H", type=int, default=32)
    ap.add_argument("--Hk", type=int, default=8)
    ap.add_argument("--cache", default="T", choices=("T", "int8", "fp8"))
    ap.add_argument("--quant", default="PER_CHANNEL", choices=("PER_CHANNEL", "PER_TENSOR"))
    ap.add_argument("--calls", type=int, default=3)
    args = ap.parse_args()
    import cupy as cp

    built = build(decode(args.B, args.L, num_heads=args.H, kv_num_heads=args.Hk, cache=args.cache,
                         quant=args.quant), cp)
    op = cupa.PagedAttention(**built.attributes)
    inputs = built.call_inputs()
    for _ in range(args.calls):
        op(**inputs)
    cp.cuda.get_current_stream().synchronize()
    print(op.explain(**inputs))


if __name__ == "__main__":
    main()
