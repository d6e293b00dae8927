"""A few prefill calls of one shape, for a profiler (ncu) to look at.

    ncu --clock-control none -k regex:paged_prefill -c 1 --set full python benchmarks/profile_prefill.py
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import cupa  # noqa: E402
from cupa.bench.cases import build, chunked, prefill  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--B", type=int, default=4)
    ap.add_argument("--q", type=int, default=2048)
    ap.add_argument("--past", type=int, default=0)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--cache", default="T", choices=("T", "int8", "fp8"))
    ap.add_argument("--calls", type=int, default=2)
    args = ap.parse_args()
    import cupy as cp

    kw = dict(block_size=args.block, dtype=args.dtype, cache=args.cache)
    case = chunked(args.B, args.past, args.q, **kw) if args.past else prefill(args.B, args.q, **kw)
    built = build(case, cp)
    op = cupa.PagedAttention(**built.attributes)
    inputs = built.call_inputs()
    for _ in range(args.calls):
        op(**inputs)
    cp.cuda.get_current_stream().synchronize()
    print(op.explain(**inputs))


if __name__ == "__main__":
    main()
