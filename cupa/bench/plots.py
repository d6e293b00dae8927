"""PNG plots of a run, written next to its JSON (matplotlib's Agg canvas; no display needed).

- ``<stem>_bandwidth.png``: decode (and MLA) bandwidth against context length, one panel per block
  size (the ``context`` sweep): cupa solid, each peer dashed, the read roofline as a grey line.
- ``<stem>_tflops.png``: prefill TFLOP/s against prompt length (the ``length`` sweep), one panel per
  series (T and block size), with the compute roofline.
- ``<stem>_speedup.png``: for each peer, its time / cupa's time on every case both ran (log scale;
  above 1: cupa faster), points coloured by suite.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["write_plots", "plot_paths"]

_PLOTS = ("bandwidth", "tflops", "speedup")


def plot_paths(json_path) -> dict:
    p = Path(json_path)
    return {kind: p.with_name(f"{p.stem}_{kind}.png") for kind in _PLOTS}


def _figure(panels: int, title: str):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    cols = min(panels, 4) or 1
    rows = -(-max(panels, 1) // cols)
    fig = Figure(figsize=(4.2 * cols, 3.4 * rows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax in axes[max(panels, 1):]:
        ax.set_visible(False)
    fig.suptitle(title)
    return fig, axes


def _ok(m) -> bool:
    return isinstance(m, dict) and m.get("status") == "ok" and m.get("median_us")


def _series(payload: dict, sweep: str, suites: tuple) -> dict:
    """``{series label: [record, ...]}`` of the records tagged with ``sweep``, sorted by x."""
    out = {}
    for rec in payload["cases"]:
        tags = rec.get("tags") or {}
        if rec["suite"] in suites and tags.get("sweep") == sweep and "x" in tags:
            label = tags.get("series", "")
            if rec["suite"] != suites[0]:
                label = f"{rec['suite']} {label}".strip()
            out.setdefault(label, []).append(rec)
    for recs in out.values():
        recs.sort(key=lambda r: r["tags"]["x"])
    return out


def _sweep_plot(payload: dict, path: Path, sweep: str, suites: tuple, metric: str, ylabel: str, xlabel: str,
                roof: float, roof_label: str, title: str) -> None:
    groups = _series(payload, sweep, suites)
    fig, axes = _figure(len(groups), title)
    if not groups:
        axes[0].text(0.5, 0.5, f"no '{sweep}' sweep in this run", ha="center", va="center")
        axes[0].set_axis_off()
    markers = "osD^v<>P*X"
    for ax, (label, recs) in zip(axes, sorted(groups.items())):
        peer_names = []
        for r in recs:
            for name in (r.get("peers") or {}):
                if name not in peer_names:
                    peer_names.append(name)
        for i, (name, get) in enumerate([("cupa", lambda r: r.get("cupa"))] +
                                        [(n, lambda r, n=n: (r.get("peers") or {}).get(n)) for n in peer_names]):
            pts = [(r["tags"]["x"], get(r)[metric]) for r in recs if _ok(get(r)) and metric in get(r)
                   and get(r).get("agrees") is not False]
            if not pts:
                continue
            xs, ys = zip(*pts)
            ax.plot(xs, ys, linestyle="-" if name == "cupa" else "--", marker=markers[i % len(markers)],
                    linewidth=2.2 if name == "cupa" else 1.2, markersize=4, label=name)
        if roof:
            ax.axhline(roof, color="grey", linewidth=1, linestyle=":", label=roof_label)
        ax.set_xscale("log", base=2)
        ax.set_title(label or sweep)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.savefig(path, dpi=110)


def _speedup_plot(payload: dict, path: Path) -> None:
    peers = []
    for rec in payload["cases"]:
        for name, m in (rec.get("peers") or {}).items():
            if _ok(m) and m.get("ratio") and name not in peers:
                peers.append(name)
    fig, axes = _figure(len(peers), "peer time / cupa time per case (> 1: cupa faster)")
    if not peers:
        axes[0].text(0.5, 0.5, "no peer ran in this run", ha="center", va="center")
        axes[0].set_axis_off()
    suites = []
    for rec in payload["cases"]:
        if rec["suite"] not in suites:
            suites.append(rec["suite"])
    colors = {s: f"C{i}" for i, s in enumerate(suites)}
    for ax, name in zip(axes, peers):
        seen = set()
        for i, rec in enumerate(payload["cases"]):
            m = (rec.get("peers") or {}).get(name)
            if not (_ok(m) and m.get("ratio")):
                continue
            s = rec["suite"]
            ax.scatter([i], [m["ratio"]], s=14, color=colors[s], marker="x" if m.get("agrees") is False else "o",
                       label=None if s in seen else s)
            seen.add(s)
        ax.axhline(1.0, color="grey", linewidth=1)
        ax.set_yscale("log")
        ax.set_title(name)
        ax.set_xlabel("case (run order)")
        ax.set_ylabel("peer time / cupa time")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.savefig(path, dpi=110)


def write_plots(payload: dict, json_path) -> list:
    """Write the three PNGs next to ``json_path``; returns their paths."""
    paths = plot_paths(json_path)
    roof = payload.get("roofline") or {}
    _sweep_plot(payload, paths["bandwidth"], "context", ("decode", "mla"), "tb_per_s", "TB/s (KV bytes / time)",
                "context length (tokens)", roof.get("read_tb_per_s"), "read roofline",
                "decode bandwidth vs context length")
    _sweep_plot(payload, paths["tflops"], "length", ("prefill",), "tflop_per_s", "TFLOP/s (causal)",
                "prompt length (tokens)", roof.get("compute_tflop_per_s"), "GEMM roofline",
                "prefill TFLOP/s vs prompt length")
    _speedup_plot(payload, paths["speedup"])
    return list(paths.values())
