"""Time the MLA benchmark's decode targets under each split plan of ``Options._tuning.mla_waves``.

    python benchmarks/mla_waves.py [--waves 1,2,3,4,6,8] [--reps 20] [--out mla_waves.json]
    python benchmarks/mla_waves.py --plans 9.0      # the plans only, for a described GPU (no device)

The MLA split plan lets each row tile cut its own keys into at most ``tile_splits`` chunks (contract §4.5:
a tile's split depends on its own keys, a bound only drops trailing splits), ``tile_splits`` aiming for
``mla_waves`` waves of resident CTAs. Each line gives a case, the waves, the median (the repository's timer:
CUDA events, L2 flushed before each run), the splits launched and the largest difference from the
one-wave output (split merges round differently; within the contract's tolerance).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import cupa  # noqa: E402
from cupa import device  # noqa: E402
from cupa.bench import cases as C  # noqa: E402
from cupa.bench.timing import Timer  # noqa: E402
from cupa.kernels import mla  # noqa: E402
from cupa.options import _Tuning  # noqa: E402

TARGETS = (C.mla(64, 4096), C.mla(8, 8192), C.mla(64, 4096, num_heads=16),
           C.mla(64, 4096, num_heads=16, cache="fp8", quant="PER_TENSOR"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--waves", default="1,2,3,4,6,8")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default="")
    ap.add_argument("--plans", default="", help="compute capability: print the split plans of a described GPU")
    args = ap.parse_args(argv)
    waves = [int(x) for x in args.waves.split(",")]
    if args.plans:
        import numpy as np

        described = device.describe_capability(*(int(x) for x in args.plans.split(".")))
        for case in TARGETS:
            built = C.build(case, np)
            op = cupa.PagedAttention(**built.attributes)
            problem = op._problem(op._bind((), built.call_inputs()))
            for w in waves:
                plan = mla.launch_plan(problem, described, cupa.Options(_tuning=_Tuning(mla_waves=w)))
                print(f"{case.name} waves={w}: {plan['num_splits']} split(s) a tile, "
                      f"{plan['num_tiles']} row tiles, capacity {problem.static_kv_capacity}")
        return 0
    import cupy as cp

    here = device.device_info(cp.cuda.Device().id)
    timer = Timer(cp)
    result = {}
    for case in TARGETS:
        built = C.build(case, cp)
        inputs = built.call_inputs()
        first = None
        for w in waves:
            options = cupa.Options(backend="mla", _tuning=_Tuning(mla_waves=w))
            op = cupa.PagedAttention(**built.attributes, options=options)
            out = op(**inputs)
            problem = op._problem(op._bind((), inputs))
            plan = mla.launch_plan(problem, here, options)
            t = timer.time_us(lambda: op(**inputs), reps=args.reps)
            o = cp.asnumpy(out).astype("float32")
            first = o if first is None else first
            diff = float(abs(o - first).max())
            result[f"{case.name} waves={w}"] = dict(t, num_splits=plan["num_splits"], max_diff=diff)
            print(f"{case.name} waves={w}: {t['median_us']:.1f} us, {plan['num_splits']} split(s) a tile, "
                  f"max diff {diff:.2e}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
