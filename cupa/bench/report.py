"""Turning a run's records into figures: rooflines and ratios (:func:`finalize`), the printed summary
(:func:`summary_lines`), the markdown table (:func:`markdown`), the comparison with an earlier run
(:func:`compare`) and the union of several runs (:func:`merge`).

All of it is a pure function of the JSON payload, so a result file can be re-reported (``--merge``)
without measuring again.

- Rooflines: the read roofline is the larger of the read probes (2 GiB, read-only) and the best
  bandwidth any checked measurement of the run reached; the compute roofline likewise from the dense
  GEMM probe. A case's floor is ``max(bytes / read roofline, flops / compute roofline)`` and every
  measurement's ``fraction_of_roofline`` is floor / its median time.
- Ratios: ``ratio`` = the peer's (or variant's) median time / cupa's: above 1, cupa is faster.
- A peer output is checked against cupa's (``rel_err_vs_cupa``); a measurement whose error exceeds
  :data:`AGREEMENT` is flagged ``agrees: false`` and listed under ``mismatches`` (and does not count
  toward the roofline).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

__all__ = ["finalize", "summary_lines", "markdown", "compare", "compare_lines", "merge", "load", "write_json",
           "measurements", "AGREEMENT", "SCHEMA"]

SCHEMA = 1
#: Largest relative error (||peer - cupa|| / ||cupa||) counted as the same result, by T.
AGREEMENT = {"float16": 1e-2, "bfloat16": 3e-2, "float32": 1e-3}


def load(path) -> dict:
    with open(path) as f:
        return json.load(f)


def write_json(path, payload: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1, default=_jsonable) + "\n")


def _jsonable(x):
    if hasattr(x, "item"):
        return x.item()
    if isinstance(x, (set, tuple)):
        return list(x)
    raise TypeError(f"{type(x).__name__} is not JSON serializable")


def _ok(m) -> bool:
    return isinstance(m, dict) and m.get("status") == "ok" and m.get("median_us")


def measurements(rec: dict):
    """``(kind, name, entry)`` for cupa, each variant and each peer of a record."""
    yield "cupa", "cupa", rec.get("cupa")
    for name, m in (rec.get("variants") or {}).items():
        yield "variant", name, m
    for name, m in (rec.get("peers") or {}).items():
        yield "peer", name, m


def _tolerance(rec: dict) -> float:
    params = rec.get("params") or {}
    tol = AGREEMENT.get(params.get("dtype", "float16"), 1e-2)
    return max(tol, 3e-2) if params.get("cache", "T") != "T" else tol


def finalize(payload: dict) -> dict:
    """Fill in rooflines, per-measurement bandwidth / TFLOP/s / fraction of roofline, ratios and the
    agreement flags, from the raw medians (idempotent)."""
    probes = payload.get("probes") or []
    read = max((p["read"]["tb_per_s"] for p in probes if p.get("read")), default=0.0)
    gemm = max((p["gemm"]["tflop_per_s"] for p in probes if p.get("gemm")), default=0.0)
    roof = {"read_tb_per_s": read, "read_from": "read probe", "compute_tflop_per_s": gemm,
            "compute_from": probes[0]["gemm"].get("what", "GEMM probe") if probes and probes[0].get("gemm") else None}
    mismatches = []
    for rec in payload["cases"]:
        tol = _tolerance(rec)
        for kind, name, m in measurements(rec):
            if not isinstance(m, dict):
                continue
            err = m.get("rel_err_vs_cupa")
            if err is not None:
                m["agrees"] = bool(err <= tol) if not math.isnan(err) else False
                if not m["agrees"]:
                    mismatches.append({"id": rec["id"], kind: name, "rel_err_vs_cupa": err, "tolerance": tol})
            if not _ok(m) or "bytes" not in rec or m.get("agrees") is False:
                continue
            bw = rec["bytes"] / m["median_us"] / 1e6
            fl = rec["flops"] / m["median_us"] / 1e6
            if bw > roof["read_tb_per_s"]:
                roof.update(read_tb_per_s=bw, read_from=f"{name} on {rec['id']}")
            if fl > roof["compute_tflop_per_s"]:
                roof.update(compute_tflop_per_s=fl, compute_from=f"{name} on {rec['id']}")
    for rec in payload["cases"]:
        cupa = rec.get("cupa")
        floor = None
        if "bytes" in rec and roof["read_tb_per_s"] and roof["compute_tflop_per_s"]:
            mem = rec["bytes"] / (roof["read_tb_per_s"] * 1e6)
            comp = rec["flops"] / (roof["compute_tflop_per_s"] * 1e6)
            floor = max(mem, comp)
            rec["roofline"] = {"floor_us": floor, "bound": "memory" if mem >= comp else "compute",
                               "memory_us": mem, "compute_us": comp}
        for kind, name, m in measurements(rec):
            if not _ok(m):
                continue
            if "bytes" in rec:
                m["tb_per_s"] = rec["bytes"] / m["median_us"] / 1e6
                m["tflop_per_s"] = rec["flops"] / m["median_us"] / 1e6
                if floor is not None:
                    m["fraction_of_roofline"] = floor / m["median_us"]
            if kind != "cupa" and _ok(cupa):
                m["ratio"] = m["median_us"] / cupa["median_us"]
        probe = rec.get("read_probe")
        if probe and _ok(cupa):
            probe["fraction_of_cupa"] = probe["median_us"] / cupa["median_us"]
    payload["roofline"] = roof
    payload["mismatches"] = mismatches
    return payload


# -- tables ----------------------------------------------------------------------------------------

def _suites(payload: dict) -> list:
    seen = []
    for rec in payload["cases"]:
        if rec["suite"] not in seen:
            seen.append(rec["suite"])
    return seen


def _columns(recs: list) -> list:
    """Variant and peer names that appear in a suite's records, in first-seen order."""
    cols = []
    for rec in recs:
        for kind, name, _ in measurements(rec):
            if kind != "cupa" and (kind, name) not in cols:
                cols.append((kind, name))
    return cols


def _fmt_us(x: float) -> str:
    return f"{x:.1f}" if x < 1000 else f"{x:.0f}"


def _cell(m) -> str:
    if not isinstance(m, dict):
        return "-"
    if m.get("status") == "ok":
        text = f"{_fmt_us(m['median_us'])} us"
        if m.get("ratio"):
            text += f" ({m['ratio']:.2f}x)"
        if m.get("agrees") is False:
            text += " MISMATCH"
        return text
    return m.get("status", "-")


def _headline(rec: dict) -> tuple:
    """(cupa cell, throughput cell, roofline cell) of a record."""
    m = rec.get("cupa")
    if not _ok(m):
        return (m or {}).get("status", "-"), "", ""
    us = f"{_fmt_us(m['median_us'])} us"
    if "bytes" not in rec:
        return us, "", ""
    bound = (rec.get("roofline") or {}).get("bound", "memory")
    thr = f"{m['tb_per_s']:.3g} TB/s" if bound == "memory" else f"{m['tflop_per_s']:.3g} TFLOP/s"
    frac = m.get("fraction_of_roofline")
    return us, thr, ("" if frac is None else f"{100 * frac:.0f}%")


def _compare_index(payload: dict) -> dict:
    return {c["id"]: c for c in (payload.get("compare") or {}).get("cases", [])}


def summary_lines(payload: dict) -> list:
    """The table printed at the end of a run, one block per suite."""
    lines = []
    roof = payload.get("roofline") or {}
    if roof:
        lines.append(f"roofline: read {roof['read_tb_per_s']:.3g} TB/s ({roof['read_from']}), compute "
                     f"{roof['compute_tflop_per_s']:.3g} TFLOP/s ({roof['compute_from']}); ratio = other time / "
                     "cupa time (> 1: cupa faster)")
    cmp_index = _compare_index(payload)
    for suite in _suites(payload):
        recs = [r for r in payload["cases"] if r["suite"] == suite]
        cols = _columns(recs)
        width = min(70, max(len(suite), *(len(r["case"]) for r in recs)))
        head = [f"{suite:<{width}s}", f"{'backend':>13s}", f"{'cupa':>11s}", f"{'rate':>14s}", f"{'roof':>5s}"]
        head += [f"{name:>22s}" for _, name in cols]
        if cmp_index:
            head.append(f"{'vs base':>8s}")
        lines += ["", " ".join(head)]
        for rec in recs:
            us, thr, frac = _headline(rec)
            backend = (rec.get("cupa") or {}).get("backend", "")
            row = [f"{rec['case'][:width]:<{width}s}", f"{backend:>13s}", f"{us:>11s}", f"{thr:>14s}", f"{frac:>5s}"]
            row += [f"{_cell(_entry(rec, kind, name)):>22s}" for kind, name in cols]
            if cmp_index:
                c = cmp_index.get(rec["id"])
                row.append(f"{c['cupa_ratio']:>7.2f}x" if c and c.get("cupa_ratio") else f"{'-':>8s}")
            lines.append(" ".join(row))
    for m in payload.get("mismatches") or []:
        who = m.get("peer") or m.get("variant")
        lines.append(f"MISMATCH {m['id']}: {who} differs from cupa by {m['rel_err_vs_cupa']:.2e} "
                     f"(tolerance {m['tolerance']:.0e})")
    return lines


def _entry(rec: dict, kind: str, name: str):
    return (rec.get("variants") if kind == "variant" else rec.get("peers") or {}).get(name)


def markdown(payload: dict) -> str:
    """The generated markdown tables (one per suite) with the run's machine, versions and rooflines."""
    env = payload.get("environment") or {}
    machine = env.get("machine") or {}
    versions = env.get("versions") or {}
    roof = payload.get("roofline") or {}
    out = ["<!-- generated by python -m cupa.bench; do not edit by hand -->", ""]
    out.append(f"Machine: {machine.get('device', '?')}; measured {env.get('time', '?')} by "
               f"`{payload.get('command', 'python -m cupa.bench')}`.")
    out.append("Versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()) + ".")
    out.append(f"Timing: {payload.get('timing', 'median of runs')}; every peer in the same process on the same "
               "inputs.")
    if roof:
        out.append(f"Roofline: read {roof['read_tb_per_s']:.3g} TB/s ({roof['read_from']}), compute "
                   f"{roof['compute_tflop_per_s']:.3g} TFLOP/s ({roof['compute_from']}). Parenthesized ratios: "
                   "other time / cupa time (> 1: cupa faster).")
    peers = payload.get("peers") or {}
    if peers:
        out.append("Peers: " + "; ".join(
            f"{name} {p.get('version', '')} ({p['status']})".replace(" ()", "").replace("  ", " ")
            if p["status"] == "available" else f"{name}: {p['status']}" for name, p in peers.items()) + ".")
    skipped = [f"{name} ({s['reason']})" for name, s in (payload.get("suites") or {}).items()
               if s.get("status") == "skipped"]
    if skipped:
        out.append("Suites skipped: " + "; ".join(skipped) + ".")
    cmp_index = _compare_index(payload)
    for suite in _suites(payload):
        recs = [r for r in payload["cases"] if r["suite"] == suite]
        cols = _columns(recs)
        head = ["case", "backend", "cupa", "rate", "% of roofline"] + [name for _, name in cols]
        if cmp_index:
            head.append(f"vs {payload['compare']['baseline_name']}")
        out += ["", f"### {suite}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        notes = {}
        for rec in recs:
            us, thr, frac = _headline(rec)
            row = [rec["case"], (rec.get("cupa") or {}).get("backend", ""), us, thr, frac]
            for kind, name in cols:
                m = _entry(rec, kind, name)
                row.append(_cell(m))
                if isinstance(m, dict) and m.get("status") not in ("ok", "same as default") and m.get("reason"):
                    notes.setdefault((name, m["status"], m["reason"]), []).append(rec["case"])
            if cmp_index:
                c = cmp_index.get(rec["id"])
                row.append(f"{c['cupa_ratio']:.2f}x" if c and c.get("cupa_ratio") else "-")
            out.append("| " + " | ".join(row) + " |")
            m = rec.get("cupa") or {}
            if m.get("status") not in (None, "ok") and m.get("reason"):
                notes.setdefault(("cupa", m["status"], m["reason"]), []).append(rec["case"])
        if notes:
            out.append("")
            for (name, status, reason), which in notes.items():
                where = f"{len(which)} cases" if len(which) > 3 else ", ".join(which)
                out.append(f"- {name} {status} ({where}): {reason}")
    return "\n".join(out) + "\n"


# -- comparison and merging ------------------------------------------------------------------------

def compare(payload: dict, baseline: dict, baseline_name: str) -> dict:
    """Per case present in both runs: old / new median time of cupa and of each peer and variant
    (> 1: faster now). Stored as ``payload["compare"]`` and returned."""
    old = {r["id"]: r for r in baseline.get("cases", [])}
    rows = []
    for rec in payload["cases"]:
        prev = old.get(rec["id"])
        if prev is None:
            continue
        row = {"id": rec["id"]}
        for kind, name, m in measurements(rec):
            before = prev.get("cupa") if kind == "cupa" else _entry(prev, kind, name)
            if _ok(m) and _ok(before):
                key = "cupa" if kind == "cupa" else f"{kind}:{name}"
                row[f"{key}_old_us"] = before["median_us"]
                row[f"{key}_new_us"] = m["median_us"]
                row[f"{key}_ratio"] = before["median_us"] / m["median_us"]
        rows.append(row)
    payload["compare"] = {"baseline": str(baseline_name), "baseline_name": Path(str(baseline_name)).name,
                          "baseline_time": (baseline.get("environment") or {}).get("time"), "cases": rows,
                          "missing_in_baseline": [r["id"] for r in payload["cases"] if r["id"] not in old]}
    return payload["compare"]


def compare_lines(payload: dict) -> list:
    cmp = payload.get("compare")
    if not cmp:
        return []
    lines = [f"compared with {cmp['baseline']} ({cmp.get('baseline_time')}): old time / new time (> 1: faster now)"]
    for row in cmp["cases"]:
        parts = [f"{k[:-6]} {v:.2f}x" for k, v in row.items() if k.endswith("_ratio")]
        lines.append(f"  {row['id']:<60s} " + ", ".join(parts))
    if cmp["missing_in_baseline"]:
        lines.append(f"  not in the baseline: {len(cmp['missing_in_baseline'])} cases")
    return lines


def merge(payloads: list, sources: list) -> dict:
    """One payload from several runs (a later run's case replaces an earlier one with the same id)."""
    if not payloads:
        raise ValueError("merge: no result files")
    devices = {(p.get("environment") or {}).get("machine", {}).get("device") for p in payloads}
    merged = dict(payloads[0])
    merged["merged_from"] = [Path(str(s)).name for s in sources]
    commands = [p.get("command") for p in payloads if p.get("command")]
    if commands:   # every run's command, in order (one command when they are all the same)
        merged["command"] = "; ".join(dict.fromkeys(commands))
    if len(devices) > 1:
        merged["warning"] = f"merged runs come from different machines: {sorted(map(str, devices))}"
    cases = {}
    for p in payloads:
        for rec in p["cases"]:
            cases[rec["id"]] = rec
    merged["cases"] = list(cases.values())
    merged["probes"] = [probe for p in payloads for probe in p.get("probes") or []]
    peers, suites = {}, {}
    for p in payloads:
        for name, info in (p.get("peers") or {}).items():
            if name not in peers or info.get("status") == "available":
                peers[name] = info
        for name, info in (p.get("suites") or {}).items():
            if name not in suites or info.get("status") == "ran":
                suites[name] = info
    merged["peers"], merged["suites"] = peers, suites
    merged.pop("compare", None)
    return finalize(merged)


#: The README's performance table: (case id, label) rows and the peer columns, from one result file.
README_ROWS = (
    ("decode/B=64 L=4096", "decode B=64, L=4096"),
    ("decode/B=16 L=32768", "decode B=16, L=32768"),
    ("decode/B=8 L=8192", "decode B=8, L=8192"),
    ("decode/B=64 L=4096 int8/per-channel", "decode int8 per-channel, B=64, L=4096"),
    ("decode/B=64 L=4096 fp8/per-tensor", "decode fp8 per-tensor, B=64, L=4096"),
    ("decode/B=64 L=4096 int4/per-channel", "decode int4 per-channel, B=64, L=4096"),
    ("prefill/B=4 q=2048", "causal prefill B=4 x 2048"),
    ("chunked/B=8 past=8192 q=512", "chunked prefill B=8 x (8192 + 512)"),
    ("mixed/decode 64x4096 + prefill 512@0", "64 decodes + one 512-token prefill"),
    ("mla/B=64 L=4096 H=128", "MLA decode B=64, L=4096, 128 heads"),
    ("mla/B=4 L=4608 H=128 q=512", "MLA chunked prefill B=4 x (4096 + 512)"),
)
README_PEERS = ("torch_sdpa_cudnn", "flashinfer", "onnxruntime")


def readme_table(payload: dict, rows=README_ROWS, peers=README_PEERS) -> list:
    """Markdown lines of the README's performance table: cupa's time, rate and fraction of the
    roofline, and each peer's time with its ratio (other / cupa) where it ran."""
    index = {r["id"]: r for r in payload["cases"]}
    lines = ["| case | cupa | rate | of roofline | " + " | ".join(peers) + " |",
             "|---" * (4 + len(peers)) + "|"]
    for case_id, label in rows:
        rec = index.get(case_id)
        if rec is None:
            continue
        us, thr, frac = _headline(rec)
        cells = [_cell((rec.get("peers") or {}).get(p)) for p in peers]
        cells = ["-" if c in ("unsupported", "missing") else c for c in cells]
        lines.append(f"| {label} | {us} | {thr} | {frac} | " + " | ".join(cells) + " |")
    return lines


def peers_faster(payload: dict) -> list:
    """Every (case id, peer, peer time, cupa time, ratio) where a peer that ran and agreed with cupa
    took less time than cupa (ratio = peer / cupa < 1), slowest ratio first."""
    found = []
    for rec in payload["cases"]:
        m = rec.get("cupa")
        if not _ok(m):
            continue
        for name, p in (rec.get("peers") or {}).items():
            if _ok(p) and p.get("agrees") is not False and p["median_us"] < m["median_us"]:
                found.append((rec["id"], name, p["median_us"], m["median_us"], p["median_us"] / m["median_us"]))
    return sorted(found, key=lambda f: f[4])


def peers_faster_lines(payload: dict) -> list:
    """:func:`peers_faster` as markdown table lines."""
    lines = ["| case | peer | peer | cupa | peer / cupa |", "|---|---|---|---|---|"]
    for case_id, name, peer_us, cupa_us, ratio in peers_faster(payload):
        lines.append(f"| {case_id} | {name} | {_fmt_us(peer_us)} us | {_fmt_us(cupa_us)} us | {ratio:.2f} |")
    return lines
