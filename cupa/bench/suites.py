"""The suites of ``python -m cupa.bench`` and how one case of each is measured.

An attention suite (decode, prefill, chunked, mixed, mla, subbyte) runs each case the same way:

1. build the inputs (:func:`cupa.bench.cases.build`) on the run's device;
2. time cupa's call through a bound ``cupa.PagedAttention`` with a preallocated output -- or record
   "not served" with the reason when no backend serves the call (PagedAttentionError);
3. time each backend variant (an ``Options(backend=...)`` A/B) whose backend differs from cupa's choice;
4. for a memory-bound case, time the read probe over the same number of bytes;
5. time every peer on the same inputs (missing / unsupported / error recorded with the reason) and
   check its output against cupa's (``rel_err_vs_cupa``).

The cache each timed call writes holds the same values every time (the new tokens' K/V), so cupa
and the peers that append K/V themselves see the same cache, and so do the read-only peers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

import cupa

from ..options import _Tuning
from . import sweeps
from .cases import Built, Case, build
from .peers import Unsupported, host_float32

__all__ = ["Suite", "AttentionSuite", "CascadeSuite", "Step", "Context", "all_suites", "rel_err",
           "error_text", "SUITE_ORDER"]


@dataclass(frozen=True)
class Step:
    """An item of a suite that is not one attention call (a graph replay, a host-time row...)."""

    suite: str
    name: str
    params: tuple = ()
    tags: tuple = ()

    @property
    def id(self) -> str:
        return f"{self.suite}/{self.name}"

    @property
    def param(self) -> dict:
        return dict(self.params)


@dataclass
class Context:
    """What a suite's ``run`` gets: the runtime, the enabled peers, repetitions, the size, the seed and
    the rooflines measured at the start of the run (to tell memory- from compute-bound cases)."""

    runtime: object
    peers: list
    reps: int
    size: str
    seed: int = 0
    rooflines: dict = field(default_factory=dict)

    def peers_for(self, suite: str) -> list:
        return [p for p in self.peers if suite in p.suites]


def error_text(exc: BaseException, limit: int = 400) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:limit]}" if text else type(exc).__name__


def rel_err(reference, got) -> float:
    """``||got - reference|| / ||reference||`` over every element (float32 on the host)."""
    ref = host_float32(reference).reshape(-1).astype(np.float64)
    val = host_float32(got).reshape(-1).astype(np.float64)
    if ref.shape != val.shape:
        raise ValueError(f"output shape {val.shape} does not match cupa's {ref.shape}")
    denom = float(np.linalg.norm(ref))
    num = float(np.linalg.norm(val - ref))
    return num / denom if denom else num


class Suite:
    """A named group of items; ``run`` returns one record (or a list of them) per item."""

    name = ""
    description = ""

    def items(self, size: str) -> list:
        raise NotImplementedError

    def skip_reason(self, ctx: Context) -> Optional[str]:
        """Why this suite cannot run here (None: it can)."""
        return None

    def run(self, item, ctx: Context):
        raise NotImplementedError


def base_record(item) -> dict:
    rec = {"suite": item.suite, "case": item.name, "id": item.id}
    if isinstance(item, Case):
        rec.update(params=item.params(), tags=item.tag, bytes=item.kv_bytes(), flops=item.flops())
    else:
        rec.update(params=item.param, tags=dict(item.tags))
    rec.update(cupa=None, variants={}, peers={})
    return rec


def time_cupa(built: Built, ctx: Context, options=None, attributes: Optional[dict] = None,
              inputs: Optional[dict] = None):
    """``(record, output)``: cupa's timing of ``built`` (status "ok", "not served" or "error");
    ``attributes`` and ``inputs`` are added to the case's own (the general suite's qk_output and
    attention_bias)."""
    rt = ctx.runtime
    case = built.case
    try:
        op = cupa.PagedAttention(**built.attributes, **(attributes or {}), options=options)
        inputs = dict(built.call_inputs(), **(inputs or {}))
        backend = op.plan(**inputs).backend
        out = rt.xp.empty((case.token_count, case.num_heads * case.out_head_size), dtype=inputs["query"].dtype)
        result = rt.time_us(lambda: op(**inputs, out=out), ctx.reps)
    except cupa.PagedAttentionError as exc:
        return {"status": "not served", "reason": str(exc)}, None
    except Exception as exc:  # a kernel that fails to compile or launch: record it, keep going
        return {"status": "error", "reason": error_text(exc)}, None
    return {"status": "ok", "backend": backend.name, **result}, out


def time_peer(peer, built: Built, ctx: Context, reference) -> dict:
    ok, why = peer.available()
    if not ok:
        return {"status": "missing", "reason": why}
    prepared = None
    try:
        prepared = peer.prepare(built, ctx.runtime)
        entry = {"status": "ok", **ctx.runtime.time_us(prepared.fn, ctx.reps)}
    except Unsupported as exc:
        return {"status": "unsupported", "reason": str(exc)}
    except Exception as exc:
        return {"status": "error", "reason": error_text(exc)}
    if prepared.note:
        entry["note"] = prepared.note
    if reference is not None:
        try:
            entry["rel_err_vs_cupa"] = rel_err(reference, prepared.output())
        except Exception as exc:
            entry["check_error"] = error_text(exc)
    return entry


class AttentionSuite(Suite):
    """Cases of :mod:`cupa.bench.sweeps` run through cupa, its backend variants and every peer.

    ``variants``: ``(label, cupa.Options)`` pairs timed beside cupa's own choice (on a device: they
    name CUDA backends).
    """

    def __init__(self, name: str, description: str, variants: tuple = ()):
        self.name = name
        self.description = description
        self.variants = variants

    def items(self, size: str) -> list:
        return sweeps.attention_cases(self.name, size)

    def run(self, case: Case, ctx: Context) -> dict:
        rt = ctx.runtime
        rec = base_record(case)
        built = out = None
        with rt.stream_context():
            try:
                built = build(case, rt.xp, seed=ctx.seed)
                rec["cupa"], out = time_cupa(built, ctx)
                for label, options in self.variants if rt.on_device else ():
                    rec["variants"][label] = self._variant(built, ctx, options, rec["cupa"], out)
                if _memory_bound(case, ctx.rooflines):
                    rec["read_probe"] = rt.read_probe(case.kv_bytes(), ctx.reps)
                for peer in ctx.peers_for(self.name):
                    rec["peers"][peer.name] = time_peer(peer, built, ctx, out)
            finally:
                del built, out
                rt.free()
        return rec

    @staticmethod
    def _variant(built: Built, ctx: Context, options, default: dict, reference) -> dict:
        try:
            backend = cupa.PagedAttention(**built.attributes, options=options).plan(**built.call_inputs()).backend
        except cupa.PagedAttentionError as exc:
            return {"status": "not served", "reason": str(exc)}
        if default.get("backend") == backend.name:
            return {"status": "same as default", "backend": backend.name}
        entry, out = time_cupa(built, ctx, options)
        if out is not None and reference is not None:
            entry["rel_err_vs_cupa"] = rel_err(reference, out)
        return entry


def _memory_bound(case: Case, rooflines: dict) -> bool:
    bw = rooflines.get("read", {}).get("tb_per_s")
    fl = rooflines.get("gemm", {}).get("tflop_per_s")
    if not bw or not fl:
        return True
    return case.kv_bytes() / bw >= case.flops() / fl


class CascadeSuite(Suite):
    """Decode over a prefix shared by every sequence: ``cupa.CascadeAttention`` -- the shared prefix
    attended once for all B queries, each sequence's own suffix, ``cupa.merge_states`` of the two --
    against one plain paged call on the same inputs (every block table starts with the shared blocks).
    cupa's entry is the cascade with its own prefix form; the variants are each prefix form named
    ("heads", "tokens") and the plain call, with its speedup ``plain / cascade`` (target: >= 5x on
    B=64, prefix 8192, suffix 256). On a GPU the cascade and the plain call are also captured into a
    CUDA graph and replayed ("... (CUDA graph)" variants): the cascade is several launches whose host
    work the eager timing includes where it exceeds their GPU time; a replay times the GPU alone."""

    name = "cascade"
    description = "shared-prefix decode: cupa.CascadeAttention (prefix once + suffix + merge_states) vs plain paged"
    CASES = {"full": [(64, 8192, 256), (64, 8192, 512), (128, 32768, 1024), (32, 4096, 4096)],
             "quick": [(64, 8192, 256)], "smoke": [(3, 16, 6)]}

    def items(self, size: str) -> list:
        extra = sweeps.SMOKE if size == "smoke" else {}
        bs = 4 if size == "smoke" else 16
        return [Step("cascade", f"B={B} prefix={P} suffix={S}", tuple(sorted(dict(B=B, prefix=P, suffix=S,
                     block_size=bs, **extra).items()))) for B, P, S in self.CASES[size]]

    def skip_reason(self, ctx: Context) -> Optional[str]:
        if not hasattr(cupa, "CascadeAttention"):
            return "cupa.CascadeAttention is not part of this build (the cascade suite needs it)"
        return None

    def run(self, step: Step, ctx: Context) -> dict:
        rt = ctx.runtime
        xp = rt.xp
        p = step.param
        B, P, S, bs = p["B"], p["prefix"], p["suffix"], p["block_size"]
        H, Hk, D = p.get("num_heads", 32), p.get("kv_num_heads", 8), p.get("head_size", 128)
        rec = base_record(step)
        rec["bytes"] = 2 * Hk * D * 2 * (P + B * S)     # fp16 K and V: the prefix once, each suffix
        rec["flops"] = 4.0 * H * D * B * (P + S)        # every query against every key, as the plain call
        plain = cupa.PagedAttention(num_heads=H, kv_num_heads=Hk)
        calls = {"cupa": cupa.CascadeAttention(prefix_len=P, num_heads=H, kv_num_heads=Hk)}
        for mode in ("heads", "tokens"):
            calls[mode] = cupa.CascadeAttention(prefix_len=P, prefix_mode=mode, num_heads=H, kv_num_heads=Hk)
        calls["plain paged"] = plain
        with rt.stream_context():
            rng = np.random.default_rng(ctx.seed)
            nbp, nbs = math.ceil(P / bs), math.ceil(S / bs)
            perm = rng.permutation(nbp + B * nbs).astype(np.int32)
            shared, own = perm[:nbp], perm[nbp:].reshape(B, nbs)
            shape = (nbp + B * nbs, bs, Hk, D)
            normal = lambda s: xp.asarray(rng.standard_normal(s, dtype=np.float32).astype(np.float16))  # noqa: E731
            table = np.full((B, 2 * (nbp + nbs)), -1, dtype=np.int32)     # sized for twice the longest sequence
            table[:, :nbp + nbs] = np.concatenate([np.broadcast_to(shared, (B, nbp)), own], axis=1)
            inputs = dict(query=normal((B, H * D)), key=normal((B, Hk * D)), value=normal((B, Hk * D)),
                          key_cache=normal(shape), value_cache=normal(shape),
                          cumulative_sequence_length=xp.asarray(np.arange(B + 1, dtype=np.int32)),
                          past_seqlens=xp.asarray(np.full(B, P + S - 1, dtype=np.int32)), block_table=xp.asarray(table),
                          attention_metadata=np.array([1, P + S], dtype=np.int32))
            outputs = {label: xp.empty_like(inputs["query"]) for label in calls}
            if rt.on_device:   # every host-to-device copy has landed before a call on the run's stream reads it
                xp.cuda.Device().synchronize()
            for label, op in calls.items():
                out = outputs[label]
                try:
                    if label == "plain paged":
                        backend = op.plan(**inputs).backend.name
                    else:
                        backend = "+".join(dict.fromkeys(op.backends(**inputs)))   # prefix+suffix, once if one
                    entry = {"status": "ok", "backend": backend,
                             **rt.time_us(lambda op=op, out=out: op(**inputs, out=out), ctx.reps)}
                    if label != "plain paged":
                        entry["describe"] = op.describe(**inputs)
                except cupa.PagedAttentionError as exc:
                    entry = {"status": "not served", "reason": str(exc)}
                except Exception as exc:
                    entry = {"status": "error", "reason": error_text(exc)}
                if label == "cupa":
                    rec["cupa"] = entry
                else:
                    rec["variants"][label] = entry
            if rt.on_device:   # the same calls captured once and replayed: the GPU time without host gaps
                for label in ("cupa", "plain paged"):
                    op, out = calls[label], outputs[label]
                    try:
                        g = cupa.capture_graph(lambda op=op, out=out: op(**inputs, out=out), stream=rt.stream)
                        try:
                            entry = {"status": "ok", **rt.time_us(g.replay, ctx.reps)}
                        finally:
                            g.close()
                    except Exception as exc:
                        entry = {"status": "error", "reason": error_text(exc)}
                    rec["variants"][f"{label} (CUDA graph)"] = entry
            plain_entry = rec["variants"]["plain paged"]
            for label, entry in [("cupa", rec["cupa"])] + [(m, rec["variants"][m]) for m in ("heads", "tokens")]:
                if entry["status"] == "ok" and plain_entry["status"] == "ok":
                    entry["rel_err_vs_plain"] = rel_err(outputs["plain paged"], outputs[label])
                    entry["speedup_vs_plain"] = plain_entry["median_us"] / entry["median_us"]
            graphs = [rec["variants"].get(f"{label} (CUDA graph)", {}) for label in ("cupa", "plain paged")]
            if all(g.get("status") == "ok" for g in graphs):
                graphs[0]["speedup_vs_plain"] = graphs[1]["median_us"] / graphs[0]["median_us"]
        rt.free()
        return rec


#: Order of the suites in a run and in the tables.
SUITE_ORDER = ("decode", "prefill", "chunked", "mixed", "mla", "subbyte", "cascade", "general", "graphs", "host",
               "serving")


def all_suites() -> dict:
    from .general import GeneralSuite
    from .steps import GraphsSuite, HostSuite, ServingSuite

    mma_sync = (("mma.sync", cupa.Options(backend="prefill")),)
    # The decode backend named: for the cases it serves by default it is the default's backend and is not
    # timed twice.
    decode_named = (("decode backend", cupa.Options(backend="decode")),)
    suites = [
        AttentionSuite("decode", "one new token per sequence (decode)", decode_named),
        AttentionSuite("prefill", "causal prefill, nothing cached", mma_sync),
        AttentionSuite("chunked", "chunked prefill after a cached past", mma_sync),
        AttentionSuite("mixed", "decode sequences and prefill chunks in one call", mma_sync),
        AttentionSuite("mla", "absorbed MLA (LATENT layout, 576/512)",
                       (("mla backend", cupa.Options(backend="mla")),
                        ("mla mma.sync", cupa.Options(backend="mla", _tuning=_Tuning(mla_wgmma=False))))),
        AttentionSuite("subbyte", "int4 / float4 e2m1 caches in prefill and chunked prefill",
                       (("prefill backend", cupa.Options(backend="prefill")),)),
        CascadeSuite(), GeneralSuite(), GraphsSuite(), HostSuite(), ServingSuite(),
    ]
    return {s.name: s for s in sorted(suites, key=lambda s: SUITE_ORDER.index(s.name))}
