"""Per-item timeline of the warp-specialized wgmma prefill: where a prefill call's time goes around items.

A copy of ``cuda_src`` whose ``prefill_wgmma_ws.cu`` is instrumented replaces the library's sources for
this process only (``jit.SOURCE_DIR``; the package is untouched): thread 0 of every CTA writes
``%globaltimer`` at entry, and lane 0 of the first consumer warp (warpgroup 0) writes it for each of
the CTA's first MAX_ITEMS work items when the item's Q buffer is ready, before its first turn, after
that turn's softmax, at the end of its tile loop, after its last turn (before the epilogue) and after
the epilogue, with the item's key tiles. One call of a prefill shape is timed (``cupa.bench``'s
timer: CUDA events, L2 flushed, median of ``--reps``), then one more call is traced and summarized
over the items (means, ns): the wait for the item's Q (``ready``: from the previous item's epilogue, or
from the CTA's entry for its first item), the first turn (its S alone and its softmax), the time a
further key tile takes, the last turn (its P V alone), the epilogue, and their shares of the summed
CTA time; quantiles (0, 10, 50, 90, 100%) of the CTAs' entries, first items and ends, in us after the
first entry. ``--raw FILE.npy`` also saves every CTA's timestamps.

    python benchmarks/trace_prefill_ws.py --B 4 --q 2048 [--past 0] [--block 256] [--out trace.json] [--raw t.npy]

The instrumented kernel is a little slower than the library's (a global store per item and event):
compare its phases with each other, and call times with ``python -m cupa.bench``.
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

MAX_CTAS = 1024
MAX_ITEMS = 64
#: per item: Q ready, first turn starts, first softmax done, tile loop done, last turn done, epilogue done
EVENTS = ("ready", "turn0", "softmax0", "loop_end", "last", "stored")
SLOTS = 1 + MAX_ITEMS * 8  # a CTA's row: its entry, then per item the events and its tile count

_HELPERS = r'''
__device__ unsigned long long cupa_ws_trace[%d * %d];
__device__ __forceinline__ unsigned long long cupa_ws_now() {
  unsigned long long now;
  asm volatile("mov.u64 %%0, %%%%globaltimer;" : "=l"(now));
  return now;
}
// Event e of the CTA's item n, from lane 0 of the first consumer warp (thread 256); ntiles >= 0: also the item's tiles.
__device__ __forceinline__ void cupa_ws_event(unsigned n, int e, int ntiles = -1) {
  if (threadIdx.x != 256 || blockIdx.x >= %d || n >= %d) return;
  unsigned long long* row = cupa_ws_trace + (unsigned long long)blockIdx.x * %d + 1 + n * 8;
  row[e] = cupa_ws_now();
  if (ntiles >= 0) row[7] = (unsigned long long)ntiles;
}
''' % (MAX_CTAS, SLOTS, MAX_CTAS, MAX_ITEMS, SLOTS)

# (pattern in prefill_wgmma_ws.cu, text inserted after each match with the match's indentation (before
# it, where the third field is "before"), matches expected)
_PROBES = (
    (r"^// Named barriers \(0 is __syncthreads\)", _HELPERS, "before", 1),
    (r"^( *)const int tid = threadIdx\.x, warp = tid >> 5, lane = tid & 31;\n",
     "if (tid == 0 && blockIdx.x < %d) cupa_ws_trace[(unsigned long long)blockIdx.x * %d] = cupa_ws_now();\n"
     % (MAX_CTAS, SLOTS), "after", 1),
    (r"^( *)mbar_wait\(q_full\(buf\), \(n >> 1\) & 1\);\n *const int ntiles = sItem\[buf\]\.ntiles;\n",
     "cupa_ws_event(n, 0);\n", "after", 1),
    (r"^( *)if \(ntiles > 0\) \{\n *// Turn 0", "cupa_ws_event(n, 1, ntiles);\n", "before", 1),
    (r"^( *)softmax_tile\(0\);\n", "cupa_ws_event(n, 2);\n", "after", 1),
    (r"^( *)// Last turn: P V of the last tile\.\n", "cupa_ws_event(n, 3);\n", "before", 1),
    (r"^( *)bar_sync\(WS_BAR_WG \+ u, 128\);\n", "cupa_ws_event(n, 4);\n", "before", 1),
    (r"^( *)mbar_arrive\(q_empty\(buf\)\);.*\n", "cupa_ws_event(n, 5);\n", "after", 1),
)


def instrumented_sources(dst: str) -> str:
    """Copy cuda_src into ``dst`` with the probes in prefill_wgmma_ws.cu; returns the copy's directory."""
    src_dir = os.path.join(dst, "cuda_src")
    shutil.copytree(jit.SOURCE_DIR, src_dir)
    path = os.path.join(src_dir, "prefill_wgmma_ws.cu")
    text = open(path).read()
    for pattern, insert, where, expected in _PROBES:
        found = len(re.findall(pattern, text, flags=re.MULTILINE))
        if found != expected:
            raise RuntimeError(f"trace_prefill_ws: {pattern!r} found {found} times in prefill_wgmma_ws.cu")

        def put(m, insert=insert, where=where):
            indent = m.group(1) if m.groups() else ""
            return m.group(0) + indent + insert if where == "after" else indent + insert + m.group(0)

        text = re.sub(pattern, put, text, flags=re.MULTILINE)
    open(path, "w").write(text)
    return src_dir


def summarize(t) -> dict:
    """Per-item phases of the per-CTA rows ``t`` (entry, then per item EVENTS and its tiles at slot 7; ns;
    rows without an entry are ignored, and so are items without all six events: items without key tiles,
    items past MAX_ITEMS)."""
    t = t[t[:, 0] > 0]
    base = t[:, 0].min()
    items = t[:, 1:].reshape(len(t), MAX_ITEMS, 8)
    phases = {"ready": [], "turn0": [], "tile": [], "last": [], "epilogue": []}
    totals = dict.fromkeys(phases, 0.0)
    tiles_total = 0
    first_item, ends = [], []
    for c in range(len(t)):
        prev_end = t[c, 0]
        done = [n for n in range(MAX_ITEMS) if (items[c, n, :6] > 0).all()]
        for n in done:
            e = items[c, n]
            ntiles = int(e[7])
            ready = e[0] - prev_end
            phases["ready"].append(ready)
            phases["turn0"].append(e[2] - e[1])
            phases["last"].append(e[4] - e[3])
            phases["epilogue"].append(e[5] - e[4])
            if ntiles > 1:
                phases["tile"].append((e[3] - e[2]) / (ntiles - 1))
            totals["ready"] += ready
            totals["turn0"] += e[2] - e[1]
            totals["tile"] += e[3] - e[2]
            totals["last"] += e[4] - e[3]
            totals["epilogue"] += e[5] - e[4]
            tiles_total += ntiles
            prev_end = e[5]
        if done:
            first_item.append((items[c, done[0], 0] - base) / 1000.0)
            ends.append((prev_end - base) / 1000.0)
    span = sum(totals.values())
    res = {"ctas": int(len(t)), "items": len(phases["ready"]), "tiles": tiles_total,
           "entry_us": trace_common.quantiles((t[:, 0] - base) / 1000.0),
           "first_item_ready_us": trace_common.quantiles(first_item), "end_us": trace_common.quantiles(ends)}
    for name, values in phases.items():
        res[f"{name}_ns_mean"] = round(float(np.mean(values)), 1) if values else None
        res[f"{name}_share"] = round(totals[name] / span, 4) if span else None
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--B", type=int, default=4)
    ap.add_argument("--q", type=int, default=2048)
    ap.add_argument("--past", type=int, default=0)
    ap.add_argument("--block", type=int, default=256)
    ap.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default="")
    ap.add_argument("--raw", default="", help="save the per-CTA timestamps (ns) as .npy")
    args = ap.parse_args(argv)
    import cupy as cp

    from cupa.bench.cases import build, chunked, prefill
    from cupa.bench.timing import Timer

    timer = Timer(cp)
    kw = dict(block_size=args.block, dtype=args.dtype)
    case = chunked(args.B, args.past, args.q, **kw) if args.past else prefill(args.B, args.q, **kw)
    with trace_common.instrumented(cp, instrumented_sources) as modules:
        built = build(case, cp)
        op = cupa.PagedAttention(**built.attributes, options=cupa.Options(backend="prefill_wgmma"))
        inputs = built.call_inputs()

        def call():
            op(**inputs)

        timed = timer.time_us(call, reps=args.reps)
        trace = trace_common.trace_buffer(cp, modules, "cupa_ws_trace", MAX_CTAS * SLOTS)
        if trace is None:
            raise RuntimeError("trace_prefill_ws: the call did not run paged_prefill_wgmma_ws")
        timer.flush()
        call()
        cp.cuda.get_current_stream().synchronize()
    t = cp.asnumpy(trace).reshape(MAX_CTAS, SLOTS).astype(np.int64)
    if args.raw:
        trace_common.save_raw(args.raw, t)
    res = {"B": args.B, "q": args.q, "past": args.past, "block": args.block, "dtype": args.dtype,
           "call_us": round(timed["median_us"], 2)}
    res.update(summarize(t))
    trace_common.report(res, args.out)


if __name__ == "__main__":
    main()
