"""Undersized attention_metadata bounds under compute-sanitizer: work may be omitted, memory stays safe.

contract §4.5: a max_kv_len_bound (or max_query_len_bound) smaller than a length reached during a replay
breaks the contract -- the result may omit work -- but must never cause an out-of-bounds access. This
script captures decode steps with deliberately undersized bounds and replays them while the sequences
grow far past the bound (and eager calls with the same bounds), over both decode kernels (tensor-core
fp16 D=128, CUDA-core fp32 D=64), several block sizes, malformed rows (an invalid padded sequence, an
out-of-range block id) and a prefill-shaped call with an undersized query bound. Arrays come straight
from cudaMalloc (CuPy's pool is disabled outside the capture), so memcheck sees each one's exact bounds.

    compute-sanitizer --tool memcheck --error-exitcode 99 python benchmarks/sanitize_undersized_bound.py

Exits 0 and prints one line per case plus a summary; any CUDA error raises (non-zero exit).
"""

from __future__ import annotations

import math
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import cupa  # noqa: E402

NP = {"float16": np.float16, "float32": np.float32}


def run_case(cp, rng, *, name, dtype, D, H, Hk, block_size, past0, q_lens, steps, bound, max_blocks, malformed):
    T = NP[dtype]
    B = len(past0)
    N = sum(q_lens)
    final = [p + steps * q for p, q in zip(past0, q_lens)]
    need = [math.ceil(f / block_size) for f in final]
    assert max_blocks >= max(need)
    num_blocks = sum(need) + 2
    free = [int(x) for x in rng.permutation(num_blocks)]
    bt = np.full((B, max_blocks), -1, dtype=np.int32)
    for b in range(B):
        for j in range(need[b]):                       # every block the replays will write, up front
            bt[b, j] = free.pop()
    past = np.asarray(past0, dtype=np.int32)
    if malformed:
        past[-1] = -1                                  # a padded, invalid sequence: no write, zero output
        bt[0, 0] = num_blocks + 1000                   # an out-of-range block id: masked on read, no write
    cum = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    cshape = (num_blocks, block_size, Hk, D)
    dev = {
        "query": cp.asarray(rng.standard_normal((N, H * D)).astype(T)),
        "key": cp.asarray(rng.standard_normal((N, Hk * D)).astype(T)),
        "value": cp.asarray(rng.standard_normal((N, Hk * D)).astype(T)),
        "key_cache": cp.asarray(rng.standard_normal(cshape).astype(T)),
        "value_cache": cp.asarray(rng.standard_normal(cshape).astype(T)),
        "cumulative_sequence_length": cp.asarray(cum),
        "past_seqlens": cp.asarray(past),
        "block_table": cp.asarray(bt),
    }
    eager = {k: v.copy() for k, v in dev.items()}
    op = cupa.PagedAttention(num_heads=H, kv_num_heads=Hk)
    step_len = cp.asarray(np.where(past < 0, 0, np.asarray(q_lens, dtype=np.int32)).astype(np.int32))
    g = cupa.capture_graph(lambda: op(**dev, attention_metadata=bound))
    identical = 0
    with g.stream:
        for _ in range(steps):
            g.replay()
            out_e = op(**eager, attention_metadata=bound)
            identical += int(bool(cp.array_equal(g.outputs, out_e)))
            for d in (dev, eager):
                d["past_seqlens"] += step_len          # grow in place, past the bound
        g.stream.synchronize()
    cp.cuda.runtime.deviceSynchronize()
    g.close()
    reached = int(np.max(np.where(past < 0, 0, past + steps * np.asarray(q_lens))))
    print(f"  {name:44s} bound {str(bound):12s} lengths up to {reached:5d}  "
          f"replay == eager at {identical}/{steps} steps")
    return identical == steps


def main():
    import cupy as cp

    if not cp.cuda.is_available():
        print("no CUDA device: nothing to sanitize")
        return 0
    cp.cuda.set_allocator(None)   # plain cudaMalloc per array outside the capture: exact bounds for memcheck
    rng = np.random.default_rng(int(os.environ.get("CUPA_TEST_SEED", "0")) or 20261130)
    cases = [
        dict(name="fp16 D=128 (tensor cores), block 16", dtype="float16", D=128, H=8, Hk=2, block_size=16,
             past0=[200, 300, 500, 700], q_lens=[1, 1, 1, 1], steps=8, bound=[1, 64], max_blocks=64, malformed=False),
        dict(name="fp16 D=128, bound [1, 1], malformed rows", dtype="float16", D=128, H=8, Hk=2, block_size=16,
             past0=[40, 900, 3, 5], q_lens=[1, 1, 1, 1], steps=6, bound=[1, 1], max_blocks=64, malformed=True),
        dict(name="fp32 D=64 (CUDA cores), block 1", dtype="float32", D=64, H=6, Hk=2, block_size=1,
             past0=[100, 513, 7], q_lens=[1, 1, 1], steps=6, bound=[1, 50], max_blocks=600, malformed=False),
        dict(name="fp16 D=64, block 64, MQA", dtype="float16", D=64, H=8, Hk=1, block_size=64,
             past0=[1000, 2000], q_lens=[1, 1], steps=6, bound=[1, 300], max_blocks=40, malformed=False),
        dict(name="prefill-shaped, query bound undersized", dtype="float16", D=128, H=8, Hk=2, block_size=16,
             past0=[0, 37, 300], q_lens=[5, 1, 9], steps=4, bound=[1, 16], max_blocks=32, malformed=False),
    ]
    t0 = time.perf_counter()
    print(f"cupa {cupa.__version__}: undersized attention_metadata bounds, captured and eager "
          f"(compute-sanitizer: {'yes' if os.environ.get('CUDA_INJECTION64_PATH') else 'not detected'})")
    results = [run_case(cp, rng, **c) for c in cases]
    print(f"summary: {len(results)} cases, {sum(results)} with replay == eager at every step, no CUDA error; "
          f"{time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
