"""NumPy reference benchmark: the CPU backend at notebook sizes, time and peak memory of each call.

Cases (fp16, GQA 32/8 heads, D=128, block 16, shuffled block tables, T caches), with the targets of
the reference on a 2-core machine:

- prefill B=4 x 2048 new tokens: <= 5 s
- chunked prefill B=4 x (2048 cached + 256 new): <= 2 s
- decode B=16 at L=8192 (8191 cached + 1 new): <= 0.5 s

and at most 2 GB of peak memory each. Every case runs in a fresh Python process, so one case's
memory never counts against another. The call is timed ``--reps`` times (it rewrites the same cache
rows each time); ``seconds`` is the fastest, ``median_seconds`` the median, ``cpu_seconds`` the
process CPU time of each call (all threads). Memory, two ways:

- ``peak_rss_bytes``: the process's peak resident set during the calls (VmHWM, reset through
  /proc/self/clear_refs just before the first call), inputs and interpreter included;
- ``traced_peak_bytes``: the largest sum of live allocations made by one call (tracemalloc, which
  NumPy reports its buffers to), on a separate untimed run.

The targets assume an otherwise idle machine: other processes on the same cores slow the BLAS
threads far more than their share, so each case records the 1-minute load average before it.

    python benchmarks/bench_reference.py --out benchmarks/results/reference_cpu.json [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
import tracemalloc

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

H, HK, D, BLOCK = 32, 8, 128, 16
MEMORY_TARGET = 2 << 30
CASES = {
    # name: (batch, new tokens, cached tokens, target seconds)
    "prefill B=4x2048": (4, 2048, 0, 5.0),
    "chunked prefill B=4x(2048+256)": (4, 256, 2048, 2.0),
    "decode B=16 L=8192": (16, 1, 8191, 0.5),
}


def build(batch: int, new: int, past: int, seed: int = 0) -> tuple:
    """NumPy inputs and attributes of one case; caches filled block by block (bounded set-up memory)."""
    rng = np.random.default_rng(seed)
    blocks_per_seq = math.ceil((past + new) / BLOCK)
    num_blocks = batch * blocks_per_seq
    block_table = rng.permutation(num_blocks).astype(np.int32).reshape(batch, blocks_per_seq)
    caches = []
    for _ in range(2):
        cache = np.empty((num_blocks, BLOCK, HK, D), np.float16)
        for b0 in range(0, num_blocks, 1024):
            part = cache[b0:b0 + 1024]
            part[...] = rng.standard_normal(part.shape, dtype=np.float32)
        caches.append(cache)
    n = batch * new
    inputs = dict(
        query=rng.standard_normal((n, H * D), dtype=np.float32).astype(np.float16),
        key=rng.standard_normal((n, HK * D), dtype=np.float32).astype(np.float16),
        value=rng.standard_normal((n, HK * D), dtype=np.float32).astype(np.float16),
        key_cache=caches[0], value_cache=caches[1],
        cumulative_sequence_length=(np.arange(batch + 1) * new).astype(np.int32),
        past_seqlens=np.full(batch, past, np.int32), block_table=block_table,
    )
    return inputs, dict(num_heads=H, kv_num_heads=HK)


def _vm_hwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return -1


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def run_case(name: str, reps: int) -> dict:
    """Time one case in this process (the child side of main())."""
    import cupa

    batch, new, past, target = CASES[name]
    inputs, attrs = build(batch, new, past)
    op = cupa.PagedAttention(**attrs)
    op.plan(**inputs)                          # validation and dispatch outside the timed region
    reset = _reset_peak_rss()
    times, cpu = [], []
    for _ in range(reps):
        t0, c0 = time.perf_counter(), time.process_time()
        out = op(**inputs)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    peak_rss = _vm_hwm()
    finite = bool(np.isfinite(out.astype(np.float32)).all())
    del out
    tracemalloc.start()
    op(**inputs)
    traced_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    input_bytes = sum(v.nbytes for v in inputs.values())
    return {
        "case": name, "B": batch, "new_tokens": new, "past": past, "H": H, "Hk": HK, "D": D,
        "block_size": BLOCK, "dtype": "float16", "cache": "T", "input_bytes": input_bytes,
        "seconds": min(times), "median_seconds": sorted(times)[len(times) // 2], "all_seconds": times,
        "cpu_seconds": cpu,
        "target_seconds": target, "meets_time_target": min(times) <= target,
        "peak_rss_bytes": peak_rss if reset else None, "traced_peak_bytes": traced_peak,
        "memory_target_bytes": MEMORY_TARGET,
        "meets_memory_target": traced_peak <= MEMORY_TARGET and (not reset or peak_rss <= MEMORY_TARGET),
        "output_finite": finite,
    }


def environment() -> dict:
    info = {"time": time.strftime("%Y-%m-%d %H:%M:%S"), "python": platform.python_version(),
            "numpy": np.__version__, "machine": platform.machine(), "cpu_count": os.cpu_count(),
            "load_average_1_5_15_min": list(os.getloadavg())}
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        info["cpu"] = platform.processor()
    try:
        info["blas"] = np.show_config(mode="dicts")["Build Dependencies"]["blas"]["name"]
    except Exception:
        info["blas"] = None
    return info


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--reps", type=int, default=3, help="timed calls per case")
    parser.add_argument("--case", choices=sorted(CASES), action="append",
                        help="run only this case (repeatable); default: every case")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(run_case(args.child, args.reps)))
        return 0
    results = []
    for name in args.case or list(CASES):
        load = os.getloadavg()[0]
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", name, "--reps", str(args.reps)],
                              capture_output=True, text=True, cwd=ROOT)
        if proc.returncode:
            sys.stderr.write(proc.stderr)
            return proc.returncode
        row = json.loads(proc.stdout.strip().splitlines()[-1])
        row["load_average_1min_before"] = load
        results.append(row)
        rss = row["peak_rss_bytes"]
        print(f"{name:32s} {row['seconds']:8.3f} s (target {row['target_seconds']} s)  "
              f"peak RSS {rss / 2**20 if rss else float('nan'):7.0f} MiB  "
              f"traced peak {row['traced_peak_bytes'] / 2**20:7.0f} MiB  (load {load:.1f})", flush=True)
    payload = {"benchmark": "reference_cpu", "environment": environment(), "results": results}
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(payload, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
