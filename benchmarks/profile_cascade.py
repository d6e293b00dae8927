"""Where the time of a cascade step goes: the benchmark's cascade case (B=64 decode tokens over an
8192-key shared prefix plus 256 own keys, GQA 32/8, D=128, fp16, block 16), its parts and its
prefix-split plans, each captured into a CUDA graph and replayed (CUDA events, L2 flushed, median).

    python benchmarks/profile_cascade.py --out cascade_parts.json
    ncu --metrics gpu__time_duration.sum --cache-control all python benchmarks/profile_cascade.py --ncu

Parts: the whole step (``cupa.CascadeAttention``) for each ``prefix_splits``; the prefix call alone and
the suffix call alone (the inputs the step gives them, computed once); the plain paged call. With
``--ncu`` it only runs a few eager steps for a profiler to list the kernels. With ``--sweep`` it times
the whole step on each case of the cascade suite for each ``prefix_splits``, with the suffix beside the
prefix (``concurrent=True``) and after it, next to the plain call:

    python benchmarks/profile_cascade.py --sweep --splits auto,1,2,3,4,5,6,8,12 --out cascade_sweep.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import cupa  # noqa: E402
from cupa import cascade as cascade_mod  # noqa: E402


def build(cp, B=64, P=8192, S=256, bs=16, H=32, Hk=8, D=128, seed=0):
    """The cascade suite's inputs (cupa/bench/suites.py CascadeSuite)."""
    rng = np.random.default_rng(seed)
    nbp, nbs = math.ceil(P / bs), math.ceil(S / bs)
    perm = rng.permutation(nbp + B * nbs).astype(np.int32)
    shared, own = perm[:nbp], perm[nbp:].reshape(B, nbs)
    shape = (nbp + B * nbs, bs, Hk, D)
    normal = lambda s: cp.asarray(rng.standard_normal(s, dtype=np.float32).astype(np.float16))  # noqa: E731
    table = np.full((B, 2 * (nbp + nbs)), -1, dtype=np.int32)
    table[:, :nbp + nbs] = np.concatenate([np.broadcast_to(shared, (B, nbp)), own], axis=1)
    x = dict(query=normal((B, H * D)), key=normal((B, Hk * D)), value=normal((B, Hk * D)),
             key_cache=normal(shape), value_cache=normal(shape),
             cumulative_sequence_length=cp.asarray(np.arange(B + 1, dtype=np.int32)),
             past_seqlens=cp.asarray(np.full(B, P + S - 1, dtype=np.int32)), block_table=cp.asarray(table),
             attention_metadata=np.array([1, P + S], dtype=np.int32))
    cp.cuda.Device().synchronize()   # the copies have landed before calls on a non-blocking stream read them
    return x


#: (B, prefix, suffix) of the cascade suite's full size (cupa/bench/suites.py CascadeSuite)
SWEEP_CASES = ((64, 8192, 256), (64, 8192, 512), (128, 32768, 1024), (32, 4096, 4096))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--ncu", action="store_true", help="only a few eager steps (for a profiler)")
    ap.add_argument("--sweep", action="store_true", help="the whole step on every case of the cascade suite, "
                    "concurrent and serial, for each of --splits")
    ap.add_argument("--splits", default="auto,1,2,4,6,8,12,15")
    ap.add_argument("--decode-ctas", default="", help="also time the step under these "
                    "Options._tuning.decode_ctas_per_sm values (comma-separated; splits 'auto')")
    args = ap.parse_args(argv)
    import cupy as cp

    from cupa.bench.timing import Timer

    P, H, Hk = 8192, 32, 8
    x = build(cp)
    if args.ncu:
        op = cupa.CascadeAttention(prefix_len=P, num_heads=H, kv_num_heads=Hk)
        for _ in range(3):
            op(**x)
        cp.cuda.Device().synchronize()
        print(op.describe(**x))
        return 0
    timer = Timer(cp)
    stream = cp.cuda.Stream(non_blocking=True)
    result = {"case": "B=64 prefix=8192 suffix=256 bs=16 GQA 32/8 D=128 fp16", "reps": args.reps, "rows": {}}

    def graph_us(fn):
        with stream:
            fn()
            stream.synchronize()
            g = cupa.capture_graph(fn, stream=stream)
            try:
                return timer.time_us(g.replay, reps=args.reps)["median_us"]
            finally:
                g.close()

    if args.sweep:
        result = {"what": "whole cascade step, captured and replayed (median us), GQA 32/8 D=128 fp16 bs=16",
                  "reps": args.reps, "cases": {}}
        for B, prefix, suffix in SWEEP_CASES:
            x = build(cp, B=B, P=prefix, S=suffix)
            plain = cupa.PagedAttention(num_heads=H, kv_num_heads=Hk)
            with stream:
                ref = plain(**x).astype(cp.float32)
            rows = result["cases"][f"B={B} prefix={prefix} suffix={suffix}"] = {"plain paged": graph_us(
                lambda: plain(**x))}
            for concurrent in (True, False):
                for s in args.splits.split(","):
                    op = cupa.CascadeAttention(prefix_len=prefix, num_heads=H, kv_num_heads=Hk, concurrent=concurrent,
                                               prefix_splits=s if s == "auto" else int(s))
                    with stream:
                        got = op(**x)
                        err = float(cp.abs(got.astype(cp.float32) - ref).max())
                    us = graph_us(lambda op=op: op(**x))
                    label = f"{'concurrent' if concurrent else 'serial'} prefix_splits={s}"
                    rows[label] = {"step_us": us, "speedup_vs_plain": rows["plain paged"] / us,
                                   "max_abs_diff_vs_plain": err,
                                   "splits": op._step(op._plain.plan(**x).problem, 0).prefix_rows}
                    print(f"B={B} prefix={prefix} suffix={suffix} {label}: {us:.1f} us "
                          f"({rows['plain paged'] / us:.2f}x)", flush=True)
        if args.out:
            pathlib.Path(args.out).write_text(json.dumps(result, indent=1))
        return 0

    plain = cupa.PagedAttention(num_heads=H, kv_num_heads=Hk)
    with stream:
        ref = plain(**x)
    result["rows"]["plain paged"] = graph_us(lambda: plain(**x))
    from cupa.options import _Tuning

    runs = [(s, None) for s in args.splits.split(",")]
    runs += [("auto", int(c)) for c in args.decode_ctas.split(",") if c]
    for s, ctas in runs:
        splits = s if s == "auto" else int(s)
        options = None if ctas is None else cupa.Options(_tuning=_Tuning(decode_ctas_per_sm=ctas))
        op = cupa.CascadeAttention(prefix_len=P, num_heads=H, kv_num_heads=Hk, prefix_splits=splits,
                                   options=options)
        with stream:
            got = op(**x)
            err = float(cp.abs(got.astype(cp.float32) - ref.astype(cp.float32)).max())
        row = {"step_us": graph_us(lambda op=op: op(**x)), "max_abs_diff_vs_plain": err,
               "describe": op.describe(**x)}
        # the parts, with the inputs the step derives for them (computed once, outside the timing)
        problem = op._plain.plan(**x).problem
        step = op._step(problem, 0)
        from cupa.kernels import states as kernels

        full = dict(x, **{n: None for n in ("cos_cache", "sin_cache", "slot_mapping", "q_norm_weight",
                                            "k_norm_weight", "k_scale", "v_scale", "query_positions",
                                            "head_sink")})
        with stream:
            d = cascade_mod._derive_device(step, full, P, stream, kernels)
        row["prefix_us"] = graph_us(lambda op=op, step=step, d=d: op._prefix(step, full, d, cp, stream))
        row["suffix_us"] = graph_us(lambda op=op, step=step, d=d: op._suffix_call(step, full, d, stream,
                                                                                 op._suffix_beside))
        row["splits"] = step.prefix_rows
        label = f"cascade prefix_splits={s}" + ("" if ctas is None else f" decode_ctas_per_sm={ctas}")
        result["rows"][label] = row
        print(f"{label} ({step.prefix_rows}): step {row['step_us']:.1f} us, prefix {row['prefix_us']:.1f}, "
              f"suffix {row['suffix_us']:.1f}, err {err:.2e}", flush=True)
    print(f"plain paged: {result['rows']['plain paged']:.1f} us")
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
