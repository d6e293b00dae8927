"""Per-CTA timeline of the tensor-core decode kernel: where a decode call's time goes.

A copy of ``cuda_src`` whose ``decode_mma.cu`` is instrumented -- thread 0 of every CTA writes
``%globaltimer`` at entry, after ``griddepcontrol.wait``, when its first tile is ready, at the end
of its key loop, after its rows are stored and at exit, and its SM id -- replaces the library's
sources for this process only (``jit.SOURCE_DIR``; the package is untouched). One call of a
decode shape is timed (``cupa.bench``'s timer: CUDA events, L2 flushed, median of ``--reps``), then
one more call is traced and summarized: quantiles (0, 10, 50, 90, 100%) across CTAs of each event in us after the
first CTA's entry, of each CTA's key-loop time and of its merge time (stored -> exit), CTAs per SM,
when each SM's last CTA ended, and the loop times and exits of the CTAs grouped by how many CTAs
their SM ran. ``--raw FILE.npy`` also saves every CTA's timestamps (ns) and SM id.

    python benchmarks/trace_decode.py --B 8 --L 8192 [--cache int8] [--decode-only] [--out trace.json] [--raw t.npy]

``--decode-only`` drops the prologue launch (the decode kernel alone; its results are then not the
attention of the call). The instrumented kernel is a little slower than the library's (two global
stores per CTA and event): compare its timings with each other, and the call times with
``python -m cupa.bench``.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import cupa  # noqa: E402
import trace_common  # noqa: E402
from cupa import jit  # noqa: E402
from cupa.kernels import decode, launch  # noqa: E402

MAX_CTAS = 1 << 16
EVENTS = ("entry", "waited", "first_tile", "loop_end", "stored", "exit")

_HELPERS = r'''
__device__ unsigned long long cupa_trace[%d * 8];
__device__ __forceinline__ void cupa_trace_event(int i) {
  if (threadIdx.x != 0) return;
  const unsigned long long c = blockIdx.x + (unsigned long long)gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  if (c >= %d) return;
  unsigned long long now;
  asm volatile("mov.u64 %%0, %%%%globaltimer;" : "=l"(now));
  cupa_trace[c * 8 + i] = now;
  if (i == 0) {
    unsigned sm;
    asm volatile("mov.u32 %%0, %%%%smid;" : "=r"(sm));
    cupa_trace[c * 8 + 7] = sm;
  }
}
''' % (MAX_CTAS, MAX_CTAS)

# (pattern in decode_mma.cu, text inserted after each match with the match's indentation, matches
# expected: 1, or 0 for "at least one" -- the key loop exists once per loop variant)
_PROBES = (
    (r"^constexpr int KEY_TILE = 64;\n", _HELPERS, 1),
    (r"^( *)const int tid = threadIdx\.x, warp = tid >> 5, lane = tid & 31;\n", "cupa_trace_event(0);\n", 1),
    (r"^( *)grid_dependency_wait\(\);\n *if \(!q_is_input\) load_q\(\);\n", "cupa_trace_event(1);\n", 1),
    (r"^( *)const int stage = tile % NST;\n", "if (tile == 0) cupa_trace_event(2);\n", 0),
    (r"^( *)cp_async_wait<0>\(\);\n *__syncthreads\(\);\n", "cupa_trace_event(3);\n", 0),
)
_BEFORE_END = ("  if (!direct)\n    merge_splits_if_last", "  cupa_trace_event(4);\n")


def instrumented_sources(dst: str) -> str:
    """Copy cuda_src into ``dst`` with the probes in decode_mma.cu; returns the copy's directory."""
    src_dir = os.path.join(dst, "cuda_src")
    shutil.copytree(jit.SOURCE_DIR, src_dir)
    path = os.path.join(src_dir, "decode_mma.cu")
    text = open(path).read()
    for pattern, insert, expected in _PROBES:
        found = len(re.findall(pattern, text, flags=re.MULTILINE))
        if found == 0 or (expected and found != expected):
            raise RuntimeError(f"trace_decode: {pattern!r} found {found} times in decode_mma.cu")
        text = re.sub(pattern, lambda m: m.group(0) + (m.group(1) if m.groups() else "") + insert, text,
                      flags=re.MULTILINE)
    anchor, insert = _BEFORE_END
    if text.count(anchor) != 1:
        raise RuntimeError(f"trace_decode: anchor {anchor!r} not found once in decode_mma.cu")
    text = text.replace(anchor, insert + anchor)
    if not text.rstrip().endswith("}"):
        raise RuntimeError("trace_decode: decode_mma.cu does not end with the kernel's closing brace")
    text = text.rstrip()[:-1] + "  cupa_trace_event(5);\n}\n"
    open(path, "w").write(text)
    return src_dir


def summarize(t) -> dict:
    """Quantiles of the per-CTA timestamps ``t`` (rows of EVENTS in ns, then the SM id; rows without an
    entry are ignored), in us after the first CTA's entry."""
    t = t[t[:, 0] > 0]
    base = t[:, 0].min()
    res = {"ctas": int(len(t))}
    for i, name in enumerate(EVENTS):
        hit = t[:, i] > 0
        if hit.any():
            res[name + "_us"] = trace_common.quantiles((t[hit, i] - base) / 1000.0)
    looped = (t[:, 2] > 0) & (t[:, 3] > 0)
    res["loop_us"] = trace_common.quantiles((t[looped, 3] - t[looped, 2]) / 1000.0)
    merged = (t[:, 4] > 0) & (t[:, 5] > 0)
    res["merge_us"] = trace_common.quantiles((t[merged, 5] - t[merged, 4]) / 1000.0)
    sm = t[:, 7]
    per_sm = np.bincount(sm)
    res["sms_with_n_ctas"] = np.bincount(per_sm).tolist()
    ended = t[:, 5] > 0  # (CTAs of splits without admitted keys return before the last probe)
    finish = np.full(len(per_sm), -1.0)
    np.maximum.at(finish, sm[ended], (t[ended, 5] - base) / 1000.0)
    res["sm_finish_us"] = trace_common.quantiles(finish[finish >= 0])
    # Key-loop time and exit of the CTAs grouped by how many CTAs their SM ran (SM-level contention)
    for n in np.unique(per_sm):
        on = per_sm[sm] == n
        if (on & looped).any():
            res[f"loop_us_on_sms_with_{n}"] = trace_common.quantiles(
                (t[on & looped, 3] - t[on & looped, 2]) / 1000.0)
        if (on & ended).any():
            res[f"exit_us_on_sms_with_{n}"] = trace_common.quantiles((t[on & ended, 5] - base) / 1000.0)
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--B", type=int, default=8)
    ap.add_argument("--L", type=int, default=8192)
    ap.add_argument("--H", type=int, default=32)
    ap.add_argument("--Hk", type=int, default=8)
    ap.add_argument("--cache", default="float16", choices=("float16", "int8", "fp8"))
    ap.add_argument("--decode-only", action="store_true", help="launch the decode kernel without the prologue")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default="")
    ap.add_argument("--raw", default="", help="save the per-CTA timestamps (ns; columns: events, then SM id) as .npy")
    args = ap.parse_args(argv)
    import cupy as cp

    from cupa.bench.cases import build, decode as decode_case
    from cupa.bench.timing import Timer

    timer = Timer(cp)
    cache = {"float16": "T", "int8": "int8", "fp8": "fp8"}[args.cache]
    sequence = launch.Sequence
    if args.decode_only:
        decode.launch.Sequence = lambda steps, n: sequence(steps[1:], n)
    try:
        with trace_common.instrumented(cp, instrumented_sources) as modules:
            built = build(decode_case(args.B, args.L, num_heads=args.H, kv_num_heads=args.Hk, cache=cache), cp)
            op = cupa.PagedAttention(**built.attributes)
            inputs = built.call_inputs()
            out = cp.empty_like(inputs["query"])

            def call():
                op(**inputs, out=out)

            timed = timer.time_us(call, reps=args.reps)
            trace = trace_common.trace_buffer(cp, modules, "cupa_trace", MAX_CTAS * 8)
            if trace is None:
                raise RuntimeError("trace_decode: the call did not run paged_decode_mma (fp16/bf16, head_size 64/128)")
            timer.flush()
            call()
            cp.cuda.get_current_stream().synchronize()
    finally:
        decode.launch.Sequence = sequence
    t = cp.asnumpy(trace).reshape(-1, 8).astype(np.int64)
    if args.raw:  # row c: CTA blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z); zeros: no entry
        trace_common.save_raw(args.raw, t)
    res = {"B": args.B, "L": args.L, "H": args.H, "Hk": args.Hk, "cache": args.cache,
           "decode_only": args.decode_only, "call_us": round(timed["median_us"], 2)}
    res.update(summarize(t))
    trace_common.report(res, args.out)


if __name__ == "__main__":
    main()
