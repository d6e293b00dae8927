"""Time the decode and prefill benchmark cases with whichever ``cupa`` is first on ``sys.path``.

An A/B of two source trees runs this script once per tree in one device session, each with its tree
first on PYTHONPATH and its own kernel cache::

    for tree in before after; do
        CUPA_CACHE_DIR=/tmp/cache-$tree PYTHONPATH=$tree python3 benchmarks/ab_trees.py --label $tree --out $tree.json
    done

Only the public API of the tree under test is used (``cupa.PagedAttention``, ``cupa.Options``), so the
same script times older trees. The timer is this repository's (cupa/bench/timing.py, loaded by path):
CUDA events, L2 flushed before each run, median of ``--reps`` runs. Each case is checked against the
tree's own output of the first run (bit-identical across runs), and the JSON records the tree's git
commit when ``--commit`` is given. The quantized decode cases (QUANT_CASES), the general backend's
calls (GENERAL_CASES: attention_bias, output_qk) and the prefills over 8-bit caches on both prefill
backends (CODE_CASES) come from the tree's own ``cupa.bench.cases``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import pathlib
import sys

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent

#: name -> (batch, new tokens per sequence, cached tokens per sequence, block_size, backend)
CASES = {
    "decode B=64 L=4096": (64, 1, 4095, 16, "auto"),
    "prefill B=4 q=2048 bs=256 (prefill_wgmma)": (4, 2048, 0, 256, "prefill_wgmma"),
    "prefill B=4 q=2048 bs=16 (prefill)": (4, 2048, 0, 16, "prefill"),
    "chunked B=8 past=8192 q=512 bs=16 (prefill_wgmma)": (8, 512, 8192, 16, "prefill_wgmma"),
    "prefill B=4 q=2048 bs=256 (prefill)": (4, 2048, 0, 256, "prefill"),
    "chunked B=8 past=8192 q=512 bs=16 (prefill)": (8, 512, 8192, 16, "prefill"),
    # the wgmma prefill with the copiers' clean of V tiles (Options._tuning.prefill_ws_copier_clean)
    "prefill B=4 q=2048 bs=256 (prefill_wgmma, copier clean)": (4, 2048, 0, 256, "prefill_wgmma+copier_clean"),
    "chunked B=8 past=8192 q=512 bs=16 (prefill_wgmma, copier clean)": (8, 512, 8192, 16, "prefill_wgmma+copier_clean"),
}

#: name -> keyword arguments of the tree's cupa.bench.cases.decode(64, 4096, ...): quantized decode
QUANT_CASES = {
    "decode B=64 L=4096 int4 per channel": dict(cache="int4", quant="PER_CHANNEL"),
    "decode B=64 L=4096 e2m1 per channel": dict(cache="float4e2m1", quant="PER_CHANNEL"),
    "decode B=64 L=4096 int4 per channel bf16": dict(cache="int4", quant="PER_CHANNEL", dtype="bfloat16"),
    "decode B=64 L=4096 int8 per channel": dict(cache="int8", quant="PER_CHANNEL"),
    "decode B=64 L=4096 fp8 per tensor": dict(cache="fp8", quant="PER_TENSOR"),
}

#: name -> (cupa.bench.cases function, its positional arguments, its keyword arguments, extra operator
#: attributes, bias: None or "full" (a (B, H, q, kv) fp16 attention_bias), Options(backend=...)): calls with
#: the general backend's features (output_qk, attention_bias), on the library's choice or a named backend
GENERAL_CASES = {
    "general decode B=8 L=8192 int8 per channel qk_output=1": (
        "decode", (8, 8192), dict(cache="int8", quant="PER_CHANNEL"), {"qk_output": 1}, None, "auto"),
    "general decode B=8 L=8192 fp8 per channel qk_output=1": (
        "decode", (8, 8192), dict(cache="fp8", quant="PER_CHANNEL"), {"qk_output": 1}, None, "auto"),
    "general prefill B=4 q=2048 int8 per channel bias": (
        "prefill", (4, 2048), dict(cache="int8", quant="PER_CHANNEL"), {}, "full", "auto"),
    "general prefill B=4 q=2048 bias": ("prefill", (4, 2048), {}, {}, "full", "auto"),
    "general prefill B=4 q=2048 int8 per channel bias (general backend)": (
        "prefill", (4, 2048), dict(cache="int8", quant="PER_CHANNEL"), {}, "full", "general"),
    "general prefill B=4 q=2048 int4 per channel bias": (
        "prefill", (4, 2048), dict(cache="int4", quant="PER_CHANNEL"), {}, "full", "auto"),
}

#: The same form: prefill over caches of 8-bit codes on the mma.sync and the wgmma prefill (B=4 x 2048 causal,
#: GQA 32/8, D=128, block 16)
CODE_CASES = {
    f"prefill B=4 q=2048 {label} ({backend})": ("prefill", (4, 2048), kw, {}, None, backend)
    for label, kw in (("fp8 per tensor", dict(cache="fp8", quant="PER_TENSOR")),
                      ("fp8 per channel", dict(cache="fp8", quant="PER_CHANNEL")),
                      ("int8 per channel", dict(cache="int8", quant="PER_CHANNEL")),
                      ("fp8 per tensor bf16", dict(cache="fp8", quant="PER_TENSOR", dtype="bfloat16")))
    for backend in ("prefill", "prefill_wgmma")
}


def _timing():
    spec = importlib.util.spec_from_file_location("cupa_bench_timing", HERE.parent / "cupa" / "bench" / "timing.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _options(cupa, backend: str):
    """``cupa.Options`` of a CASES backend: a name, or ``name+copier_clean`` (the tuning field of that name)."""
    name, _, tuning = backend.partition("+")
    if not tuning:
        return cupa.Options(backend=name)
    from cupa.options import _Tuning

    return cupa.Options(backend=name, _tuning=_Tuning(**{f"prefill_ws_{tuning}": True}))


def build(cp, B, q, past, bs, H=32, Hk=8, D=128, seed=0):
    rng = np.random.default_rng(seed)
    total = q + past
    blocks = math.ceil(total / bs)
    normal = lambda *s: cp.asarray(rng.standard_normal(s, dtype=np.float32).astype(np.float16))  # noqa: E731
    table = rng.permutation(B * blocks).astype(np.int32).reshape(B, blocks)
    N = B * q
    return dict(query=normal(N, H * D), key=normal(N, Hk * D), value=normal(N, Hk * D),
                key_cache=normal(B * blocks, bs, Hk, D), value_cache=normal(B * blocks, bs, Hk, D),
                cumulative_sequence_length=cp.asarray(np.arange(B + 1, dtype=np.int32) * q),
                past_seqlens=cp.asarray(np.full(B, past, np.int32)), block_table=cp.asarray(table),
                attention_metadata=np.array([q, total], np.int32))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--commit", default="")
    ap.add_argument("--cases", default="", help="only the cases whose name contains this text")
    args = ap.parse_args(argv)
    import cupy as cp

    import cupa

    timer = _timing().Timer(cp)
    result = {"label": args.label, "commit": args.commit, "cupa": str(pathlib.Path(cupa.__file__).parent),
              "reps": args.reps, "cases": {}}
    for name, (B, q, past, bs, backend) in CASES.items():
        if args.cases not in name:
            continue
        try:
            options = _options(cupa, backend)
        except (TypeError, cupa.PagedAttentionError) as exc:  # an older tree without the tuning field
            result["cases"][name] = {"status": "not served", "reason": str(exc)}
            print(f"{args.label}: {name}: not served", flush=True)
            continue
        inputs = build(cp, B, q, past, bs)
        op = cupa.PagedAttention(num_heads=32, kv_num_heads=8, options=options)
        first = op(**inputs)
        cp.cuda.Device().synchronize()

        def call():
            return op(**inputs)

        entry = timer.time_us(call, reps=args.reps)
        again = op(**inputs)
        entry["same_output"] = bool(cp.array_equal(first, again))
        entry["tflop_per_s"] = 4.0 * 32 * 128 * B * q * (past + (q + 1) / 2) / (entry["median_us"] * 1e-6) / 1e12
        result["cases"][name] = entry
        print(f"{args.label}: {name}: {entry['median_us']:.1f} us", flush=True)
        del inputs, first, again
        cp.get_default_memory_pool().free_all_blocks()
    from cupa.bench import cases

    for name, kw in QUANT_CASES.items():
        if args.cases not in name:
            continue
        built = cases.build(cases.decode(64, 4096, **kw), cp)
        op = cupa.PagedAttention(**built.attributes)
        inputs = built.call_inputs()
        first = op(**inputs)
        cp.cuda.Device().synchronize()
        entry = timer.time_us(lambda: op(**inputs), reps=args.reps)
        entry["same_output"] = bool(cp.array_equal(first, op(**inputs)))
        result["cases"][name] = entry
        print(f"{args.label}: {name}: {entry['median_us']:.1f} us", flush=True)
        del built, inputs, first
        cp.get_default_memory_pool().free_all_blocks()
    for name, (kind, pos, kw, attributes, bias, backend) in {**GENERAL_CASES, **CODE_CASES}.items():
        if args.cases not in name:
            continue
        built = cases.build(getattr(cases, kind)(*pos, **kw), cp)
        inputs = built.call_inputs()
        if bias == "full":
            c = built.case
            shape = (c.batch_size, c.num_heads, max(c.q_lens), int(c.kv_lens.max()))
            inputs["attention_bias"] = cp.random.RandomState(1).standard_normal(shape, dtype=np.float32).astype(
                np.float16)
        try:
            op = cupa.PagedAttention(**{**built.attributes, **attributes}, options=cupa.Options(backend=backend))
            entry_backend = op.plan(**inputs).backend.name
        except cupa.PagedAttentionError as exc:  # an older tree without a backend for the call
            result["cases"][name] = {"status": "not served", "reason": str(exc)}
            print(f"{args.label}: {name}: not served", flush=True)
            continue
        first = op(**inputs)
        first = first[0] if isinstance(first, tuple) else first
        cp.cuda.Device().synchronize()
        entry = timer.time_us(lambda: op(**inputs), reps=args.reps)
        again = op(**inputs)
        entry["same_output"] = bool(cp.array_equal(first, again[0] if isinstance(again, tuple) else again))
        entry["backend"] = entry_backend
        if kind == "prefill":
            entry["tflop_per_s"] = built.case.flops() / (entry["median_us"] * 1e-6) / 1e12
        result["cases"][name] = entry
        print(f"{args.label}: {name}: {entry['median_us']:.1f} us", flush=True)
        del built, inputs, first, again
        cp.get_default_memory_pool().free_all_blocks()
    pathlib.Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
