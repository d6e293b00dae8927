"""How the way L2 is made cold changes a timed decode call (contract §7: rotate inputs larger than
L2, or flush it). Three ways, each timing the same calls:

- ``memset``: a 2 GiB memset before each run (``python -m cupa.bench --flush memset``). L2 ends up full
  of dirty lines, which the timed call's reads evict: their write-back to DRAM lands inside the call.
- ``read``: a 2 GiB write, then a 2 GiB read before each run (``cupa.bench``'s default flush): L2 cold
  and clean.
- ``rotate``: no flush; two input sets, each larger than L2, used in turn, with a 0.4 ms spin kernel
  before each run so that the host's enqueue time stays outside the timed region.

Rows: the cupa call, a read probe of the same number of bytes, and torch SDPA on a dense cache (fp16
cases, when torch imports).

    python benchmarks/l2_flush_methods.py --out benchmarks/results/l2_flush_h200.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import cupa  # noqa: E402
from cupa.bench.cases import build, decode  # noqa: E402
from cupa.bench.report import write_json  # noqa: E402
from cupa.bench.runtime import cuda_environment  # noqa: E402
from cupa.bench.timing import Timer  # noqa: E402

_SPIN = r"""
extern "C" __global__ void spin(long long ns) {
  long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
}
"""


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/l2_flush.json")
    ap.add_argument("--reps", type=int, default=40)
    args = ap.parse_args(argv)
    import cupy as cp

    timer = Timer(cp)
    spin = cp.RawKernel(_SPIN, "spin")
    start, end = cp.cuda.Event(), cp.cuda.Event()

    def median_us(fns, before):
        times = []
        for i in range(args.reps + 3):
            before()
            start.record()
            fns[i % len(fns)]()
            end.record()
            end.synchronize()
            if i >= 3:
                times.append(cp.cuda.get_elapsed_time(start, end) * 1000.0)
        return round(statistics.median(times), 2)

    def three_ways(fns):
        return {"memset": median_us(fns[:1], lambda: timer.flush("memset")),
                "read": median_us(fns[:1], lambda: timer.flush("read")),
                "rotate": median_us(fns, lambda: spin((1,), (1,), (np.int64(400_000),)))}

    rows = []
    for B, L, cache in ((64, 4096, "int8"), (64, 4096, "fp8"), (8, 8192, "float16"), (64, 4096, "float16")):
        calls, probes, keep = [], [], []
        for seed in (0, 1):
            built = build(decode(B, L, cache={"float16": "T"}.get(cache, cache)), cp, seed=seed)
            op = cupa.PagedAttention(**built.attributes)
            inputs = built.call_inputs()
            out = cp.empty_like(inputs["query"])
            calls.append(lambda op=op, x=inputs, out=out: op(**x, out=out))
            x = cp.ones(built.case.kv_bytes(), dtype=cp.uint8)
            probes.append(lambda x=x: timer.probe(x))
            keep.append((built, x))
        row = {"B": B, "L": L, "cache": cache, "kv_bytes": keep[0][0].case.kv_bytes(),
               "cupa_us": three_ways(calls), "read_probe_us": three_ways(probes)}
        if cache == "float16":
            try:
                import torch
                import torch.nn.functional as F
            except ImportError:
                torch = None
            if torch is not None:
                dense = []
                for seed in (0, 1):
                    g = torch.Generator(device="cuda").manual_seed(seed)
                    dense.append([torch.randn(B, 32, 1, 128, device="cuda", dtype=torch.float16, generator=g),
                                  torch.randn(B, 8, L, 128, device="cuda", dtype=torch.float16, generator=g),
                                  torch.randn(B, 8, L, 128, device="cuda", dtype=torch.float16, generator=g)])
                sdpa = [lambda d=d: F.scaled_dot_product_attention(*d, enable_gqa=True) for d in dense]
                with cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
                    row["torch_sdpa_us"] = three_ways(sdpa)
                del dense, sdpa
                torch.cuda.empty_cache()
        rows.append(row)
        print(row, flush=True)
        del calls, probes, keep
        cp.get_default_memory_pool().free_all_blocks()
    write_json(args.out, {"benchmark": "l2_flush_methods", "environment": cuda_environment(cp), "results": rows})


if __name__ == "__main__":
    main()
