"""``python -m cupa.bench``: run the suites, print the summary, write JSON, markdown and plots."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from . import report
from .peers import all_peers
from .runtime import CudaRuntime, NumpyRuntime
from .suites import Context, all_suites, error_text

__all__ = ["main", "build_parser", "select"]

REPS = {"full": 30, "quick": 10, "smoke": 3}
#: Bytes of the run-wide read probe (the roofline's starting point).
ROOF_READ_BYTES = {"full": 2 << 30, "quick": 2 << 30, "smoke": 1 << 20}


def build_parser() -> argparse.ArgumentParser:
    suites = ", ".join(all_suites())
    p = argparse.ArgumentParser(
        prog="python -m cupa.bench",
        description="Benchmark cupa against its peers in one run: every suite, the same inputs and L2 flush for "
                    "every implementation, rooflines measured in the same process. Writes JSON, a markdown table "
                    "and PNG plots next to it.",
        epilog=f"suites: {suites}. See docs/benchmarks.md.")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="a few cases per suite, 10 runs each")
    size.add_argument("--smoke", action="store_true",
                      help="CPU smoke run: tiny shapes on the NumPy reference backend, no peers (what CI runs)")
    p.add_argument("--only", default="",
                   help="comma-separated suites, 'suite:text' (that suite's cases whose name contains text) or "
                        "text (any case whose suite/name contains it)")
    p.add_argument("--out", default="results.json", help="result JSON (default results.json); the markdown "
                                                          "table and the plots are written next to it")
    p.add_argument("--compare", metavar="OLD_JSON", help="a result file of an earlier run: old / new time per case")
    peers = p.add_mutually_exclusive_group()
    peers.add_argument("--peers", default="", help="comma-separated peer names to run (default: every peer)")
    peers.add_argument("--no-peers", action="store_true", help="time cupa alone")
    p.add_argument("--reps", type=int, default=0, help="timed runs per measurement (default 30; --quick 10)")
    p.add_argument("--flush", choices=("read", "memset"), default="read",
                   help="how L2 is flushed before each run (default read: a 2 GiB write then read)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--list", action="store_true", help="list the selected cases and peers, run nothing")
    p.add_argument("--merge", nargs="+", metavar="JSON",
                   help="merge result files (for example one per suite) into --out and regenerate its table and "
                        "plots; measures nothing")
    return p


def select(suites: dict, size: str, only: str) -> list:
    """``[(suite, [items])]`` chosen by ``--only`` (everything when empty)."""
    tokens = [t.strip() for t in only.split(",") if t.strip()]
    chosen = []
    for name, suite in suites.items():
        items = suite.items(size)
        if tokens:
            keep = []
            for item in items:
                for t in tokens:
                    s, _, text = t.partition(":")
                    if (t == name or (text and s == name and text in item.name)
                            or (not text and t not in suites and t in item.id)):
                        keep.append(item)
                        break
            items = keep
        if items:
            chosen.append((suite, items))
    return chosen


class Progress:
    """A tqdm bar on a terminal when tqdm is installed, else one plain line per case (logs stay readable)."""

    def __init__(self, total: int):
        self.total, self.done = total, 0
        self.bar = None
        if sys.stderr.isatty():
            try:
                from tqdm import tqdm
            except ImportError:
                pass
            else:
                self.bar = tqdm(total=total, unit="case", dynamic_ncols=True, file=sys.stderr)

    def start(self, label: str) -> None:
        if self.bar is not None:
            self.bar.set_description(label[:60])

    def finish(self, lines: list) -> None:
        self.done += 1
        for line in lines:
            if self.bar is not None:
                self.bar.write(line)
            else:
                print(f"[{self.done}/{self.total}] {line}", flush=True)
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _line(rec: dict) -> str:
    m = rec.get("cupa") or {}
    if m.get("status") == "ok":
        head = f"{rec['id']}: cupa {m['median_us']:.1f} us" + (f" ({m['backend']})" if m.get("backend") else "")
    else:
        head = f"{rec['id']}: cupa {m.get('status')}"
    parts = []
    for kind, name, e in report.measurements(rec):
        if kind == "cupa" or not isinstance(e, dict):
            continue
        if e.get("status") == "ok":
            ratio = (f" {e['median_us'] / m['median_us']:.2f}x" if m.get("status") == "ok" else "")
            parts.append(f"{name} {e['median_us']:.1f} us{ratio}")
        elif e.get("status") != "same as default":
            parts.append(f"{name} {e.get('status')}")
    return head + ("; " + ", ".join(parts) if parts else "")


def _outputs(payload: dict, out: Path, plots: bool) -> list:
    written = [out]
    report.write_json(out, payload)
    md = out.with_suffix(".md")
    md.write_text(report.markdown(payload))
    written.append(md)
    if plots:
        try:
            from .plots import write_plots

            written += write_plots(payload, out)
        except ImportError as exc:
            print(f"plots skipped: {error_text(exc)} (pip install cupa[bench])", file=sys.stderr)
    return written


def _peer_table(peers: list, selected: list, smoke: bool, no_peers: bool) -> dict:
    table = {}
    for p in peers:
        entry = {"description": p.description}
        if smoke:
            entry.update(status="not run", reason="smoke mode (NumPy backend)")
        elif no_peers or p not in selected:
            entry.update(status="not selected")
        else:
            ok, info = p.available()
            entry.update(status="available", version=info) if ok else entry.update(status="missing", reason=info)
        table[p.name] = entry
    return table


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    out = Path(args.out)
    if args.merge:
        return _publish(report.merge([report.load(p) for p in args.merge], args.merge), args, out)

    size = "smoke" if args.smoke else "quick" if args.quick else "full"
    suites = all_suites()
    chosen = select(suites, size, args.only)
    peers = all_peers()
    wanted = {t.strip() for t in args.peers.split(",") if t.strip()}
    unknown = wanted - {p.name for p in peers}
    if unknown:
        print(f"--peers: unknown {sorted(unknown)}; peers are {[p.name for p in peers]}", file=sys.stderr)
        return 2
    selected = [] if (args.smoke or args.no_peers) else [p for p in peers if not wanted or p.name in wanted]
    if args.list:
        for suite, items in chosen:
            print(f"{suite.name} ({len(items)}): {suite.description}")
            for item in items:
                print(f"  {item.id}")
        print("peers: " + (", ".join(p.name for p in selected) or "none"))
        return 0
    if not chosen:
        print(f"--only {args.only!r} selects no case", file=sys.stderr)
        return 2

    if args.smoke:
        runtime = NumpyRuntime()
    else:
        try:
            runtime = CudaRuntime(flush=args.flush)
        except Exception as exc:
            print(f"no usable CUDA device ({error_text(exc)}); run `python -m cupa.bench --smoke` for the CPU "
                  "smoke run", file=sys.stderr)
            return 2
    reps = args.reps or REPS[size]
    ctx = Context(runtime, selected, reps, size, seed=args.seed)
    t0 = time.time()
    with runtime.stream_context():
        read = runtime.read_probe(ROOF_READ_BYTES[size], reps)
        runtime.release_probe()
        gemm = runtime.gemm_probe(reps)
    ctx.rooflines = {"read": read, "gemm": gemm}
    runtime.free()
    suite_table = {name: {"status": "not selected", "description": s.description} for name, s in suites.items()}
    runnable = []
    for suite, items in chosen:
        why = suite.skip_reason(ctx)
        suite_table[suite.name].update(status="skipped" if why else "ran", cases=len(items))
        if why:
            suite_table[suite.name]["reason"] = why
            print(f"{suite.name}: skipped ({why})", file=sys.stderr)
        else:
            runnable.append((suite, items))
    progress = Progress(sum(len(items) for _, items in runnable))
    cases = []
    for suite, items in runnable:
        for item in items:
            progress.start(item.id)
            try:
                recs = suite.run(item, ctx)
            except Exception as exc:  # a case that breaks its suite's runner: recorded, the run goes on
                recs = {"suite": suite.name, "case": item.name, "id": item.id, "params": {}, "tags": {},
                        "cupa": {"status": "error", "reason": error_text(exc)}, "variants": {}, "peers": {}}
            recs = recs if isinstance(recs, list) else [recs]
            cases += recs
            progress.finish([_line(r) for r in recs])
    progress.close()
    runtime.release_probe()

    payload = {"schema": report.SCHEMA, "command": "python -m cupa.bench " + " ".join(argv if argv is not None
                                                                                    else sys.argv[1:]),
               "size": size, "reps": reps, "flush": runtime.timer.mode, "timing": runtime.timing(reps),
               "seed": args.seed,
               "environment": runtime.environment(), "elapsed_s": round(time.time() - t0, 1),
               "probes": [{"read": read, "gemm": gemm}],
               "peers": _peer_table(peers, selected, args.smoke, args.no_peers), "suites": suite_table,
               "cases": cases}
    return _publish(report.finalize(payload), args, out)


def _publish(payload: dict, args, out: Path) -> int:
    """Compare with ``--compare``, print the summary, write the JSON, the markdown and the plots."""
    if args.compare:
        report.compare(payload, report.load(args.compare), args.compare)
    print("\n".join(report.summary_lines(payload) + report.compare_lines(payload)))
    for path in _outputs(payload, out, not args.no_plots):
        print(f"wrote {path}")
    return 0
