"""The ``general`` suite: calls with attention_bias or output_qk against their targets, each beside the same
call without the feature, in the same run (the tensor-core prefill or the general backend serves the bias
calls; a decode-shaped output_qk call runs on the decode backend).

- prefill: causal B=4 x 2048 new tokens (fp16, GQA 32/8, D=128, block 16) with a full (B, H, 2048,
  2048) fp16 attention_bias. cupa's entry is the call with the bias (the library's own choice); the
  variants are the same call with the bias on each backend that serves it (``Options(backend="general")``,
  ``Options(backend="prefill")``), and without bias on the general backend and on the library's own
  choice (the fused prefill). Figures:
  TFLOP/s of the causal FLOPs ``4 H D sum_b(q_b (q_b + 1) / 2)`` (target >= 150) and
  ``bias_cost_vs_general_no_bias`` (bias time / general no-bias time).
- decode: B=8, L=8192 (fp16, GQA 32/8, D=128, block 16) with qk_output=2 (the probabilities, a (32, 8,
  8192) float32 output_qk). cupa's entry is the qk_output=2 call (the decode backend); the variants are
  qk_output=1, a (B, H, 1, L) bias, the general backend with neither, and the fused decode without
  output_qk. The floor is the fused decode's time plus output_qk's bytes at the write bandwidth measured
  in the same run (a 2 GiB cudaMemsetAsync, timed like every call: L2 flushed before each run);
  ``ratio_to_floor`` = time / floor (target <= 1.5).
- latent: LATENT 576/512, H=16, B=8, L=4096, block 64 with a (1, 1, 1, 4096) bias (informative, no
  target), beside the same call without bias.

Each record carries ``target`` (the figure, the bound, the value, whether it is met) where the case
has one. No peer adapter takes attention_bias or output_qk, so no peer runs here. In the smoke mode
the shapes are tiny and every call runs on the NumPy reference (a variant naming a CUDA backend runs
the library's own choice), which exercises the records, not the targets.
"""

from __future__ import annotations

import numpy as np

import cupa

from . import cases as C
from . import sweeps
from .cases import Built, Case, build
from .suites import Context, Suite, base_record, rel_err, time_cupa

__all__ = ["GeneralSuite", "PREFILL_TARGET_TFLOPS", "DECODE_TARGET_RATIO"]

PREFILL_TARGET_TFLOPS = 150.0
DECODE_TARGET_RATIO = 1.5
#: Bytes of the write probe (the decode floor's write bandwidth).
WRITE_PROBE_BYTES = {"full": 2 << 30, "quick": 2 << 30, "smoke": 1 << 20}
GENERAL = cupa.Options(backend="general")
PREFILL = cupa.Options(backend="prefill")
PEERS_NOTE = "no peer adapter takes attention_bias or output_qk"


def _cases(size: str) -> list:
    if size == "smoke":
        s = sweeps.SMOKE
        return [C.prefill(2, 8, block_size=4, suite="general", **s),
                C.decode(2, 24, block_size=4, suite="general", **s),
                C.mla(2, 16, num_heads=2, block_size=4, suite="general")]
    return [C.prefill(4, 2048, suite="general"), C.decode(8, 8192, suite="general"),
            C.mla(8, 4096, num_heads=16, suite="general")]


def _rename(case: Case, what: str) -> Case:
    return C.replace(case, name=f"{what} {case.name}")


class GeneralSuite(Suite):
    name = "general"
    description = ("attention_bias and output_qk: bias prefill (general backend; TFLOP/s, target >= 150), output_qk "
                   "decode (decode backend; time / floor, target <= 1.5), LATENT with a bias")

    def items(self, size: str) -> list:
        prefill, decode, latent = _cases(size)
        return [_rename(prefill, "prefill bias"), _rename(decode, "decode qk_output=2"), _rename(latent, "latent bias")]

    def run(self, case: Case, ctx: Context) -> dict:
        rt = ctx.runtime
        rec = base_record(case)
        rec["details"] = {"peers": PEERS_NOTE}
        if not rt.on_device:
            rec["details"]["cpu"] = "every call on the NumPy reference (variants naming a backend run the default)"
        built = None
        with rt.stream_context():
            try:
                built = build(case, rt.xp, seed=ctx.seed)
                if case.latent:
                    self._latent(built, ctx, rec)
                elif max(case.q_lens) > 1:
                    self._prefill(built, ctx, rec)
                else:
                    self._decode(built, ctx, rec)
            finally:
                del built
                rt.free()
        return rec

    # -- the three calls ---------------------------------------------------------------------------
    @staticmethod
    def _options(ctx: Context, options):
        return options if ctx.runtime.on_device else None

    def _bias(self, built: Built, ctx: Context, shape: tuple):
        rng = np.random.default_rng(ctx.seed + 1)
        return C._normal(ctx.runtime.xp, rng, shape, built.case.dtype)

    def _prefill(self, built: Built, ctx: Context, rec: dict) -> None:
        case = built.case
        q = max(case.q_lens)
        kv = int(case.kv_lens.max())
        B, H = case.batch_size, case.num_heads
        bias = self._bias(built, ctx, (B, H, q, kv))
        rec["details"].update(bias_shape=[B, H, q, kv], bias_bytes=int(bias.nbytes),
                              bias_bytes_read_causal=int(B * H * q * (q + 1) // 2 * bias.itemsize))
        rec["cupa"], out = time_cupa(built, ctx, inputs={"attention_bias": bias})
        for label, options in (("general bias", GENERAL), ("prefill bias", PREFILL)):
            rec["variants"][label], _ = time_cupa(built, ctx, self._options(ctx, options),
                                                  inputs={"attention_bias": bias})
        del bias
        rec["variants"]["general no bias"], general_out = time_cupa(built, ctx, self._options(ctx, GENERAL))
        rec["variants"]["fused no bias"], fused_out = time_cupa(built, ctx)
        flops = case.flops()
        for _, m in self._entries(rec):
            m["tflop_per_s"] = flops / m["median_us"] / 1e6
        cupa_m, plain = rec["cupa"], rec["variants"]["general no bias"]
        if _ok(cupa_m) and _ok(plain):
            cupa_m["bias_cost_vs_general_no_bias"] = cupa_m["median_us"] / plain["median_us"]
        if general_out is not None and fused_out is not None:
            plain["rel_err_vs_fused_no_bias"] = rel_err(fused_out, general_out)
        rec["target"] = _target("tflop_per_s", cupa_m.get("tflop_per_s"), at_least=PREFILL_TARGET_TFLOPS)

    def _decode(self, built: Built, ctx: Context, rec: dict) -> None:
        rt = ctx.runtime
        case = built.case
        B, H, L = case.batch_size, case.num_heads, int(case.kv_lens.max())
        rec["write_probe"] = write = rt.write_probe(WRITE_PROBE_BYTES[ctx.size], ctx.reps)
        bias = self._bias(built, ctx, (B, H, 1, L))
        rec["cupa"], ref = time_cupa(built, ctx, attributes={"qk_output": 2})
        calls = (("qk_output=1", None, {"qk_output": 1}, {}), ("bias", None, {}, {"attention_bias": bias}),
                 ("general plain", self._options(ctx, GENERAL), {}, {}), ("fused no qk", None, {}, {}))
        for label, options, attributes, inputs in calls:
            entry, out = time_cupa(built, ctx, options, attributes, inputs)
            if out is not None and ref is not None and not inputs:      # the same attention as cupa's call
                entry["rel_err_vs_cupa"] = rel_err(ref, out)
            rec["variants"][label] = entry
        del bias
        try:
            qk_shape = list(cupa.PagedAttention(**built.attributes, qk_output=2).plan(
                **built.call_inputs()).problem.output_qk_shape)
        except cupa.PagedAttentionError:
            qk_shape = [H, case.token_count, L]
        qk_bytes = int(np.prod(qk_shape)) * 4
        fused = rec["variants"]["fused no qk"]
        floor_us = None
        if _ok(fused) and write.get("tb_per_s"):
            floor_us = fused["median_us"] + qk_bytes / write["tb_per_s"] / 1e6
            for label, m in self._entries(rec):
                if label != "fused no qk":
                    m["ratio_to_floor"] = m["median_us"] / floor_us
        rec["floor"] = {"floor_us": floor_us, "fused_no_qk_us": fused.get("median_us"), "output_qk_shape": qk_shape,
                        "output_qk_bytes": qk_bytes, "write_tb_per_s": write.get("tb_per_s"),
                        "what": "fused decode without output_qk + output_qk bytes at the run's write bandwidth"}
        rec["target"] = _target("ratio_to_floor", rec["cupa"].get("ratio_to_floor"), at_most=DECODE_TARGET_RATIO)

    def _latent(self, built: Built, ctx: Context, rec: dict) -> None:
        L = int(built.case.kv_lens.max())
        bias = self._bias(built, ctx, (1, 1, 1, L))
        rec["details"]["bias_shape"] = [1, 1, 1, L]
        rec["cupa"], _ = time_cupa(built, ctx, inputs={"attention_bias": bias})
        del bias
        rec["variants"]["no bias"], _ = time_cupa(built, ctx)
        rec["details"]["target"] = "none (informative)"

    @staticmethod
    def _entries(rec: dict):
        """``(label, entry)`` of cupa and each variant that ran."""
        for label, m in [("cupa", rec["cupa"])] + list(rec["variants"].items()):
            if _ok(m):
                yield label, m


def _ok(m) -> bool:
    return isinstance(m, dict) and m.get("status") == "ok" and bool(m.get("median_us"))


def _target(figure: str, value, at_least=None, at_most=None) -> dict:
    """The record's target: cupa's ``figure``, its bound, its value and whether it is met (None: not measured)."""
    t = {"figure": f"cupa {figure}", "value": value}
    if at_least is not None:
        t["at_least"] = at_least
        t["met"] = None if value is None else bool(value >= at_least)
    else:
        t["at_most"] = at_most
        t["met"] = None if value is None else bool(value <= at_most)
    return t
