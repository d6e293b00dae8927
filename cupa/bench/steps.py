"""Suites of whole steps and host-side costs: CUDA-graph replay, per-call host overhead, and the
serving toolkit's step builder.

- graphs (device only): a decode step (fp16, GQA 32/8, D=128, block 16, L=4096) of one layer and of a
  32-layer stack (32 separate caches), timed three ways: ``loop`` -- wall clock per step over many
  back-to-back steps, synchronized once (what a serving loop sees); ``gpu`` -- CUDA events around one
  step with L2 flushed; ``host`` -- time to enqueue one step while a spin kernel holds the GPU. Each
  eager and replayed (``cupa.capture_graph``). The headline figure is the replayed loop (median of 5
  loops), the eager loop its variant (ratio = eager / replayed).
- host: per-call host time of one eager call on a tiny problem (B=1, L=16), enqueued behind a spin
  kernel so that perf_counter sees Python and launch API time only: CuPy with and without ``out=``
  and attention_metadata, ``op.plan`` alone, ``cupa.paged_attention()``, PyTorch tensors, a graph
  replay, and the driver floor (the call's launches replayed alone): ``python_us`` = a row minus the
  floor. Rows are measured in turn, seven rounds over (the host's speed drifts), with the process
  pinned to one CPU. Without a device, the same call path runs against the test suite's fake CuPy
  (``tests/test_launch_fastpath.py``, present in a source checkout): cupa's own Python per call, both
  launch routes (``Options(launch=...)``), beside the fake's own floor.
- serving: the host cost of ``cupa.serving``'s step builder. The toolkit provides the cases:
  ``cupa.serving.benchmark_cases(size)`` returns ``(name, fn, params)`` triples, ``size`` being
  "full", "quick" or "smoke"; each ``fn()`` is one host operation, timed here as the median over
  repeats of many back-to-back calls. The suite is skipped, saying why, when the toolkit is absent.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import statistics
import time
from typing import Optional

import numpy as np

import cupa

from .cases import build, decode
from .suites import Context, Step, Suite, base_record, error_text
from .timing import Spinner, host_time_us, interleaved_host_times, loop_time_us, summarize_us

__all__ = ["GraphsSuite", "HostSuite", "ServingSuite", "per_call_us"]

_H, _HK, _D, _BS, _L = 32, 8, 128, 16, 4096


def per_call_us(fn, calls: int, repeats: int = 7) -> dict:
    """Wall clock per call of ``calls`` back-to-back ``fn()`` (median / min / max over ``repeats``)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return {"median_us": statistics.median(times), "min_us": min(times), "max_us": max(times), "calls": calls,
            "repeats": repeats}


def _decode_call(built, op, out, md):
    inputs = dict(built.call_inputs(), attention_metadata=md)
    return lambda: op(**inputs, out=out)


class GraphsSuite(Suite):
    name = "graphs"
    description = "decode step eager vs CUDA-graph replay (1 and 32 layers)"
    CONFIGS = {"full": [(1, 1), (8, 1), (1, 32), (8, 32)], "quick": [(1, 1), (8, 1)], "smoke": [(1, 1)]}

    def items(self, size: str) -> list:
        return [Step("graphs", f"B={B} layers={layers}", (("B", B), ("layers", layers), ("L", _L)))
                for B, layers in self.CONFIGS[size]]

    def skip_reason(self, ctx: Context) -> Optional[str]:
        return None if ctx.runtime.on_device else "CUDA graphs need a CUDA device"

    def run(self, step: Step, ctx: Context) -> dict:
        rt = ctx.runtime
        cp = rt.cp
        B, layers = step.param["B"], step.param["layers"]
        rec = base_record(step)
        steps = 200 if ctx.size == "full" else 50
        steps = steps if layers == 1 else steps // 4
        built = [build(decode(B, _L), cp, seed=i) for i in range(layers)]
        outs = [cp.empty_like(b.inputs["query"]) for b in built]
        op = cupa.PagedAttention(num_heads=_H, kv_num_heads=_HK)
        md = np.array([1, _L], dtype=np.int32)       # the replay-wide bound: the lengths served
        calls = [_decode_call(b, op, o, md) for b, o in zip(built, outs)]

        def eager():
            for call in calls:
                call()

        stream = cp.cuda.Stream(non_blocking=True)
        g = cupa.capture_graph(eager, stream=stream)
        spinner = Spinner(cp)
        d = {"kv_bytes": sum(b.case.kv_bytes() for b in built), "graph_private_pool_bytes": g.nbytes}
        sync = stream.synchronize
        loops = 5
        with stream:  # everything on the capture stream: replay() adds no event
            eager_loop = summarize_us([loop_time_us(sync, eager, steps) for _ in range(loops)], loops)
            replay_loop = summarize_us([loop_time_us(sync, g.replay, steps) for _ in range(loops)], loops)
            d["eager_loop_us"], d["replay_loop_us"] = eager_loop["median_us"], replay_loop["median_us"]
            d["eager_gpu_us"] = rt.timer.time_us(eager, reps=ctx.reps)["median_us"]
            d["replay_gpu_us"] = rt.timer.time_us(g.replay, reps=ctx.reps)["median_us"]
            d["eager_host_us"] = host_time_us(cp, spinner, eager, calls=max(1, 64 // layers), stream=stream)["median_us"]
            d["replay_host_us"] = host_time_us(cp, spinner, g.replay, calls=64, stream=stream)["median_us"]
        d["speedup_loop"] = d["eager_loop_us"] / d["replay_loop_us"]
        g.close()
        rec["cupa"] = {"status": "ok", **replay_loop, "figure": f"replayed step: wall clock per step over {steps} "
                       f"back-to-back steps ({loops} loops)"}
        rec["variants"]["eager"] = {"status": "ok", **eager_loop}
        rec["details"] = d
        del built, outs, calls
        rt.free()
        return rec


def _launch_floor(op, args, md, out):
    """``fn()`` that replays just the driver launches of one decode call of ``op`` (same grids, same
    pointers; no planning, no checks): the host cost no Python can remove. None where the call is not
    a workspace-free decode that has run once (its launch recipe is built by the first call)."""
    from cupa.contract import INPUT_NAMES
    from cupa.kernels import decode, launch

    plan = op.plan(*args, attention_metadata=md)
    recipe = plan.state.get("recipe")
    if plan.backend.name != "decode" or recipe is None or recipe.nbytes:
        return None
    inputs = dict.fromkeys(INPUT_NAMES)
    inputs.update(zip(INPUT_NAMES, args), attention_metadata=md)
    call = launch.prepare(plan.problem, inputs, out, None)
    ptrs = decode.launch_pointers(recipe, call, 0)
    stream_ptr = call.stream.ptr
    return lambda: recipe.launches(ptrs, stream_ptr)


class HostSuite(Suite):
    name = "host"
    description = "host time per eager call (tiny problem; GPU held busy, or a fake CuPy on the CPU)"
    FAKE_CALLS = {"full": 20000, "quick": 2000, "smoke": 50}

    def items(self, size: str) -> list:
        return [Step("host", "per-call host time")]

    def skip_reason(self, ctx: Context) -> Optional[str]:
        if ctx.runtime.on_device:
            return None
        try:
            importlib.import_module("tests.test_launch_fastpath")
        except Exception as exc:
            return f"no CUDA device, and the fake CuPy of a source checkout's tests/ does not import ({error_text(exc)})"
        return None

    def run(self, step: Step, ctx: Context) -> list:
        with _pinned_to_one_cpu() as cpu:
            rows = self._device_rows(ctx) if ctx.runtime.on_device else self._fake_rows(ctx)
        for rec in rows:
            rec.setdefault("details", {})["pinned_cpu"] = cpu
        return rows

    def _device_rows(self, ctx: Context) -> list:
        rt = ctx.runtime
        cp = rt.cp
        spinner = Spinner(cp)
        built = build(decode(1, 16), cp)
        op = cupa.PagedAttention(num_heads=_H, kv_num_heads=_HK)
        md = np.array([1, 16], dtype=np.int32)
        names = ("query", "key", "value", "key_cache", "value_cache", "cumulative_sequence_length", "past_seqlens",
                 "block_table")
        args = tuple(built.inputs[n] for n in names)
        out = cp.empty_like(args[0])
        fns = {
            "cupy, out=": (lambda: op(*args, attention_metadata=md, out=out), None),
            "cupy, no out": (lambda: op(*args, attention_metadata=md), None),
            "cupy, no metadata": (lambda: op(*args, out=out), None),
            "cupy, op.plan only": (lambda: op.plan(*args, attention_metadata=md), None),
            "cupy, paged_attention()": (lambda: cupa.paged_attention(*args, attention_metadata=md, out=out,
                                                                     num_heads=_H, kv_num_heads=_HK), None),
        }
        op(*args, attention_metadata=md, out=out)
        try:
            floor = _launch_floor(op, args, md, out)
        except Exception:  # the launch internals changed: no floor row
            floor = None
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
        res = interleaved_host_times(cp, spinner, fns, calls=100 if ctx.size != "smoke" else 10,
                                     rounds=7 if ctx.size == "full" else 3)
        g.close()
        floor_us = res.get("launches only (driver floor)", {}).get("median_us")
        rows = []
        for name, r in res.items():
            rec = base_record(Step("host", name))
            rec["cupa"] = {"status": "ok", **r}
            if floor_us is not None and name not in ("launches only (driver floor)", "graph replay (1 call)",
                                                     "cupy, op.plan only"):
                rec["details"] = {"python_us": r["median_us"] - floor_us}
            rows.append(rec)
        rt.free()
        return rows

    def _fake_rows(self, ctx: Context) -> list:
        fastpath = importlib.import_module("tests.test_launch_fastpath")
        calls = self.FAKE_CALLS[ctx.size]
        rows = []
        for mode in ("fast", "rawkernel"):
            fake = fastpath.FakeCupy(real_arrays=_cupy_importable())
            with fastpath.fake_cupy(fake):
                fake.record = False
                for label, B, L in (("tiny B=1 L=16", 1, 16), ("B=8 L=4096 (split)", 8, 4096)):
                    rows += self._fake_problem(fastpath, fake, mode, label, B, L, calls)
        return rows

    @staticmethod
    def _fake_problem(fastpath, fake, mode: str, label: str, B: int, L: int, calls: int) -> list:
        """Rows of one problem against the fake CuPy, and the fake's own floor: the same number of fake
        allocations and launches called directly (what the fake costs, not cupa)."""
        x, attrs = fastpath.fake_case(fake, B=B, L=L, H=_H, Hk=_HK, D=_D, bs=_BS)
        names = ("query", "key", "value", "key_cache", "value_cache", "cumulative_sequence_length", "past_seqlens",
                 "block_table")
        args = tuple(x[n] for n in names)
        options = cupa.Options(launch=mode)
        op = cupa.PagedAttention(**attrs, options=options)
        out = fake.empty(x["query"].shape, x["query"].dtype)
        md = np.array([1, L], dtype=np.int32)
        op(*args, attention_metadata=md, out=out)
        fake.launches.clear(), fake.allocations.clear()
        op(*args, attention_metadata=md, out=out)
        launches, allocations = len(fake.launches), len(fake.allocations)
        fake._functions.setdefault(0xF001, "fake_floor_kernel")

        def fake_floor():
            for _ in range(allocations):
                fake.cuda.alloc(1024)
            for _ in range(launches):
                fake.cuda.driver.launchKernel(0xF001, 1, 1, 1, 128, 1, 1, 0, 0, 1, 0)

        rows = []
        for what, fn in (("op(..., out=)", lambda: op(*args, attention_metadata=md, out=out)),
                         ("op(...) no out", lambda: op(*args, attention_metadata=md)),
                         ("op.plan", lambda: op.plan(*args, attention_metadata=md)),
                         ("paged_attention()", lambda: cupa.paged_attention(*args, attention_metadata=md, out=out,
                                                                             num_heads=_H, kv_num_heads=_HK,
                                                                             options=options)),
                         ("fake floor", fake_floor)):
            rec = base_record(Step("host", f"fake cupy {mode}: {what} {label}", (("mode", mode), ("B", B), ("L", L))))
            try:
                rec["cupa"] = {"status": "ok", **per_call_us(fn, calls)}
            except Exception as exc:
                rec["cupa"] = {"status": "error", "reason": error_text(exc)}
            rec["details"] = {"kernels_per_call": launches, "allocations_per_call": allocations}
            rows.append(rec)
        return rows


@contextlib.contextmanager
def _pinned_to_one_cpu():
    """Pin the process to the last CPU it may run on (host timings drift less), restoring it after;
    yields that CPU, or None where affinity cannot be set."""
    if not hasattr(os, "sched_setaffinity"):
        yield None
        return
    saved = os.sched_getaffinity(0)
    cpu = max(saved)
    try:
        os.sched_setaffinity(0, {cpu})
    except OSError:
        yield None
        return
    try:
        yield cpu
    finally:
        os.sched_setaffinity(0, saved)


def _cupy_importable() -> bool:
    try:
        import cupy  # noqa: F401
    except Exception:
        return False
    return True


class ServingSuite(Suite):
    name = "serving"
    description = "host cost of the serving toolkit's step builder (cupa.serving)"

    def items(self, size: str) -> list:
        return [Step("serving", "host step")]

    def skip_reason(self, ctx: Context) -> Optional[str]:
        try:
            serving = importlib.import_module("cupa.serving")
        except ImportError:
            return "cupa.serving is not part of this build"
        if not hasattr(serving, "benchmark_cases"):
            return "cupa.serving has no benchmark_cases(size) (the hook this suite times)"
        return None

    def run(self, step: Step, ctx: Context) -> list:
        serving = importlib.import_module("cupa.serving")
        calls = {"full": 2000, "quick": 200, "smoke": 5}[ctx.size]
        rows = []
        for name, fn, params in serving.benchmark_cases(ctx.size):
            rec = base_record(Step("serving", name, tuple(sorted(dict(params or {}).items()))))
            try:
                rec["cupa"] = {"status": "ok", **per_call_us(fn, calls)}
            except Exception as exc:
                rec["cupa"] = {"status": "error", "reason": error_text(exc)}
            rows.append(rec)
        return rows

