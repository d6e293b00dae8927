"""CUDA-graph benchmark: decode step latency eager vs replayed, and the host overhead of one call.

Decode steps (fp16, GQA 32/8, D=128, block 16, L=4096, B=1 and B=8), one layer and a 32-layer stack
(32 separate caches: 32 x B=8 x 4096 x 8 x 128 x 2 x 2 B = 4.3 GB), each step timed three ways:

- ``loop_us``: wall clock per step over many back-to-back steps, synchronized once at the end -- what
  a serving loop sees (host-bound when Python is slower than the GPU, GPU-bound otherwise);
- ``gpu_us``: CUDA events around one step with the L2 cache flushed before it (median);
- ``host_us``: time to enqueue one step (perf_counter) while the GPU is held busy by a spin kernel.

Host overhead of one eager call through a bound ``cupa.PagedAttention`` (target < 20 us): a tiny
problem (B=1, L=16) enqueued many times behind a spin kernel, so the launch queue never blocks and
perf_counter measures Python plus launch API time only; CuPy inputs with and without ``out=``, and
the same with PyTorch tensors when torch is installed; plus ``op.plan`` alone, ``g.replay()``, and
the driver floor: the call's two kernel launches replayed alone (same grids and pointers), so that
``python_us`` = time - floor is cupa's own Python per call. The rows are measured in turn, seven
rounds over (the host's speed drifts), with the process pinned to one CPU.

    python benchmarks/bench_graphs.py --out benchmarks/results/graphs.json [--quick] [--host-only] [--cpu N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import cupa  # noqa: E402
import cupa.arrays  # noqa: E402
from bench_decode import make_case  # noqa: E402
from common import Timer, environment, write_json  # noqa: E402

H, HK, D, BS = 32, 8, 128, 16

_SPIN = r"""
extern "C" __global__ void spin(long long cycles) {
  long long start = clock64();
  while (clock64() - start < cycles) { }
}
"""


class Spinner:
    """Holds the GPU busy so that host-side enqueue time can be measured without queue back-pressure."""

    def __init__(self, cp):
        self.cp = cp
        self.kernel = cp.RawKernel(_SPIN, "spin")
        clock_khz = cp.cuda.Device().attributes.get("ClockRate", 1_800_000)
        self.cycles_per_ms = int(clock_khz)  # kHz = cycles per ms

    def hold(self, ms: float, stream=None):
        with (stream if stream is not None else self.cp.cuda.get_current_stream()):
            self.kernel((1,), (1,), (np.int64(self.cycles_per_ms * ms),))


def host_time_us(cp, spinner, fn, calls: int, repeats: int = 9, spin_ms: float = 50.0, stream=None) -> dict:
    """Median over ``repeats`` of the per-call host time of ``calls`` back-to-back ``fn()`` behind a spin kernel.

    The spin kernel runs on ``stream`` (the stream the calls use), so nothing completes while the calls
    are enqueued; keep ``calls`` x kernels per call well under the ~1000 launches CUDA queues per stream
    before the host blocks, and the spin longer than the enqueue time.
    """
    fn()
    cp.cuda.Device().synchronize()
    per_call = []
    for _ in range(repeats):
        spinner.hold(spin_ms, stream)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        cp.cuda.Device().synchronize()
        per_call.append((t1 - t0) / calls * 1e6)
    return {"median_us": statistics.median(per_call), "min_us": min(per_call), "calls": calls, "repeats": repeats}


def loop_time_us(cp, fn, steps: int) -> float:
    """Wall clock per step over ``steps`` back-to-back steps (one sync at the end)."""
    for _ in range(3):
        fn()
    cp.cuda.Device().synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    cp.cuda.Device().synchronize()
    return (time.perf_counter() - t0) / steps * 1e6


def make_layers(cp, B, L, layers):
    cases = [make_case(cp, B, L, H, HK, D, BS, rng_seed=i) for i in range(layers)]
    outs = [cp.empty_like(c["q"]) for c in cases]
    return cases, outs


def bench_step(cp, timer, spinner, B, L, layers, reps, steps) -> dict:
    cases, outs = make_layers(cp, B, L, layers)
    op = cupa.PagedAttention(num_heads=H, kv_num_heads=HK)
    md = np.array([1, L], dtype=np.int32)   # replay-wide bound: the lengths served

    def eager():
        for c, o in zip(cases, outs):
            op(c["q"], c["k"], c["v"], c["kc"], c["vc"], c["cum"], c["past"], c["bt"], attention_metadata=md, out=o)

    stream = cp.cuda.Stream(non_blocking=True)
    g = cupa.capture_graph(eager, stream=stream)
    row = {"B": B, "L": L, "layers": layers, "kv_bytes": sum(c["kv_bytes"] for c in cases),
           "graph_private_pool_bytes": g.nbytes}
    with stream:  # everything on the capture stream: replay() adds no event
        row["eager_loop_us"] = loop_time_us(cp, eager, steps)
        row["replay_loop_us"] = loop_time_us(cp, g.replay, steps)
        row["eager_gpu_us"] = timer.time_us(eager, reps=reps)["median_us"]
        row["replay_gpu_us"] = timer.time_us(g.replay, reps=reps)["median_us"]
        row["eager_host_us"] = host_time_us(cp, spinner, eager, calls=max(1, 64 // layers), stream=stream)["median_us"]
        row["replay_host_us"] = host_time_us(cp, spinner, g.replay, calls=64, stream=stream)["median_us"]
    row["speedup_loop"] = row["eager_loop_us"] / row["replay_loop_us"]
    g.close()
    del cases, outs
    cp.get_default_memory_pool().free_all_blocks()
    return row


def _launch_floor(cp, op, args, md, out):
    """``fn()`` that replays just the driver launches of one decode call of ``op`` (its prologue and
    attention kernels, same grids, same pointers; no planning, no checks): the host cost no Python
    can remove, so that ``eager - floor`` is the Python part of a call."""
    from cupa.kernels import decode, launch

    problem, backend, inputs = op.plan(*args, attention_metadata=md)
    if backend.name != "decode":
        return None
    call = launch.prepare(problem, inputs, out, None)
    recipe = problem.__dict__[decode._RECIPES][call.device_id]
    if recipe.nbytes:
        return None  # a workspace per call: not the tiny problem this floor is for
    ptrs = call.ptrs + [0, call.output_ptr, 0, 0, 0]
    stream_ptr = call.stream.ptr
    return lambda: recipe.launches(ptrs, stream_ptr)


def interleaved_host_times(cp, spinner, fns: dict, calls: int, rounds: int = 7, stream=None) -> dict:
    """Per-call host time of each ``fns`` entry, the entries measured in turn, ``rounds`` times over
    (the host's speed drifts: this way each entry sees the same drift); median and min over the
    rounds' medians."""
    seen = {name: [] for name in fns}
    for _ in range(rounds):
        for name, (fn, s) in fns.items():
            seen[name].append(host_time_us(cp, spinner, fn, calls, repeats=5, stream=s)["median_us"])
    return {name: {"median_us": statistics.median(v), "min_us": min(v), "calls": calls, "rounds": rounds}
            for name, v in seen.items()}


def bench_host_overhead(cp, spinner, calls: int) -> list:
    """Per-call host time of one eager call on a tiny problem (B=1, L=16), GPU kept busy.

    ``launches only`` replays the call's two driver launches alone: ``python_us`` = a row's time minus
    that floor is what cupa's Python costs per call (the issue's target: under 20 us).
    """
    case = make_case(cp, 1, 16, H, HK, D, BS)
    op = cupa.PagedAttention(num_heads=H, kv_num_heads=HK)
    md = np.array([1, 16], dtype=np.int32)
    args = (case["q"], case["k"], case["v"], case["kc"], case["vc"], case["cum"], case["past"], case["bt"])
    out = cp.empty_like(case["q"])
    fns = {
        "cupy, out=": (lambda: op(*args, attention_metadata=md, out=out), None),
        "cupy, no out": (lambda: op(*args, attention_metadata=md), None),
        "cupy, no metadata": (lambda: op(*args, out=out), None),
        "cupy, op.plan only": (lambda: op.plan(*args, attention_metadata=md), None),
        "cupy, paged_attention()": (lambda: cupa.paged_attention(*args, attention_metadata=md, out=out, num_heads=H,
                                                                 kv_num_heads=HK), None),
    }
    op(*args, attention_metadata=md, out=out)
    floor = _launch_floor(cp, op, args, md, out)
    if floor is not None:
        fns["launches only (driver floor)"] = (floor, None)
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None and torch.cuda.is_available():
        targs = tuple(torch.from_dlpack(a) for a in args)
        tout = torch.empty_like(targs[0])
        tstream = cupa.arrays.resolve_stream(torch.cuda.current_stream())
        fns["torch, out="] = (lambda: op(*targs, attention_metadata=md, out=tout), tstream)
        fns["torch, no out"] = (lambda: op(*targs, attention_metadata=md), tstream)
    stream = cp.cuda.Stream(non_blocking=True)
    g = cupa.capture_graph(lambda: op(*args, attention_metadata=md, out=out), stream=stream)
    fns["graph replay (1 call)"] = (g.replay, stream)
    with stream:
        pass
    res = interleaved_host_times(cp, spinner, fns, calls)
    g.close()
    rows = [{"case": name, **r} for name, r in res.items()]
    if floor is not None:
        f = res["launches only (driver floor)"]["median_us"]
        for row in rows:
            if row["case"] not in ("launches only (driver floor)", "graph replay (1 call)", "cupy, op.plan only"):
                row["python_us"] = row["median_us"] - f
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/graphs.json")
    ap.add_argument("--quick", action="store_true", help="fewer reps, no 32-layer B=8 stack")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--cpu", type=int, default=-1,
                    help="pin the process to this CPU (default: the last one it may run on; -2: do not pin)")
    ap.add_argument("--host-only", action="store_true", help="only the host-overhead rows")
    args = ap.parse_args(argv)
    cpu = None
    if args.cpu != -2 and hasattr(os, "sched_setaffinity"):
        cpu = args.cpu if args.cpu >= 0 else max(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpu})
    import cupy as cp

    reps = 10 if args.quick else 30
    steps = 50 if args.quick else 200
    timer = Timer(cp)
    spinner = Spinner(cp)
    L = 4096
    configs = [(1, 1), (8, 1), (1, args.layers), (8, args.layers)]
    if args.quick:
        configs = [(1, 1), (8, 1), (1, args.layers)]
    if args.host_only:
        configs = []
    steps_rows = [bench_step(cp, timer, spinner, B, L, layers, reps, steps if layers == 1 else steps // 4)
                  for B, layers in configs]
    host_rows = bench_host_overhead(cp, spinner, calls=100)
    payload = {"benchmark": "graphs", "environment": environment(cp),
               "shape": {"H": H, "Hk": HK, "D": D, "block_size": BS, "dtype": "float16", "L": L},
               "decode_steps": steps_rows, "host_overhead": host_rows, "host_target_us": 20.0,
               "pinned_cpu": cpu}
    write_json(args.out, payload)

    print(f"decode step, fp16 GQA {H}/{HK} D={D} block {BS} L={L} (us; loop = wall clock per step back to back)")
    print(f"{'B':>3s} {'layers':>6s} | {'eager loop':>10s} {'replay loop':>11s} {'x':>5s} | "
          f"{'eager gpu':>9s} {'replay gpu':>10s} | {'eager host':>10s} {'replay host':>11s}")
    for r in steps_rows:
        print(f"{r['B']:3d} {r['layers']:6d} | {r['eager_loop_us']:10.1f} {r['replay_loop_us']:11.1f} "
              f"{r['speedup_loop']:5.2f} | {r['eager_gpu_us']:9.1f} {r['replay_gpu_us']:10.1f} | "
              f"{r['eager_host_us']:10.1f} {r['replay_host_us']:11.1f}")
    print(f"\nhost time per call, tiny problem, GPU held busy; python = time - driver floor (target: python < 20 us)"
          f"{'' if cpu is None else f'; pinned to CPU {cpu}'}")
    print(f"{'case':30s} {'median us':>9s} {'min us':>7s} {'python us':>9s}")
    for r in host_rows:
        py = r.get("python_us")
        print(f"{r['case']:30s} {r['median_us']:9.1f} {r['min_us']:7.1f} {'-' if py is None else f'{py:.1f}':>9s}")


if __name__ == "__main__":
    main()
