"""Offline compile check: ``python -m cupa.compile --check [--arch sm_80,sm_90] [--jobs N]``.

Compiles every specialization of ``cupa.kernels.registry.all_specializations()`` for every
architecture with NVRTC (no GPU needed) and prints one line per specialization x arch: registers,
spill stores/loads, static shared memory, stack and compile time, then a summary. A WARNING line
marks each kernel that spills (reported, not fatal). The exit status is 1 when any compile fails,
2 when the registry cannot be loaded, 0 otherwise. ``--list`` prints the registry. A specialization
pinned to an arch-specific target (``Specialization.arch``: the sm_90a wgmma prefill) is compiled
for that target only, once, when an architecture of the same number (sm_90) is checked.

NVRTC releases the GIL while it compiles, so a thread pool runs ``--jobs`` compiles at once. Run as
a program it sets ``CUDA_CACHE_DISABLE=1`` (where a driver is installed, NVRTC would otherwise serve
repeated compiles from the compute cache, without ptxas statistics).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

from .jit import OfflineResult, Specialization, compile_offline, cuda_include_dirs, nvrtc_version

DEFAULT_ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120")


class RegistryUnavailable(RuntimeError):
    pass


def registry_specializations() -> list:
    """``cupa.kernels.registry.all_specializations()`` as a list; RegistryUnavailable when missing."""
    if importlib.util.find_spec("cupa.kernels.registry") is None:
        raise RegistryUnavailable("cupa.kernels.registry does not exist; it must define all_specializations() "
                                  "returning the Specialization of every kernel cupa launches")
    from .kernels import registry  # an error inside the registry propagates with its traceback

    fn = getattr(registry, "all_specializations", None)
    if fn is None:
        raise RegistryUnavailable("cupa.kernels.registry has no all_specializations() "
                                  "(it must return the Specialization of every kernel cupa launches)")
    specs = list(fn())
    bad = [s for s in specs if not isinstance(s, Specialization)]
    if bad:
        raise RegistryUnavailable(f"all_specializations() returned non-Specialization items, e.g. {bad[0]!r}")
    return specs


def _arch_number(arch: str) -> str:
    return re.sub(r"[af]$", "", arch)


def compile_tasks(specs, archs) -> list:
    """(spec, arch) pairs to compile: a portable spec for every arch; a spec pinned to an arch-specific
    target (``spec.arch``, e.g. sm_90a) once, for its own target, when an arch of the same number
    (sm_90 or sm_90a) is among ``archs`` (plain sm_90 cannot compile wgmma)."""
    numbers = {_arch_number(a) for a in archs}
    tasks = []
    for s in dict.fromkeys(specs):
        if s.arch:
            if _arch_number(s.arch) in numbers:
                tasks.append((s, s.arch))
        else:
            tasks.extend((s, a) for a in archs)
    return list(dict.fromkeys(tasks))


def check(specs, archs, jobs: int, out=None, verbose: bool = False) -> list:
    """Compile ``specs`` x ``archs`` on ``jobs`` threads, printing a line as each finishes."""
    out = sys.stdout if out is None else out
    tasks = compile_tasks(specs, archs)
    results: list = []
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = [pool.submit(compile_offline, s, a) for s, a in tasks]
        for fut in as_completed(futures):
            r: OfflineResult = fut.result()
            results.append(r)
            print(r.summary(), file=out, flush=True)
            if r.ok and not r.has_stats:
                print(f"WARNING: {r.spec} on {r.arch}: no ptxas statistics (compute-cache hit)", file=out, flush=True)
            if r.ok and r.spills:
                print(f"WARNING: {r.spec} spills on {r.arch}: {r.spill_store_bytes} B stores, "
                      f"{r.spill_load_bytes} B loads per thread ({r.registers} registers)", file=out, flush=True)
            if not r.ok or verbose:
                print("    " + r.log.strip().replace("\n", "\n    "), file=out, flush=True)
    order = {t: i for i, t in enumerate(tasks)}
    return sorted(results, key=lambda r: order[(r.spec, r.arch)])


def _warm_one(spec: Specialization) -> tuple:
    from .jit import get_kernel

    start = time.perf_counter()
    try:
        get_kernel(spec)
    except Exception as exc:  # reported, not fatal: the call that needs it reports it again
        return str(spec), time.perf_counter() - start, f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    return str(spec), time.perf_counter() - start, ""


def warm(specs, jobs: int) -> int:
    """Compile ``specs`` for the current device into the disk caches, in ``jobs`` processes (one CUDA
    context each); a specialization pinned to another arch than the device's is skipped."""
    import multiprocessing

    from .device import device_info

    device = device_info(0)
    runnable = [s for s in dict.fromkeys(specs) if not s.arch or _arch_number(s.arch) == device.arch]
    start = time.perf_counter()
    failed = 0
    with multiprocessing.get_context("spawn").Pool(max(1, jobs)) as pool:
        for name, seconds, error in pool.imap_unordered(_warm_one, runnable):
            failed += bool(error)
            print(f"{'FAIL' if error else 'ok  '} {name}  {seconds:.1f} s" + (f"  {error}" if error else ""),
                  flush=True)
    print(f"warm: {len(runnable) - failed}/{len(runnable)} specializations in the caches for {device} in "
          f"{time.perf_counter() - start:.0f} s")
    return 1 if failed else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cupa.compile", description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="compile every registered specialization offline")
    mode.add_argument("--list", action="store_true", help="print the registered specializations")
    mode.add_argument("--warm", action="store_true",
                      help="compile every specialization the current GPU can run into the kernel caches (CuPy's and "
                           "cupa's cubin cache), in --jobs processes, so a first call loads instead of compiling")
    parser.add_argument("--arch", default=",".join(DEFAULT_ARCHS),
                        help="comma-separated real architectures (default %(default)s; sm_90a for wgmma)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel compiles (default: CPUs)")
    parser.add_argument("--filter", default="", help="only specializations whose text contains this string")
    parser.add_argument("--verbose", action="store_true", help="print NVRTC's log for every compile")
    args = parser.parse_args(argv)
    if not args.list and importlib.util.find_spec("cupy_backends") is None:
        print("ERROR: the offline compile check needs CuPy's NVRTC binding: pip install 'cupa[cuda13]' "
              "(or 'cupa[cuda12]'); no GPU is needed", file=sys.stderr)
        return 2

    try:
        specs = registry_specializations()
    except RegistryUnavailable as exc:
        print(f"ERROR: {exc}", file=sys.stderr)
        return 2
    if args.filter:
        specs = [s for s in specs if args.filter in str(s)]
    if not specs:
        print("ERROR: no specializations to compile" + (f" match {args.filter!r}" if args.filter else
              " (all_specializations() returned none)"), file=sys.stderr)
        return 2

    if args.warm:
        return warm(specs, args.jobs)

    if args.list:
        for s in specs:
            print(f"{s.family:<12} {s.name_expression}" + (f"  [{' '.join(s.options)}]" if s.options else "")
                  + (f"  (only {s.arch})" if s.arch else ""))
        print(f"{len(specs)} specializations")
        return 0

    archs = [a.strip() for a in args.arch.split(",") if a.strip()]
    bad = [a for a in archs if not re.fullmatch(r"sm_\d+[af]?", a)]
    if bad or not archs:
        parser.error(f"--arch: got {args.arch!r}; expected real architectures like sm_80,sm_90,sm_90a")
    major, minor = nvrtc_version()
    pinned = sum(1 for s in dict.fromkeys(specs) if s.arch)
    print(f"NVRTC {major}.{minor}; headers: {cuda_include_dirs()[0]}; {len(specs) - pinned} specializations x "
          f"{len(archs)} archs ({', '.join(archs)})"
          + (f" + {pinned} pinned to an arch-specific target (compiled for it when its number is checked)"
             if pinned else "") + f" on {args.jobs} threads", flush=True)
    start = time.perf_counter()
    results = check(specs, archs, args.jobs, verbose=args.verbose)
    wall = time.perf_counter() - start
    failed = [r for r in results if not r.ok]
    spilled = [r for r in results if r.ok and r.spills]
    print(f"summary: {len(results) - len(failed)}/{len(results)} compiled, {len(failed)} failed, "
          f"{len(spilled)} spill; {wall:.1f} s wall, {sum(r.seconds for r in results):.1f} s NVRTC")
    for r in failed:
        print(f"FAILED: {r.spec} on {r.arch}")
    return 1 if failed else 0


if __name__ == "__main__":
    # With a driver installed, NVRTC answers a repeated compile from the CUDA compute cache and ptxas
    # prints no statistics; the variable is read when NVRTC loads, so set it before the first compile.
    os.environ.setdefault("CUDA_CACHE_DISABLE", "1")
    sys.exit(main())
