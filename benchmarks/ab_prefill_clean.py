"""What keeping masked keys' Inf / NaN out of P V costs the mma.sync prefill, two ways, in one process.

    python benchmarks/ab_prefill_clean.py --reps 30 --rounds 3 --out ab_prefill_clean.json

Each case (the prefill and chunked cases of docs/performance.md's "What keeping masked keys out costs",
at block 16 and 256, fp16 and bf16) runs on the mma.sync prefill (``Options(backend="prefill")``) with
the V rows of keys outside a CTA's intersection of row ranges zeroed in shared memory (the default) and
with ``Options._tuning.prefill_clamp_v`` (V fragments of tiles not interior to a warp's rows clamped to
finite values in registers). Rounds alternate the order; each figure is the median of ``--reps`` calls
(CUDA events, L2 flushed). On finite inputs both give the same bits: every round checks it.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import cupa  # noqa: E402
from cupa.bench.cases import build, chunked, prefill  # noqa: E402
from cupa.options import _Tuning  # noqa: E402

#: (label, case)
CASES = (("prefill 4x2048 bs=16 fp16", prefill(4, 2048, block_size=16)),
         ("prefill 4x2048 bs=256 fp16", prefill(4, 2048, block_size=256)),
         ("prefill 4x2048 bs=16 bf16", prefill(4, 2048, block_size=16, dtype="bfloat16")),
         ("chunked 8x(8192+512) bs=16 fp16", chunked(8, 8192, 512, block_size=16)))
VARIANTS = {"shared-memory clean": cupa.Options(backend="prefill"),
            "register clamp": cupa.Options(backend="prefill", _tuning=_Tuning(prefill_clamp_v=True))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    import cupy as cp

    from cupa.bench.timing import Timer

    timer = Timer(cp)
    result = {"what": __doc__.splitlines()[0], "reps": args.reps, "cases": {}}
    for label, case in CASES:
        built = build(case, cp)
        inputs = built.call_inputs()
        ops = {name: cupa.PagedAttention(**built.attributes, options=o) for name, o in VARIANTS.items()}
        outs = {name: cp.empty(inputs["query"].shape, inputs["query"].dtype) for name in ops}
        rows = {name: [] for name in ops}
        same = True
        for r in range(args.rounds):
            order = list(ops) if r % 2 == 0 else list(ops)[::-1]
            for name in order:
                timed = timer.time_us(lambda n=name: ops[n](**inputs, out=outs[n]), reps=args.reps)
                rows[name].append(timed["median_us"])
            a, b = (cp.asnumpy(outs[n]).view(np.uint16) for n in ops)
            same = same and bool(np.array_equal(a, b))
        base = float(np.median(rows["shared-memory clean"]))
        result["cases"][label] = {"us": rows, "same_bits": same, "explain": ops["register clamp"].explain(**inputs),
                                  "clamp_vs_clean": float(np.median(rows["register clamp"])) / base}
        print(f"{label}: " + ", ".join(f"{n} {[round(t, 1) for t in v]}" for n, v in rows.items())
              + f"; same bits {same}", flush=True)
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
