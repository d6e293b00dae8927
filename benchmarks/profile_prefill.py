"""A few prefill calls of one shape, for a profiler (ncu) to look at.

    ncu --clock-control none -k regex:paged_prefill -c 1 --set full python benchmarks/profile_prefill.py
"""

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import cupa  # noqa: E402
from bench_prefill import H, HK, make_case  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--B", type=int, default=4)
    ap.add_argument("--q", type=int, default=2048)
    ap.add_argument("--past", type=int, default=0)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--cache", default="T")
    ap.add_argument("--calls", type=int, default=2)
    args = ap.parse_args()
    import cupy as cp

    inputs, attrs = make_case(cp, args.B, args.q, args.past, args.block, args.dtype, args.cache)
    op = cupa.PagedAttention(num_heads=H, kv_num_heads=HK, **attrs)
    md = np.array([args.q, args.past + args.q], dtype=np.int32)
    for _ in range(args.calls):
        op(**inputs, attention_metadata=md)
    cp.cuda.get_current_stream().synchronize()
    print(op.explain(**inputs, attention_metadata=md))


if __name__ == "__main__":
    main()
