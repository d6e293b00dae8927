"""Cold start: the time from a fresh process to the first result of a decode call and of a prefill call.

``python benchmarks/cold_start.py [--out results/cold_start_h200.json]`` runs three child processes that
share one pair of fresh cache directories (``CUPA_CACHE_DIR`` for cupa's sm_90a cubins, ``CUPY_CACHE_DIR``
for CuPy's NVRTC cache, and ``CUDA_CACHE_DISABLE=1`` so the driver's JIT cache does not hide a compile):

- ``cold``: empty caches, so every kernel the calls need is compiled (NVRTC, and ptxas for cubins);
- ``warm``: the caches the cold run filled, in a new process (what a server restart sees);
- ``warm`` again, to show the spread.

Each child times ``import cupa`` + CuPy, then the first decode call (fp16, GQA 32/8, D=128, block 16,
B=8 x 2048 cached tokens) up to its result on the host, then the first prefill call (B=2 x 1024 new
tokens) the same way, then a second decode call (the in-process memo: no compile, no recipe build).
Every time is wall-clock and includes the device synchronization that makes the result visible.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import numpy as np
import cupy as cp
import cupa
cp.cuda.Device().synchronize()
t_import = time.perf_counter() - t0

H, HK, D, BS = 32, 8, 128, 16
rng = np.random.default_rng(0)

def inputs(q_lens, past):
    B = len(q_lens)
    total = [p + q for p, q in zip(past, q_lens)]
    nblk = [-(-t // BS) for t in total]
    bt = np.full((B, max(nblk)), -1, np.int32)
    nxt = 0
    for b, n in enumerate(nblk):
        bt[b, :n] = np.arange(nxt, nxt + n)
        nxt += n
    kc = cp.asarray(rng.standard_normal((nxt, BS, HK, D)).astype(np.float16))
    vc = cp.asarray(rng.standard_normal((nxt, BS, HK, D)).astype(np.float16))
    T = sum(q_lens)
    q = cp.asarray(rng.standard_normal((T, H * D)).astype(np.float16))
    k = cp.asarray(rng.standard_normal((T, HK * D)).astype(np.float16))
    v = cp.asarray(rng.standard_normal((T, HK * D)).astype(np.float16))
    cum = cp.asarray(np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32))
    return q, k, v, kc, vc, cum, cp.asarray(np.array(past, np.int32)), cp.asarray(bt)

decode = inputs([1] * 8, [2048] * 8)
prefill = inputs([1024, 1024], [0, 0])
cp.cuda.Device().synchronize()

def first(args):
    t = time.perf_counter()
    out = cupa.paged_attention(*args, num_heads=H, kv_num_heads=HK)
    host = cp.asnumpy(out)
    assert np.isfinite(host).all()
    return time.perf_counter() - t

t_decode = first(decode)
t_prefill = first(prefill)
t_decode2 = first(decode)
print(json.dumps({"import_s": t_import, "first_decode_s": t_decode, "first_prefill_s": t_prefill,
                  "second_decode_s": t_decode2, "device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode()}))
"""


def child(env) -> dict:
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        raise SystemExit(f"child failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    record = json.loads(proc.stdout.strip().splitlines()[-1])
    record["process_wall_s"] = wall
    return record


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the JSON result here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, CUPA_CACHE_DIR=str(Path(tmp) / "cupa"), CUPY_CACHE_DIR=str(Path(tmp) / "cupy"),
                   CUDA_CACHE_DISABLE="1")
        runs = {"cold": child(env), "warm": child(env), "warm_again": child(env)}
    for name, r in runs.items():
        print(f"{name:10s} import {r['import_s']:.2f} s  first decode {r['first_decode_s']:.2f} s  "
              f"first prefill {r['first_prefill_s']:.2f} s  second decode {r['second_decode_s'] * 1e3:.2f} ms  "
              f"process {r['process_wall_s']:.2f} s")
    if args.out:
        Path(args.out).write_text(json.dumps({"benchmark": "cold_start", "runs": runs}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
