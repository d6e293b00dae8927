"""A few calls of each MLA decode target, for a profiler (ncu) to look at.

    ncu --clock-control none -k regex:paged_mla -c 8 python benchmarks/profile_mla.py [--waves 2]
    CUPA_CACHE_DIR=/tmp/li ncu --section SourceCounters --page source --print-source cuda --csv \
        -k regex:paged_mla_mma -c 1 python benchmarks/profile_mla.py --cases h16 --calls 1 --lineinfo

Each target runs ``--calls`` times (the first compiles), under ``Options(backend="mla")`` and the split
plan of ``Options._tuning.mla_waves``; the explain() line of each is printed last.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import cupa  # noqa: E402
from cupa.bench import cases as C  # noqa: E402
from cupa.options import _Tuning  # noqa: E402

TARGETS = {"h128": C.mla(64, 4096), "b8": C.mla(8, 8192), "h16": C.mla(64, 4096, num_heads=16),
           "fp8": C.mla(64, 4096, num_heads=16, cache="fp8", quant="PER_TENSOR")}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="h128,b8,h16,fp8")
    ap.add_argument("--waves", type=int, default=1)
    ap.add_argument("--calls", type=int, default=2)
    ap.add_argument("--lineinfo", action="store_true",
                    help="compile with -lineinfo (source-level profiles; give it a CUPA_CACHE_DIR of its own)")
    args = ap.parse_args()
    import cupy as cp

    if args.lineinfo:
        from cupa import jit

        jit.COMMON_OPTIONS = jit.COMMON_OPTIONS + ("-lineinfo",)

    lines = []
    for name in args.cases.split(","):
        built = C.build(TARGETS[name], cp)
        op = cupa.PagedAttention(**built.attributes,
                                 options=cupa.Options(backend="mla", _tuning=_Tuning(mla_waves=args.waves)))
        inputs = built.call_inputs()
        for _ in range(args.calls):
            op(**inputs)
        cp.cuda.get_current_stream().synchronize()
        lines.append(f"{name}: {TARGETS[name].name}: {op.explain(**inputs)}")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
