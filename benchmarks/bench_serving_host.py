"""Host time of the serving toolkit (cupa.serving) on one CPU core; no GPU, no attention.

Per step of a continuous batch: ``append_decode`` (one token for every decoding sequence), ``append``
(one chunk of a chunked prefill), ``build_step`` (the op inputs, NumPy arrays on the host), for 256
running sequences with contexts up to 32k tokens in blocks of 16. Cases: full attention only; the
two layer groups of GPT-OSS (full attention and sliding-window-128 layers, evicting; the host work
is per group, not per layer); prefix caching on and off. Also one block-pool operation (allocate + free, share, prefix-cache hit) and the bookkeeping
memory (O(blocks): bytes per block of the pool).

Targets (issue 19): build_step <= 100 us per step, a pool operation <= 2 us.

    python benchmarks/bench_serving_host.py [--steps 400] [--out benchmarks/results/serving_host_cpu.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
import timeit

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from cupa import serving  # noqa: E402
from cupa.serving.benchmark import CASES, Scenario  # noqa: E402


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _pin_one_core():
    if hasattr(os, "sched_setaffinity"):
        cpu = min(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpu})
        return cpu
    return None


def _summary(samples_ns: list) -> dict:
    us = sorted(x / 1e3 for x in samples_ns)
    return {"median_us": statistics.median(us), "p90_us": us[int(0.9 * (len(us) - 1))], "min_us": us[0],
            "samples": len(us)}


def bench_steps(name: str, *, seqs: int, block_size: int, max_context: int, chunk: int, steps: int,
                seed: int) -> dict:
    """``steps`` steps of a :class:`cupa.serving.benchmark.Scenario`, each piece timed."""
    kinds, prefix = CASES[name]
    sc = Scenario(kinds, seqs=seqs, block_size=block_size, max_context=max_context, chunk=chunk, steps=steps + 1,
                  prefix=prefix, seed=seed)
    m = sc.manager
    t_dec, t_app, t_build, t_total = [], [], [], []
    gc.collect()
    gc.disable()
    try:
        for _ in range(steps):
            t0 = time.perf_counter_ns()
            sc.decode()
            t1 = time.perf_counter_ns()
            sc.prefill()
            t2 = time.perf_counter_ns()
            step = sc.build()
            t3 = time.perf_counter_ns()
            t_dec.append(t1 - t0)
            t_app.append(t2 - t1)
            t_build.append(t3 - t2)
            t_total.append(t3 - t0)
    finally:
        gc.enable()
    ctx = step.seq_lens
    return {
        "layers": ", ".join(f"{len(g.layers)} x {g.kind}" for g in sc.cache.groups),
        "groups": len(sc.cache.groups), "prefix_caching": prefix, "running_sequences": seqs,
        "decode_sequences": seqs - 1, "prefill_chunk": chunk, "token_count": step.token_count,
        "block_size": block_size, "context_max": int(ctx.max()), "context_mean": float(ctx.mean()),
        "block_table_shape": list(step.block_tables[0].shape),
        "build_step": _summary(t_build), "append_decode": _summary(t_dec), "append_chunk": _summary(t_app),
        "step_total": _summary(t_total),
        "bookkeeping_bytes": m.bookkeeping_bytes(), "pool_blocks": m.pool.num_blocks,
        "bookkeeping_bytes_per_block": m.bookkeeping_bytes() / m.pool.num_blocks,
        "cached_tokens": int(ctx.sum()),
        "bookkeeping_bytes_per_cached_token": m.bookkeeping_bytes() / int(ctx.sum()),
    }


def bench_pool(num_blocks: int, reps: int) -> dict:
    """One pool operation: allocate_one + free, share + free, and a prefix-cache hit (acquire + free)."""
    pool = serving.BlockPool(num_blocks)
    held = pool.allocate(num_blocks // 2)               # a half-full pool
    pool.register_many(held[:1000], list(range(1000)))
    out = {}

    def run(name, fn, ops_per_call):
        fn()
        samples = []
        for _ in range(7):
            t0 = time.perf_counter_ns()
            for _ in range(reps):
                fn()
            samples.append((time.perf_counter_ns() - t0) / reps / ops_per_call)
        out[name] = {"median_us": statistics.median(samples) / 1e3, "min_us": min(samples) / 1e3}

    def alloc_free():
        pool.free([pool.allocate_one()])

    def share_free():
        pool.share(held[5])
        pool.free([held[5]])

    def hit_free():
        pool.free([pool.acquire(7)])

    def sixteen():
        pool.free(pool.allocate(16))

    run("allocate_one + free (per pair)", alloc_free, 1)
    run("share + free (per pair)", share_free, 1)
    run("acquire (prefix hit) + free (per pair)", hit_free, 1)
    run("allocate(16) + free(16) (per block)", sixteen, 16)
    pool.check()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-context", type=int, default=32768)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--pool-reps", type=int, default=20000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    cpu = _pin_one_core()
    a, idx = np.zeros(257, np.int32), np.arange(256)
    calib = statistics.median(timeit.repeat(lambda: a[idx], number=2000, repeat=7)) / 2000 * 1e6
    results = {"environment": {"time": time.strftime("%Y-%m-%d %H:%M:%S"), "python": platform.python_version(),
                               "numpy": np.__version__, "cpu": _cpu_model(), "pinned_cpu": cpu,
                               "numpy_fancy_index_256_us": calib,
                               "note": "one core; other processes may share the machine (numpy_fancy_index_256_us "
                                       "is one NumPy gather of 256 int32 by an index array, timed in the same "
                                       "run, for scale)"},
               "targets": {"build_step_us": 100, "pool_operation_us": 2},
               "steps": {}, "pool": None}
    for name in CASES:
        r = bench_steps(name, seqs=args.seqs, block_size=args.block_size, max_context=args.max_context,
                        chunk=args.chunk, steps=args.steps, seed=args.seed)
        results["steps"][name] = r
        print(f"{name:45s} build_step {r['build_step']['median_us']:6.1f} us (p90 {r['build_step']['p90_us']:6.1f})"
              f"  append_decode {r['append_decode']['median_us']:6.1f}  append chunk {r['append_chunk']['median_us']:6.1f}"
              f"  total {r['step_total']['median_us']:6.1f} us  N={r['token_count']}"
              f"  bookkeeping {r['bookkeeping_bytes'] / 2**20:.1f} MiB ({r['bookkeeping_bytes_per_block']:.0f} B/block)")
    results["pool"] = bench_pool(1 << 19, args.pool_reps)
    for name, r in results["pool"].items():
        print(f"pool {name:40s} {r['median_us']:.3f} us")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
        print("wrote", args.out)


if __name__ == "__main__":
    main()
