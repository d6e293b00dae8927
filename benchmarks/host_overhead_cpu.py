"""Host (Python) time of one eager cupa call without a GPU: CuPy replaced by a counting fake.

The fake (tests/test_launch_fastpath.py: FakeCupy) does no work in its launches and allocations beyond
recording them; the arrays are real ``cupy.ndarray`` objects over fake addresses (CuPy needs no driver
for that, and their attribute costs are CuPy's own). So the numbers are cupa's own Python cost per call
plus the fake's small overhead (printed as ``fake floor``: the same number of fake allocations and
launches called directly). On the device, add one cuLaunchKernel (a few us) per kernel and one CuPy
pool allocation per buffer. The real CuPy RawKernel route costs more than shown here for
``rawkernel``: the fake RawKernel does not convert its ~30 arguments the way CuPy does.

    python benchmarks/host_overhead_cpu.py [--calls 20000] [--mode fast|rawkernel|both]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import cupa  # noqa: E402
from tests.test_launch_fastpath import FakeCupy, fake_case, fake_cupy  # noqa: E402

H, HK, D, BS = 32, 8, 128, 16


def per_call_us(fn, calls: int, repeats: int = 7) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(times)


def measure(mode: str, calls: int, real_arrays: bool) -> list:
    fake = FakeCupy(real_arrays=real_arrays)
    rows = []
    options = cupa.Options(launch=mode)
    with fake_cupy(fake):
        fake.record = False
        for label, B, L in (("tiny B=1 L=16 (1 split)", 1, 16), ("B=8 L=4096 (splits, merged by the last split)", 8, 4096)):
            x, attrs = fake_case(fake, B=B, L=L, H=H, Hk=HK, D=D, bs=BS)
            args = tuple(x[n] for n in ("query", "key", "value", "key_cache", "value_cache",
                                        "cumulative_sequence_length", "past_seqlens", "block_table"))
            op = cupa.PagedAttention(**attrs, options=options)
            out = fake.empty(x["query"].shape, x["query"].dtype)
            md = np.array([1, L], dtype=np.int32)
            op(*args, attention_metadata=md, out=out)
            fake.launches.clear(), fake.allocations.clear()
            op(*args, attention_metadata=md, out=out)
            launches, allocs = len(fake.launches), len(fake.allocations)

            def fake_floor():
                for _ in range(allocs):
                    fake.cuda.alloc(1024)
                for _ in range(launches):
                    fake.cuda.driver.launchKernel(0xF001, 1, 1, 1, 128, 1, 1, 0, 0, 1, 0)

            fake._functions.setdefault(0xF001, "fake_floor_kernel")
            row = {"mode": mode, "problem": label, "kernels/call": launches, "allocations/call": allocs}
            row["op(..., out=) us"] = per_call_us(lambda: op(*args, attention_metadata=md, out=out), calls)
            row["op(...) no out us"] = per_call_us(lambda: op(*args, attention_metadata=md), calls)
            row["op.plan us"] = per_call_us(lambda: op.plan(*args, attention_metadata=md), calls)
            row["paged_attention() us"] = per_call_us(
                lambda: cupa.paged_attention(*args, attention_metadata=md, out=out, num_heads=H, kv_num_heads=HK,
                                             options=options),
                calls)
            row["fake floor us"] = per_call_us(fake_floor, calls)
            rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--mode", choices=("fast", "rawkernel", "both"), default="both")
    ap.add_argument("--fake-arrays", action="store_true",
                    help="fake array objects instead of real cupy.ndarray objects over fake addresses")
    args = ap.parse_args()
    modes = ("fast", "rawkernel") if args.mode == "both" else (args.mode,)
    for mode in modes:
        for row in measure(mode, args.calls, not args.fake_arrays):
            print("  ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))


if __name__ == "__main__":
    main()
