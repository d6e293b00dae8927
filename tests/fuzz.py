"""Differential fuzz of the CUDA backends against the NumPy reference: ``python -m tests.fuzz --n 2000``.

Each configuration is drawn from its own seed (printed, and written to the JSON log) over the whole
contract: T, head sizes (multiples of 8 up to 256), block sizes (1, non-powers of two, up to 256), GQA
groups, ragged batches with zero-token sequences, packed QKV, RoPE (half or interleaved, partial,
offset), QK-norm, sinks, softcap, windows, is_causal=0, explicit slots and positions, T / int8 / fp8
caches and packed int4 / e2m1 4-bit ones (K and V of either 4-bit kind) with mixed granularities,
attention_metadata absent, tight or loose, an empty cache, and
malformed data (bad block ids, bad slots, negative or oversized lengths, decreasing cum, negative or
out-of-range positions), output_qk (scores or probabilities), lse and attention_bias (broadcast
dimensions, capacities larger or smaller than the lengths, -inf entries). Every configuration runs on the
backend dispatch chooses and on every other CUDA backend that serves it (``cupa.Options(backend=...)``,
verified or not), with the output poisoned (and output_qk, lse and the workspaces where the call asks for
them). The output must be within the tolerances of contract §6 of the reference, every output element
written, output_qk and lse as the GPU tests check them (util.check_outputs_against_reference), and the
caches within one ulp of T (T caches) or one code (quantized) of the reference's caches.

Replay one configuration with ``python -m tests.fuzz --seed S --n 1``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time

import numpy as np

import cupa
from cupa import dispatch
from tests import util

HEAD_SIZES = (8, 16, 32, 40, 64, 64, 96, 128, 128, 128, 256)
BLOCK_SIZES = (1, 3, 8, 16, 16, 16, 17, 32, 64, 256)
GROUPS = ((1, 1), (4, 4), (8, 2), (8, 1), (12, 4), (16, 2), (32, 8), (6, 3))


def draw(seed: int) -> tuple:
    """``(inputs, attrs, metadata, description)`` of configuration ``seed`` (NumPy arrays)."""
    rng = np.random.default_rng(seed)
    pick = lambda seq: seq[int(rng.integers(len(seq)))]  # noqa: E731
    dtype = pick(("float16", "float16", "bfloat16", "float32"))
    D = pick(HEAD_SIZES)
    H, Hk = pick(GROUPS)
    block_size = pick(BLOCK_SIZES)
    B = int(rng.integers(1, 7))
    shape = pick(("decode", "decode", "prefill", "chunked", "mixed"))
    if shape == "decode":
        q_lens = [1] * B
    elif shape == "prefill":
        q_lens = [int(rng.integers(0, 90)) for _ in range(B)]
    else:
        q_lens = [int(rng.choice([0, 1, int(rng.integers(2, 70))])) for _ in range(B)]
    past = [0 if shape == "prefill" else int(rng.integers(0, 300)) for _ in range(B)]
    if sum(q_lens) == 0:
        q_lens[0] = 1
    cache = "T" if dtype == "float32" else pick(("T", "T", "int8", "fp8"))
    # packed 4-bit caches (D % 8 == 0), drawn from a stream of their own so that the other seeds draw what
    # they drew before these kinds were part of the fuzz; K and V may be of different 4-bit kinds
    sub = np.random.default_rng((seed, 4))
    v_cache = None
    if dtype != "float32" and D % 8 == 0 and sub.random() < 0.2:
        cache = ("int4", "fp4")[int(sub.integers(2))]
        v_cache = ("int4", "fp4")[int(sub.integers(2))] if sub.random() < 0.3 else None
    quants = ("PER_TENSOR", "PER_CHANNEL")
    kw = dict(B=B, H=H, Hk=Hk, D=D, block_size=block_size, dtype=dtype, q_lens=q_lens, past=past, cache=cache,
              v_cache=v_cache,
              k_quant=pick(quants), v_quant=pick(quants), packed=bool(rng.random() < 0.2),
              qk_norm=bool(rng.random() < 0.2), sink=bool(rng.random() < 0.3),
              softcap=float(pick((0.0, 0.0, 0.0, 20.0))), window=int(pick((-1, -1, -1, 1, 7, 40, 200))),
              is_causal=int(rng.random() < 0.85), query_positions=bool(rng.random() < 0.15),
              block_table=pick(("shuffled", "shuffled", "shared", "unmapped")),
              spare_blocks=int(rng.integers(0, 4)))
    # output_qk and lse, from a stream of their own too (attributes only: the data drawn stays the same)
    outs = np.random.default_rng((seed, 5))
    kw.update(qk_output=int(outs.integers(1, 3)) if outs.random() < 0.15 else 0, return_lse=bool(outs.random() < 0.15))
    if rng.random() < 0.3:
        rotary_dim = pick(tuple(r for r in (D, D // 2, 16, 8) if r >= 2 and r % 2 == 0 and r <= D))
        offsets = [o for o in range(0, D - rotary_dim + 1, 8)]
        kw.update(rotary=True, interleaved=bool(rng.random() < 0.5), rotary_dim=rotary_dim,
                  rotary_offset=pick(offsets))
    inputs, attrs = util.build(rng, **kw)
    if kw["block_table"] == "shared" and _colliding_writes(inputs, block_size):
        # two tokens writing one slot have no specified winner (contract §4.4): share only read-only blocks
        inputs, attrs = util.build(rng, **dict(kw, block_table="shuffled"))
    notes = [shape]
    if rng.random() < 0.15:                                     # explicit slots, some skipped or out of range
        slots = np.asarray(util.derived_slots(inputs, block_size), dtype=np.int32)
        n = len(slots)
        if n:
            bad = rng.random(n)
            slots[bad < 0.1] = -1
            slots[(bad >= 0.1) & (bad < 0.15)] = inputs["key_cache"].shape[0] * block_size + 5
        inputs["slot_mapping"] = slots
        notes.append("slot_mapping")
    malformed = rng.random()
    if malformed < 0.06:
        inputs["past_seqlens"][int(rng.integers(B))] = -3
        notes.append("negative past")
    elif malformed < 0.10:
        inputs["block_table"][int(rng.integers(B)), 0] = inputs["key_cache"].shape[0] + 11
        notes.append("block id out of range")
    elif malformed < 0.13 and B > 1:
        cum = inputs["cumulative_sequence_length"]
        b = int(rng.integers(1, B))
        cum[b] = cum[b + 1] + 1 if cum[b + 1] + 1 <= cum[-1] else cum[b]
        notes.append("decreasing cum")
    elif malformed < 0.16:
        inputs["past_seqlens"][int(rng.integers(B))] = inputs["block_table"].shape[1] * block_size + 2
        notes.append("kv_len beyond the table")
    elif malformed < 0.19 and "query_positions" in inputs and len(inputs["query_positions"]):
        qp = inputs["query_positions"]
        qp[int(rng.integers(len(qp)))] = -1 if rng.random() < 0.5 else 1 << 20
        notes.append("bad position")
    elif malformed < 0.21:
        inputs["key_cache"] = inputs["key_cache"][:0].copy()
        inputs["value_cache"] = inputs["value_cache"][:0].copy()
        inputs["block_table"][:] = -1
        notes.append("empty cache")
    slots = write_slots(inputs, attrs)
    taken = slots >= 0
    first = np.zeros_like(taken)
    if taken.any():
        order = np.flatnonzero(taken)
        _, first_of = np.unique(slots[order], return_index=True)
        first[order[first_of]] = True
    if (taken & ~first).any():
        # two tokens writing one slot have no specified winner (contract §4.4): the later ones skip theirs
        inputs["slot_mapping"] = np.where(first, slots, -1).astype(np.int32)
        notes.append("colliding writes skipped")
    metadata = None
    md = rng.random()
    q_lens_now = np.diff(inputs["cumulative_sequence_length"])
    kv_lens = inputs["past_seqlens"] + q_lens_now
    if md < 0.4:
        metadata = [int(max(q_lens_now.max(), 0)), int(max(kv_lens.max(), 1))]
        notes.append("tight metadata")
    elif md < 0.6:
        metadata = [int(q_lens_now.max()) + 7, int(kv_lens.max()) + 1000]
        notes.append("loose metadata")
    if inputs.get("query_positions") is not None and attrs.get("do_rotary"):
        inputs["query_positions"] = np.minimum(inputs["query_positions"], inputs["cos_cache"].shape[0] + 3)
    # attention_bias, from a stream of its own (added after everything else is drawn, so the other draws stay
    # the same): (1 or B, 1 or H, q_capacity, kv_capacity), capacities from the drawn lengths plus a pad that
    # may be negative (an undersized capacity masks), some entries -inf
    bias_shape = None
    brng = np.random.default_rng((seed, 6))
    if brng.random() < 0.15:
        q_pad, kv_pad = ((0, 0), (3, 17), (0, 8), (1, 3), (-2, -5), (0, -40))[int(brng.integers(6))]
        q_cap = int(max(1, max(q_lens) + q_pad))
        kv_cap = int(max(1, max(p + q for p, q in zip(past, q_lens)) + kv_pad))
        bias_shape = (1 if brng.random() < 0.3 else B, 1 if brng.random() < 0.3 else H, q_cap, kv_cap)
        values = brng.standard_normal(bias_shape) * 2.0
        if brng.random() < 0.3:
            values[brng.random(bias_shape) < 0.2] = -np.inf
        inputs["attention_bias"] = values.astype(inputs["query"].dtype)
        notes.append("bias")
    desc = dict(seed=seed, dtype=dtype, D=D, H=H, Hk=Hk, block_size=block_size, B=B, cache=cache,
                v_cache=v_cache or cache, notes=notes, qk_output=kw["qk_output"], return_lse=kw["return_lse"],
                q_lens=[int(x) for x in q_lens_now], past=[int(x) for x in inputs["past_seqlens"]],
                bias=list(bias_shape) if bias_shape else None)
    return inputs, attrs, metadata, desc


def write_slots(inputs, attrs) -> np.ndarray:
    """The slot each token writes under the contract (-1: none), with the reference's ownership rule."""
    from cupa import reference

    op = cupa.PagedAttention(**attrs)
    x = dict(inputs)
    pb = op._problem(op._bind((), x))
    tok = reference._tokens(pb, x)
    bs, MB, nb = pb.block_size, pb.max_blocks_per_seq, inputs["key_cache"].shape[0]
    if inputs.get("slot_mapping") is not None:
        s = np.asarray(inputs["slot_mapping"]).astype(np.int64)
        ok = (s >= 0) & (s < nb * bs)
    else:
        logical = tok.position // bs
        inside = (logical >= 0) & (logical < MB)
        blk = np.asarray(inputs["block_table"])[tok.seq, np.clip(logical, 0, MB - 1)].astype(np.int64)
        ok = inside & (blk >= 0) & (blk < nb)
        s = blk * bs + tok.position % bs
    return np.where(tok.valid & ok, s, -1)


def _colliding_writes(inputs, block_size) -> bool:
    """Whether two tokens of the call would write one cache slot (derived slots)."""
    slots = np.asarray(util.derived_slots(inputs, block_size))
    slots = slots[slots >= 0]
    return len(np.unique(slots)) != len(slots)


def backends_for(inputs, attrs, metadata) -> list:
    """Every CUDA backend name that serves this call (by its reasons, verified or not)."""
    import cupy as cp

    from cupa.device import device_info

    op = cupa.PagedAttention(**attrs)
    dev = util.to_device(cp, inputs)
    problem = op._problem(op._bind((), dict(dev, attention_metadata=metadata)))
    device = device_info(cp.cuda.runtime.getDevice())
    options = cupa.Options()
    return [b.name for b in dispatch.cuda_backends() if not b.not_supported_reasons(problem, device, options)]


MALFORMED = ("negative past", "block id out of range", "decreasing cum", "kv_len beyond the table", "bad position",
             "empty cache", "slot_mapping")


def is_malformed(desc: dict) -> bool:
    return any(n in MALFORMED for n in desc["notes"])


def check_one(seed: int, only=None, malformed_only: bool = False, skip=()) -> dict:
    """Run configuration ``seed`` on every serving backend (or only on ``only``); returns its log record
    (``ok`` and errors). ``malformed_only``: skip (``skipped``) configurations with well-formed data."""
    import cupy as cp

    inputs, attrs, metadata, desc = draw(seed)
    record = dict(desc, backends={}, ok=True)
    if malformed_only and not is_malformed(desc):
        record["skipped"] = True
        return record
    names = [n for n in backends_for(inputs, attrs, metadata) if (only is None or n == only) and n not in skip]
    if not names:
        record["backends"]["(none)"] = "no CUDA backend serves it"
        return record
    ref_in = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in inputs.items()}
    qk_mode, with_lse = desc["qk_output"], desc["return_lse"]
    ref, ref_qk, ref_lse = util.split_result(cupa.paged_attention(**ref_in, attention_metadata=metadata, **attrs),
                                             qk_mode, with_lse)
    dtype, cache = desc["dtype"], desc["cache"]
    for name in names:
        dev = util.to_device(cp, inputs)
        N, H = inputs["query"].shape[0], attrs["num_heads"]
        D = desc["D"]
        out = cp.full((N, H * D), np.nan, dtype=dev["query"].dtype)
        try:
            poison = util.poisoned_allocations(cp) if qk_mode or with_lse else contextlib.nullcontext()
            with poison:  # output_qk, lse and workspaces start as NaN
                result = cupa.paged_attention(**dev, attention_metadata=metadata, out=out,
                                              options=cupa.Options(backend=name), **attrs)
            cp.cuda.get_current_stream().synchronize()
            _, got_qk, got_lse = util.split_result(result, qk_mode, with_lse)
            host = cp.asnumpy(out)
            problems = []
            want_qk, want_lse = ref_qk, ref_lse
            if qk_mode or with_lse:  # over the caches as this backend wrote them (util.qk_and_lse_reference)
                _, want_qk, want_lse = util.qk_and_lse_reference(
                    (ref, ref_qk, ref_lse), inputs, ref_in, (cp.asnumpy(dev["key_cache"]), cp.asnumpy(dev["value_cache"])),
                    dict(attrs, qk_output=qk_mode, return_lse=with_lse), metadata=metadata)
            for what, got, want, check in (
                    ("output_qk", got_qk, want_qk, util.assert_rows_close if qk_mode == 2 else util.assert_elementwise),
                    ("lse", got_lse, want_lse, util.assert_elementwise)):
                if want is None:
                    continue
                try:
                    check(cp.asnumpy(got), want, util.TOLERANCE[dtype], what)
                except AssertionError as exc:
                    problems.append(str(exc)[:300])
            if np.isnan(host.astype(np.float32)).any():
                problems.append("unwritten (NaN-poisoned) output elements")
            err = util.rel_err(host, ref)
            if not err < util.TOLERANCE[dtype]:
                problems.append(f"relative error {err:.3g} >= {util.TOLERANCE[dtype]}")
            for which, kind in (("key_cache", cache), ("value_cache", desc["v_cache"])):
                try:
                    util.assert_cache_close(cp.asnumpy(dev[which]), ref_in[which], steps=1, what=which, fp32_rows=True,
                                            packed=kind if kind in ("int4", "fp4") else None)
                except AssertionError as exc:
                    problems.append(str(exc))
            record["backends"][name] = "ok" if not problems else "; ".join(problems)
            record["ok"] &= not problems
        except Exception as exc:  # a crash is a mismatch too
            record["backends"][name] = f"{type(exc).__name__}: {exc}"
            record["ok"] = False
    return record


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2000, help="configurations (default 2000)")
    ap.add_argument("--seed", type=int, default=1, help="seed of the first configuration (then +1 each)")
    ap.add_argument("--out", default=None, help="JSON log of every configuration")
    ap.add_argument("--backend", default=None, help="run only this backend (default: every one that serves)")
    ap.add_argument("--skip", default="", help="comma-separated backends not to run")
    ap.add_argument("--log", default=None, help="append one JSON line per configuration here, as it completes")
    ap.add_argument("--malformed", action="store_true",
                    help="only configurations with malformed data or skipped slots (for compute-sanitizer)")
    args = ap.parse_args(argv)
    if args.malformed:
        import cupy as cp

        cp.cuda.set_allocator(None)  # one cudaMalloc per array: compute-sanitizer sees each array's exact bounds
    records, start = [], time.perf_counter()
    skip = tuple(n for n in args.skip.split(",") if n)
    log = open(args.log, "a") if args.log else None
    for seed in range(args.seed, args.seed + args.n):
        r = check_one(seed, args.backend, args.malformed, skip)
        if r.get("skipped"):
            continue
        records.append(r)
        if log is not None:
            log.write(json.dumps(r) + "\n")
            log.flush()
        if not r["ok"]:
            print(f"MISMATCH seed {seed}: {json.dumps(r)}", flush=True)
        if len(records) % 25 == 0:
            bad = sum(not x["ok"] for x in records)
            print(f"{len(records)} configurations, {bad} mismatches, {time.perf_counter() - start:.0f} s", flush=True)
    bad = [r for r in records if not r["ok"]]
    runs = sum(len(r["backends"]) for r in records)
    per_backend = {}
    for r in records:
        for name, verdict in r["backends"].items():
            c = per_backend.setdefault(name, [0, 0])
            c[0] += 1
            c[1] += verdict != "ok" and name != "(none)"
    print(f"summary: {len(records)} configurations, {runs} backend runs, {len(bad)} mismatches; per backend "
          + ", ".join(f"{k} {v[0]} runs / {v[1]} bad" for k, v in sorted(per_backend.items()))
          + f"; {time.perf_counter() - start:.0f} s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"configurations": len(records), "mismatches": len(bad), "records": records}, f)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
