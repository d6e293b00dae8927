"""``python -m cupa.bench``: the CPU smoke run (JSON schema, markdown, plots, --compare, --merge, --only;
the general suite's derived figures and targets), the report arithmetic on known numbers, and each peer
adapter's input construction on the CPU.

Adapters are checked against the documented semantics of their library's call: the index arrays and
argument tensors they build are fed to a plain NumPy attention that reads them the way the library's
documentation says it does, and the result must equal cupa's reference output on the same inputs
(float32 T, so the comparison is tight). torch SDPA runs for real (torch's CPU build); the ONNX
Runtime model passes ONNX Runtime's own schema and type checks (its CPU build then reports that no
CPU kernel exists, which is the only failure allowed).
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import numpy as np
import pytest

import cupa
from cupa.bench import cases as C
from cupa.bench import cli, report, sweeps
from cupa.bench.general import GeneralSuite
from cupa.bench.peers import Peer, Prepared, Unsupported, all_peers
from cupa.bench.runtime import NumpyRuntime
from cupa.bench.suites import SUITE_ORDER, AttentionSuite, Context, all_suites, rel_err, time_peer

SMALL = dict(num_heads=4, kv_num_heads=2, head_size=16, dtype="float32")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# -- the smoke run -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "results.json"
    assert cli.main(["--smoke", "--out", str(out)]) == 0
    return out, json.loads(out.read_text())


def test_smoke_json_schema(smoke):
    _, payload = smoke
    assert payload["schema"] == report.SCHEMA and payload["size"] == "smoke" and payload["reps"] == 3
    assert {"machine", "versions", "time"} <= set(payload["environment"])
    assert payload["environment"]["versions"]["cupa"] == cupa.__version__
    probes = payload["probes"][0]
    assert probes["read"]["tb_per_s"] > 0 and probes["gemm"]["tflop_per_s"] > 0
    # every peer is listed (not run in smoke mode), none dropped
    assert set(payload["peers"]) == {p.name for p in all_peers()}
    assert all(p["status"] == "not run" for p in payload["peers"].values())
    suites = payload["suites"]
    assert set(suites) == set(SUITE_ORDER)
    for name in ("decode", "prefill", "chunked", "mixed", "mla", "subbyte", "general"):
        assert suites[name]["status"] == "ran", name
    assert suites["graphs"]["status"] == "skipped" and "CUDA" in suites["graphs"]["reason"]
    if hasattr(cupa, "CascadeAttention"):
        assert suites["cascade"]["status"] == "ran"
        cascade = [r for r in payload["cases"] if r["suite"] == "cascade"]
        assert cascade and all(r["cupa"]["rel_err_vs_plain"] < 2e-3 for r in cascade)
    else:
        assert suites["cascade"]["status"] == "skipped" and "CascadeAttention" in suites["cascade"]["reason"]
    ids = [r["id"] for r in payload["cases"]]
    assert len(ids) == len(set(ids))
    expected = {c.id for s in ("decode", "prefill", "chunked", "mixed", "mla", "subbyte")
                for c in sweeps.attention_cases(s, "smoke")}
    expected |= {c.id for c in GeneralSuite().items("smoke")}
    assert expected <= set(ids)


def test_smoke_case_records(smoke):
    _, payload = smoke
    roof = payload["roofline"]
    for rec in payload["cases"]:
        assert {"suite", "case", "id", "params", "cupa", "variants", "peers"} <= set(rec), rec["id"]
        assert rec["id"] == f"{rec['suite']}/{rec['case']}"
        m = rec["cupa"]
        assert m["status"] in ("ok", "not served", "error"), rec["id"]
        if m["status"] != "ok":
            assert m["reason"], rec["id"]
            continue
        assert m["min_us"] <= m["median_us"] <= m["max_us"] and m["median_us"] > 0, rec["id"]
        if "bytes" not in rec:
            continue
        assert rec["bytes"] > 0 and rec["flops"] > 0
        assert m["tb_per_s"] == pytest.approx(rec["bytes"] / m["median_us"] / 1e6)
        assert m["tflop_per_s"] == pytest.approx(rec["flops"] / m["median_us"] / 1e6)
        floor = max(rec["bytes"] / (roof["read_tb_per_s"] * 1e6), rec["flops"] / (roof["compute_tflop_per_s"] * 1e6))
        assert rec["roofline"]["floor_us"] == pytest.approx(floor)
        assert m["fraction_of_roofline"] == pytest.approx(floor / m["median_us"])
        assert m["backend"] == "reference"
    by_id = {r["id"]: r for r in payload["cases"]}
    sub = [r for r in payload["cases"] if r["suite"] == "subbyte"]
    assert sub and all(r["cupa"]["status"] in ("ok", "not served") for r in sub)
    assert by_id[C.mla(2, 16, num_heads=2, block_size=4).id]["cupa"]["status"] == "ok"


def _target_met(target: dict) -> bool:
    if "at_least" in target:
        return target["value"] >= target["at_least"]
    return target["value"] <= target["at_most"]


def test_smoke_general_records(smoke):
    """The general suite: each call and its variants ran (the NumPy reference), the derived figures
    follow from the medians, the targets are recorded with whether they are met."""
    _, payload = smoke
    recs = {r["case"].split(" B=")[0]: r for r in payload["cases"] if r["suite"] == "general"}
    assert set(recs) == {"prefill bias", "decode qk_output=2", "latent bias"}
    for rec in recs.values():
        assert rec["cupa"]["status"] == "ok" and rec["peers"] == {}, rec["id"]
        assert all(m["status"] == "ok" for m in rec["variants"].values()), rec["id"]
        assert "attention_bias" in rec["details"]["peers"]
    p = recs["prefill bias"]
    assert set(p["variants"]) == {"general bias", "prefill bias", "general no bias", "fused no bias"}
    B, H, q = p["params"]["B"], p["params"]["num_heads"], p["params"]["q_len"]
    assert p["flops"] == 4 * H * p["params"]["head_size"] * B * q * (q + 1) // 2
    assert p["details"]["bias_shape"] == [B, H, q, q]
    for m in [p["cupa"], *p["variants"].values()]:
        assert m["tflop_per_s"] == pytest.approx(p["flops"] / m["median_us"] / 1e6)
    assert p["cupa"]["bias_cost_vs_general_no_bias"] == pytest.approx(
        p["cupa"]["median_us"] / p["variants"]["general no bias"]["median_us"])
    t = p["target"]
    assert t["at_least"] == 150.0 and t["value"] == p["cupa"]["tflop_per_s"] and t["met"] == _target_met(t)
    d = recs["decode qk_output=2"]
    assert set(d["variants"]) == {"qk_output=1", "bias", "general plain", "fused no qk"}
    B, H, L = d["params"]["B"], d["params"]["num_heads"], d["params"]["past"] + 1
    floor = d["floor"]
    assert floor["output_qk_shape"] == [H, B, L] and floor["output_qk_bytes"] == H * B * L * 4
    assert floor["write_tb_per_s"] == d["write_probe"]["tb_per_s"] > 0
    assert floor["floor_us"] == pytest.approx(d["variants"]["fused no qk"]["median_us"]
                                              + floor["output_qk_bytes"] / floor["write_tb_per_s"] / 1e6)
    for label, m in [("cupa", d["cupa"]), *d["variants"].items()]:
        if label != "fused no qk":
            assert m["ratio_to_floor"] == pytest.approx(m["median_us"] / floor["floor_us"]), label
    for label in ("qk_output=1", "general plain", "fused no qk"):       # the same attention as cupa's call
        assert d["variants"][label]["rel_err_vs_cupa"] < 1e-6 and d["variants"][label]["agrees"], label
    t = d["target"]
    assert t["at_most"] == 1.5 and t["value"] == d["cupa"]["ratio_to_floor"] and t["met"] == _target_met(t)
    lat = recs["latent bias"]
    assert lat["params"]["layout"] == "LATENT" and "target" not in lat
    assert lat["details"]["bias_shape"] == [1, 1, 1, lat["params"]["past"] + 1]
    assert not payload["mismatches"]


def test_general_variants_name_the_general_backend():
    """On a device runtime the no-bias / no-qk variants run ``Options(backend="general")`` (NumPy arrays
    stand in for a device here: the general backend declines them, saying why)."""
    class DeviceLike(NumpyRuntime):
        on_device = True

    suite = GeneralSuite()
    ctx = Context(DeviceLike(), [], reps=1, size="smoke")
    prefill, decode, _ = suite.items("smoke")
    rec = suite.run(prefill, ctx)
    assert rec["cupa"]["status"] == "ok" and rec["variants"]["fused no bias"]["status"] == "ok"
    assert rec["variants"]["general no bias"]["status"] == "not served"
    assert "'general'" in rec["variants"]["general no bias"]["reason"]
    rec = suite.run(decode, ctx)
    assert rec["variants"]["general plain"]["status"] == "not served"
    assert rec["target"]["met"] == _target_met(rec["target"])


def test_smoke_markdown_lists_every_case(smoke):
    out, payload = smoke
    md = out.with_suffix(".md").read_text()
    assert md.startswith("<!-- generated by python -m cupa.bench")
    for suite in {r["suite"] for r in payload["cases"]}:
        assert f"### {suite}\n" in md
    for rec in payload["cases"]:
        rows = [ln for ln in md.splitlines() if ln.startswith(f"| {rec['case']} |")]
        assert len(rows) == 1, rec["id"]
        assert rows[0].count("|") == md.split(f"### {rec['suite']}\n", 1)[1].splitlines()[2].count("|")
    # a case cupa does not serve says why
    for rec in payload["cases"]:
        if rec["cupa"]["status"] == "not served":
            assert rec["cupa"]["reason"] in md
    assert "Suites skipped: " in md and "graphs (CUDA graphs need a CUDA device)" in md


def test_smoke_plots(smoke):
    out, _ = smoke
    for kind in ("bandwidth", "tflops", "speedup"):
        png = out.with_name(f"{out.stem}_{kind}.png")
        data = png.read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 5000, kind


def test_compare_gives_old_over_new(smoke, tmp_path):
    out, payload = smoke
    base = copy.deepcopy(payload)
    for i, rec in enumerate(base["cases"]):
        if rec["cupa"].get("status") == "ok":
            rec["cupa"]["median_us"] = 100.0 + i
    base_path = tmp_path / "old.json"
    base_path.write_text(json.dumps(base))
    new_path = tmp_path / "new.json"
    assert cli.main(["--smoke", "--only", "decode,mla", "--compare", str(base_path), "--out", str(new_path)]) == 0
    new = json.loads(new_path.read_text())
    old = {r["id"]: r for r in base["cases"]}
    rows = {r["id"]: r for r in new["compare"]["cases"]}
    assert set(rows) == {r["id"] for r in new["cases"]}
    for rec in new["cases"]:
        if rec["cupa"]["status"] == "ok":
            expected = old[rec["id"]]["cupa"]["median_us"] / rec["cupa"]["median_us"]
            assert rows[rec["id"]]["cupa_ratio"] == pytest.approx(expected)
    md = new_path.with_suffix(".md").read_text()
    assert "| vs old.json |" in md
    rec = next(r for r in new["cases"] if r["cupa"]["status"] == "ok")
    row = next(ln for ln in md.splitlines() if ln.startswith(f"| {rec['case']} |"))
    assert row.endswith(f"| {rows[rec['id']]['cupa_ratio']:.2f}x |")


def test_merge_unions_runs(smoke, tmp_path):
    _, payload = smoke
    a, b = copy.deepcopy(payload), copy.deepcopy(payload)
    a["cases"] = [r for r in a["cases"] if r["suite"] == "decode"]
    b["cases"] = [r for r in b["cases"] if r["suite"] != "decode"]
    b["probes"][0]["read"]["tb_per_s"] *= 2
    pa, pb, out = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "all.json"
    pa.write_text(json.dumps(a))
    pb.write_text(json.dumps(b))
    assert cli.main(["--merge", str(pa), str(pb), "--out", str(out), "--no-plots"]) == 0
    merged = json.loads(out.read_text())
    assert [r["id"] for r in merged["cases"]] == [r["id"] for r in payload["cases"]]
    assert merged["roofline"]["read_tb_per_s"] >= b["probes"][0]["read"]["tb_per_s"]
    assert merged["merged_from"] == [pa.name, pb.name]


def test_only_selects_suites_and_cases():
    suites = all_suites()
    chosen = {s.name: [i.id for i in items] for s, items in cli.select(suites, "smoke", "mla")}
    assert list(chosen) == ["mla"] and len(chosen["mla"]) == len(sweeps.attention_cases("mla", "smoke"))
    chosen = {s.name: [i.id for i in items] for s, items in cli.select(suites, "smoke", "decode:bs=1,q=16")}
    assert chosen["decode"] and all("bs=1" in i for i in chosen["decode"])
    assert set(chosen) == {"decode", "prefill"} and all("q=16" in i for i in chosen["prefill"])
    assert cli.select(suites, "smoke", "nothing-matches-this") == []


def test_list_runs_nothing(capsys):
    assert cli.main(["--smoke", "--list", "--only", "mixed"]) == 0
    text = capsys.readouterr().out
    assert "mixed (1)" in text and "peers: none" in text


# -- report arithmetic -------------------------------------------------------------------------------

def _payload(cases):
    return {"schema": 1, "cases": cases, "probes": [{"read": {"tb_per_s": 4.0}, "gemm": {"tflop_per_s": 500.0,
                                                                                       "what": "gemm"}}]}


def _rec(id_, bytes_, flops, cupa_us, peers=None, variants=None, dtype="float16"):
    suite, name = id_.split("/", 1)
    return {"suite": suite, "case": name, "id": id_, "params": {"dtype": dtype, "cache": "T"}, "tags": {},
            "bytes": bytes_, "flops": flops, "cupa": {"status": "ok", "median_us": cupa_us, "min_us": cupa_us,
                                                      "max_us": cupa_us},
            "variants": variants or {}, "peers": peers or {}}


def test_finalize_rooflines_ratios_and_mismatches():
    ok = lambda us, err=None: {"status": "ok", "median_us": us, "min_us": us, "max_us": us,  # noqa: E731
                               **({} if err is None else {"rel_err_vs_cupa": err})}
    payload = _payload([
        _rec("decode/a", 1e9, 1e9, 200.0, peers={"p": ok(250.0, 1e-3), "bad": ok(50.0, 0.5),
                                                  "gone": {"status": "missing", "reason": "ImportError: x"}}),
        _rec("prefill/b", 1e8, 2e11, 500.0, variants={"v": ok(400.0, 1e-3)}),
    ])
    report.finalize(payload)
    roof = payload["roofline"]
    assert roof["read_tb_per_s"] == pytest.approx(5.0)          # cupa's 1e9 B in 200 us beats the 4 TB/s probe
    assert roof["read_from"] == "cupa on decode/a"               # not "bad": its output disagrees
    assert roof["compute_tflop_per_s"] == pytest.approx(500.0)
    a, b = payload["cases"]
    assert a["peers"]["p"]["ratio"] == pytest.approx(1.25) and a["peers"]["p"]["agrees"] is True
    assert a["peers"]["bad"]["agrees"] is False
    assert payload["mismatches"] == [{"id": "decode/a", "peer": "bad", "rel_err_vs_cupa": 0.5, "tolerance": 1e-2}]
    assert a["roofline"]["bound"] == "memory" and a["cupa"]["fraction_of_roofline"] == pytest.approx(1.0)
    assert b["roofline"]["bound"] == "compute"
    assert b["cupa"]["fraction_of_roofline"] == pytest.approx(2e11 / 500e6 / 500.0)
    assert b["variants"]["v"]["ratio"] == pytest.approx(0.8)
    md = report.markdown(payload)
    assert "| a |  | 200.0 us | 5 TB/s | 100% | 250.0 us (1.25x) | 50.0 us (0.25x) MISMATCH | missing |" in md
    assert "- gone missing (a): ImportError: x" in md
    assert any("MISMATCH decode/a" in line for line in report.summary_lines(payload))
    again = copy.deepcopy(payload)
    assert report.finalize(again) == payload                     # idempotent


def test_compare_matches_cases_by_id():
    new = _payload([_rec("decode/a", 1, 1, 100.0, peers={"p": {"status": "ok", "median_us": 300.0}}),
                    _rec("decode/new", 1, 1, 10.0)])
    old = _payload([_rec("decode/a", 1, 1, 150.0, peers={"p": {"status": "ok", "median_us": 330.0}})])
    cmp = report.compare(new, old, "base.json")
    assert cmp["missing_in_baseline"] == ["decode/new"]
    (row,) = cmp["cases"]
    assert row["cupa_ratio"] == pytest.approx(1.5) and row["peer:p_ratio"] == pytest.approx(1.1)


# -- the attention runner with fake peers ------------------------------------------------------------

class _FakePeer(Peer):
    suites = ("decode",)

    def __init__(self, name, behaviour):
        self.name, self.behaviour = name, behaviour

    def _probe(self):
        if self.behaviour == "missing":
            raise ImportError("No module named 'fake_peer'")
        return "1.0"

    def prepare(self, built, runtime):
        if self.behaviour == "unsupported":
            raise Unsupported("the fake peer has no such feature")
        if self.behaviour == "error":
            raise RuntimeError("kernel launch failed")
        op = cupa.PagedAttention(**built.attributes)
        inputs = built.call_inputs()
        result = {}
        return Prepared(lambda: result.__setitem__("o", op(**inputs)), lambda: result["o"], "reference again")


def test_attention_suite_records_every_peer_status():
    peers = [_FakePeer(n, n) for n in ("missing", "unsupported", "error", "ok")]
    ctx = Context(NumpyRuntime(), peers, reps=2, size="smoke")
    case = C.decode(2, 12, block_size=4, **SMALL)
    rec = AttentionSuite("decode", "").run(case, ctx)
    p = rec["peers"]
    assert p["missing"] == {"status": "missing", "reason": "ImportError: No module named 'fake_peer'"}
    assert p["unsupported"] == {"status": "unsupported", "reason": "the fake peer has no such feature"}
    assert p["error"]["status"] == "error" and "kernel launch failed" in p["error"]["reason"]
    assert p["ok"]["status"] == "ok" and p["ok"]["rel_err_vs_cupa"] == 0.0 and p["ok"]["note"] == "reference again"
    assert "read_probe" in rec                                   # decode is memory-bound by default


def test_time_peer_without_cupa_output_skips_the_check():
    ctx = Context(NumpyRuntime(), [], reps=1, size="smoke")
    built = C.build(C.decode(1, 8, block_size=4, **SMALL))
    entry = time_peer(_FakePeer("ok", "ok"), built, ctx, None)
    assert entry["status"] == "ok" and "rel_err_vs_cupa" not in entry


# -- inputs and index helpers ------------------------------------------------------------------------

def test_build_inputs_follow_the_case():
    case = C.Case("decode", "x", (1, 3, 0), (5, 0, 9), block_size=4, cache="int8", quant="PER_TENSOR", sinks=True,
                  **{k: v for k, v in SMALL.items() if k != "dtype"})
    b = C.build(case, seed=3)
    x = b.inputs
    assert x["query"].shape == (4, 4 * 16) and x["key_cache"].dtype == np.int8
    assert x["k_scale"].shape == (1,) and x["head_sink"].shape == (4,)
    assert list(x["attention_metadata"]) == [3, 9]
    assert list(b.cu_seqlens) == [0, 1, 4, 4]
    used = b.block_table[b.block_table >= 0]
    assert len(np.unique(used)) == used.size == x["key_cache"].shape[0]     # each block owned once
    for bi, kv in enumerate(b.kv_lens):
        assert (b.block_table[bi, :math.ceil(kv / 4)] >= 0).all() and (b.block_table[bi, math.ceil(kv / 4):] == -1).all()
    assert b.block_table.shape[1] == 2 * math.ceil(9 / 4)
    assert case.kv_bytes() == (6 + 3 + 9) * 2 * 2 * 16
    assert case.flops() == 4 * 4 * 16 * (6 + (1 + 2 + 3) + 0)


def test_admitted_pairs_counts_causal_and_window():
    assert C.admitted_pairs([3], [2]) == 3 + 4 + 5
    assert C.admitted_pairs([3], [2], window=2) == 2 * 3
    assert C.admitted_pairs([2], [1], is_causal=0) == 3 * 2


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dense_kv_and_page_indices_address_the_same_rows(rng, dtype):
    case = C.ragged_decode([7, 1, 13], "t", block_size=4, **{**SMALL, "dtype": dtype})
    b = C.build(case, seed=int(rng.integers(1 << 30)))
    kc = b.inputs["key_cache"]
    dense = C.dense_kv(kc, b.block_table, 7, 4)
    assert dense.dtype == kc.dtype and dense.shape == (3, 2, 7, 16) and dense.flags.c_contiguous
    for bi in range(3):
        for pos in range(7):
            np.testing.assert_array_equal(dense[bi, :, pos], kc[b.block_table[bi, pos // 4], pos % 4])
    indptr, indices, last = C.page_indices(b.block_table, b.kv_lens, 4)
    for bi, kv in enumerate(b.kv_lens):
        pages = indices[indptr[bi]:indptr[bi + 1]]
        rows = np.concatenate([p * 4 + np.arange(4 if j < len(pages) - 1 else last[bi]) for j, p in enumerate(pages)])
        np.testing.assert_array_equal(rows, C.cache_positions(b.block_table, int(kv), 4, bi))
        assert 1 <= last[bi] <= 4


# -- peers' inputs against their documented semantics -------------------------------------------------

def _attend(q, k, v, scale, q_pos, window=-1):
    """q (S, H, D) at positions q_pos; k, v (L, Hk, D) at positions 0..L-1; causal, optional window."""
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1).astype(np.float64), np.repeat(v, group, axis=1).astype(np.float64)
    s = np.einsum("shd,lhd->hsl", q.astype(np.float64), k) * scale
    pos = np.arange(k.shape[0])
    ok = pos[None, :] <= q_pos[:, None]
    if window > 0:
        ok &= pos[None, :] > q_pos[:, None] - window
    s = np.where(ok[None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hsl,lhd->shd", p, v)


def _reference(built):
    op = cupa.PagedAttention(**built.attributes)
    return np.asarray(op(**built.call_inputs()), dtype=np.float64)


PEER_CASES = [
    C.decode(3, 10, block_size=4, **SMALL),
    C.decode(2, 11, block_size=4, window=4, **SMALL),
    C.prefill(2, 6, block_size=4, **SMALL),
    C.chunked(2, 5, 3, block_size=4, **SMALL),
    C.ragged_decode([3, 9, 14], "t", block_size=4, **SMALL),
    C.mixed(2, 9, [(4, 0), (3, 6)], block_size=4, **SMALL),
]


@pytest.mark.parametrize("case", PEER_CASES, ids=lambda c: c.id)
def test_flashinfer_page_table_reads_cupas_cache(case, rng):
    """FlashInfer's documented page table: sequence b's KV rows are its pages indices[indptr[b]:indptr[b+1]]
    in order, all full but the last, which holds last_page_len[b] rows; queries qo_indptr-packed,
    causal aligned to the end of the KV, window_left = W - 1 keys before the query."""
    b = C.build(case, seed=int(rng.integers(1 << 30)))
    expected = _reference(b)                                   # also writes the new K/V, as cupa does first
    indptr, indices, last = C.page_indices(b.block_table, b.kv_lens, case.block_size)
    qo = b.cu_seqlens
    kc, vc = b.inputs["key_cache"], b.inputs["value_cache"]
    q = b.inputs["query"].reshape(case.token_count, case.num_heads, case.head_size)
    window_left = case.window - 1 if case.window > 0 else -1
    got = np.zeros_like(expected).reshape(q.shape)
    for s in range(case.batch_size):
        pages = indices[indptr[s]:indptr[s + 1]]
        k = np.concatenate([kc[p, :(last[s] if j == len(pages) - 1 else case.block_size)] for j, p in enumerate(pages)])
        v = np.concatenate([vc[p, :(last[s] if j == len(pages) - 1 else case.block_size)] for j, p in enumerate(pages)])
        n_q = qo[s + 1] - qo[s]
        q_pos = len(k) - n_q + np.arange(n_q)
        got[qo[s]:qo[s + 1]] = _attend(q[qo[s]:qo[s + 1]], k, v, case.softmax_scale, q_pos,
                                        window_left + 1 if window_left >= 0 else -1)
    assert rel_err(expected, got.reshape(expected.shape)) < 1e-5


@pytest.mark.parametrize("case", [c for c in PEER_CASES if c.uniform] + [PEER_CASES[4], PEER_CASES[5]],
                         ids=lambda c: c.id)
def test_flash_attn_kvcache_arguments_append_and_attend(case, rng):
    """flash_attn_with_kvcache's documented behaviour on the arguments the adapter builds: k/v written at
    cache_seqlens, cache_seqlens + 1, ... of each sequence through the block table, then attention of q
    over cache_seqlens + new keys, causal from the bottom right, window_size=(left, 0)."""
    from cupa.bench.peers.flash_attn import kvcache_arguments

    b = C.build(case, seed=int(rng.integers(1 << 30)))
    fresh = {n: b.inputs[n].copy() for n in ("key_cache", "value_cache")}
    expected = _reference(b)
    varlen = not len(set(case.q_lens)) == 1
    args = kvcache_arguments(b, np, "page_table", varlen=varlen)
    assert (args["page_table"] >= 0).all()
    kc, vc = fresh["key_cache"], fresh["value_cache"]
    bs = case.block_size
    if varlen:
        cu = args["cu_seqlens_q"]
        assert args["max_seqlen_q"] == max(case.q_lens) and (args["cu_seqlens_k_new"] == cu).all()
        per_seq = [(args["q"][cu[s]:cu[s + 1]], args["k"][cu[s]:cu[s + 1]], args["v"][cu[s]:cu[s + 1]])
                   for s in range(case.batch_size)]
    else:
        per_seq = [(args["q"][s], args["k"][s], args["v"][s]) for s in range(case.batch_size)]
    left = args["window_size"][0]
    assert args["window_size"][1] in (0, -1) and args["causal"] is True
    out = []
    for s, (q, k_new, v_new) in enumerate(per_seq):
        start = int(args["cache_seqlens"][s])
        for j in range(len(k_new)):
            p = start + j
            blk = args["page_table"][s, p // bs]
            kc[blk, p % bs], vc[blk, p % bs] = k_new[j], v_new[j]
        total = start + len(k_new)
        rows = [(args["page_table"][s, p // bs], p % bs) for p in range(total)]
        k = np.stack([kc[r] for r in rows])
        v = np.stack([vc[r] for r in rows])
        q_pos = total - len(q) + np.arange(len(q))
        out.append(_attend(q, k, v, args["softmax_scale"], q_pos, left + 1 if left >= 0 else -1))
    got = np.concatenate(out).reshape(expected.shape)
    assert rel_err(expected, got) < 1e-5
    for b_, kv in enumerate(b.kv_lens):                          # the appended rows are the ones cupa wrote
        rows = C.cache_positions(b.block_table, int(kv), bs, b_)
        np.testing.assert_array_equal(kc.reshape(-1, *kc.shape[2:])[rows],
                                      b.inputs["key_cache"].reshape(-1, *kc.shape[2:])[rows])


def test_flash_attn2_refuses_small_blocks_and_ragged_queries():
    from cupa.bench.peers.flash_attn import FlashAttn2, FlashAttn3

    with pytest.raises(Unsupported, match="multiple of 256"):
        FlashAttn2().check(C.decode(2, 8, block_size=16))
    with pytest.raises(Unsupported, match="ragged"):
        FlashAttn2().check(C.mixed(2, 9, [(4, 0)], block_size=256))
    FlashAttn3().check(C.mixed(2, 9, [(4, 0)], block_size=16))
    with pytest.raises(Unsupported, match="head_sink"):
        FlashAttn3().check(C.decode(2, 8, sinks=True))


@pytest.mark.parametrize("case", [c for c in PEER_CASES if c.uniform], ids=lambda c: c.id)
def test_torch_sdpa_on_the_dense_cache_matches_cupa(case, rng):
    pytest.importorskip("torch")
    from cupa.bench.peers.sdpa import TorchSdpa

    b = C.build(case, seed=int(rng.integers(1 << 30)))
    expected = _reference(b)
    peer = TorchSdpa(None)
    assert peer.available()[0]
    prepared = peer.prepare(b, NumpyRuntime())
    prepared.fn()
    assert rel_err(expected, prepared.output()) < 1e-5
    if case.past[0] and case.q_lens[0] > 1:
        assert "causal_lower_right" in prepared.note


@pytest.mark.parametrize("case,why", [
    (C.ragged_decode([3, 9], "t", block_size=4, **SMALL), "ragged"),
    (C.decode(2, 8, block_size=4, sinks=True, **SMALL), "head_sink"),
    (C.decode(2, 8, block_size=4, cache="fp8", **{k: v for k, v in SMALL.items() if k != "dtype"}), "quantized"),
    (C.prefill(2, 8, block_size=4, window=4, **SMALL), "window"),
    (C.mla(2, 8, num_heads=2, block_size=4), "LATENT"),
])
def test_torch_sdpa_names_what_it_cannot_run(case, why):
    from cupa.bench.peers.sdpa import TorchSdpa

    with pytest.raises(Unsupported, match=why):
        TorchSdpa(None).check(case)


ORT_CASES = [
    C.decode(2, 24, block_size=4, **{**SMALL, "dtype": "float16"}),
    C.decode(2, 24, block_size=4, cache="fp8", sinks=True, **{**SMALL, "dtype": "bfloat16"}),
    C.decode(2, 24, block_size=4, cache="int8", quant="PER_TENSOR", metadata=False, window=8,
             **{**SMALL, "dtype": "float16"}),
    C.mixed(2, 9, [(4, 0)], block_size=4, **{**SMALL, "dtype": "float16"}),
    C.mla(2, 16, num_heads=2, block_size=4),
]


@pytest.mark.parametrize("case", ORT_CASES, ids=lambda c: c.id)
def test_onnxruntime_model_passes_the_schema(case):
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    from cupa.bench.peers.onnxruntime import binding_plan, build_model

    b = C.build(case)
    model = build_model(b)
    onnx.checker.check_model(model)
    (node,) = model.graph.node
    assert node.domain == "com.microsoft" and node.op_type == "PagedAttention"
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert attrs["num_heads"] == case.num_heads and attrs["kv_num_heads"] == case.kv_num_heads
    assert ("k_cache_dtype" in attrs) == (case.cache not in ("T", "fp8", "int8"))
    present = [n for n, x in b.inputs.items() if x is not None]
    assert [n for n in node.input if n] == present
    plan = {(kind, name): (dev, etype, shape, arr) for kind, name, dev, etype, shape, arr in binding_plan(b)}
    assert plan[("output", "key_cache_out")][3] is b.inputs["key_cache"]
    if not case.latent:
        assert plan[("output", "value_cache_out")][3] is b.inputs["value_cache"]
    assert plan[("output", "output")][2] == (case.token_count, case.num_heads * case.out_head_size)
    if case.metadata:
        assert plan[("input", "attention_metadata")][0] == "cpu"
    if case.cache == "fp8":
        assert plan[("input", "key_cache")][1] == onnx.TensorProto.FLOAT8E4M3FN
    # ONNX Runtime type-checks the node against its schema when it builds the session; only the missing
    # CPU kernel may stop it here.
    with pytest.raises(Exception, match="NOT_IMPLEMENTED"):
        ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def test_flashinfer_refuses_what_it_cannot_express():
    from cupa.bench.peers.flashinfer import FlashInfer

    with pytest.raises(Unsupported, match="per tensor"):
        FlashInfer().check(C.decode(2, 8, cache="fp8"))
    with pytest.raises(Unsupported, match="int8"):
        FlashInfer().check(C.decode(2, 8, cache="int8", quant="PER_TENSOR"))
    FlashInfer().check(C.decode(2, 8, cache="fp8", quant="PER_TENSOR"))
    FlashInfer().check(C.mla(2, 8))


# -- on a device -------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_device_run_records_cupa_and_every_peer(tmp_path):
    out = tmp_path / "gpu.json"
    assert cli.main(["--quick", "--only", "decode:B=8 L=8192,prefill:B=4 q=2048,host", "--reps", "3",
                     "--out", str(out)]) == 0
    payload = json.loads(out.read_text())
    names = {p.name for p in all_peers()}
    assert set(payload["peers"]) == names
    attention = [r for r in payload["cases"] if r["suite"] in ("decode", "prefill")]
    assert attention
    for rec in attention:
        assert rec["cupa"]["status"] == "ok", rec["cupa"]
        applicable = {p.name for p in all_peers() if rec["suite"] in p.suites}
        assert set(rec["peers"]) == applicable
        for name, m in rec["peers"].items():
            assert m["status"] in ("ok", "missing", "unsupported", "error"), (name, m)
            if m["status"] == "ok":
                assert m["agrees"], (rec["id"], name, m)
    assert not payload["mismatches"]


@pytest.mark.gpu
def test_device_general_suite(tmp_path):
    out = tmp_path / "general.json"
    assert cli.main(["--quick", "--only", "general", "--no-peers", "--reps", "3", "--no-plots", "--out", str(out)]) == 0
    payload = json.loads(out.read_text())
    recs = {r["case"].split(" B=")[0]: r for r in payload["cases"] if r["suite"] == "general"}
    assert set(recs) == {"prefill bias", "decode qk_output=2", "latent bias"}
    for name, rec in recs.items():
        # decode-shaped output_qk: the decode backend; a prefill with a bias over a cache of T: the tensor-core prefill
        want = {"decode qk_output=2": "decode", "prefill bias": "prefill"}.get(name, "general")
        assert rec["cupa"]["status"] == "ok" and rec["cupa"]["backend"] == want, rec["cupa"]
        assert all(m["status"] == "ok" for m in rec["variants"].values()), rec["variants"]
    assert recs["decode qk_output=2"]["variants"]["general plain"]["backend"] == "general"
    assert recs["prefill bias"]["variants"]["general no bias"]["backend"] == "general"
    assert recs["prefill bias"]["variants"]["general bias"]["backend"] == "general"
    assert recs["prefill bias"]["variants"]["fused no bias"]["backend"] != "general"
    assert recs["decode qk_output=2"]["floor"]["output_qk_shape"] == [32, 8, 8192]
    for rec in (recs["prefill bias"], recs["decode qk_output=2"]):
        assert rec["target"]["met"] in (True, False)
    assert not payload["mismatches"]


def test_backend_variants_are_recorded():
    """On a device runtime the suites time ``Options(backend=...)`` variants; one that names cupa's own
    choice is "same as default", one that cannot serve the call says why (NumPy arrays stand in for a
    device here: the reference is their only backend)."""

    class DeviceLike(NumpyRuntime):
        on_device = True

    variants = (("reference again", cupa.Options(backend="reference")), ("mma.sync", cupa.Options(backend="prefill")))
    ctx = Context(DeviceLike(), [], reps=1, size="smoke")
    rec = AttentionSuite("prefill", "", variants).run(C.prefill(2, 6, block_size=4, **SMALL), ctx)
    assert rec["variants"]["reference again"] == {"status": "same as default", "backend": "reference"}
    assert rec["variants"]["mma.sync"]["status"] == "not served"
    assert "options.backend" in rec["variants"]["mma.sync"]["reason"]


def test_host_floor_replays_the_calls_launches():
    """The host suite's driver floor (device runs) replays exactly the launches of one decode call: same
    kernels, grids and parameter bytes (checked against the test suite's fake CuPy)."""
    pytest.importorskip("cupy")
    from cupa.bench.steps import _launch_floor
    from tests.test_launch_fastpath import FakeCupy, fake_case, fake_cupy

    fake = FakeCupy(real_arrays=True)
    with fake_cupy(fake):
        x, attrs = fake_case(fake, B=2, L=64)
        names = ("query", "key", "value", "key_cache", "value_cache", "cumulative_sequence_length", "past_seqlens",
                 "block_table")
        args = tuple(x[n] for n in names)
        op = cupa.PagedAttention(**attrs)
        out = fake.empty(x["query"].shape, x["query"].dtype)
        md = np.array([1, 64], dtype=np.int32)
        op(*args, attention_metadata=md, out=out)
        fake.launches.clear()
        op(*args, attention_metadata=md, out=out)
        call = list(fake.launches)
        floor = _launch_floor(op, args, md, out)
        assert floor is not None
        fake.launches.clear()
        floor()
        assert fake.launches == call and len(call) == 2


def test_readme_table_and_peer_list_are_generated_from_the_committed_results():
    """The README's performance table and docs/benchmarks.md's list of the cases where a peer is faster are
    what cupa.bench.report makes of benchmarks/results/bench_h200.json."""
    repo = Path(__file__).resolve().parent.parent
    payload = json.loads((repo / "benchmarks/results/bench_h200.json").read_text())

    def section(path, begin, end):
        text = (repo / path).read_text()
        return text[text.index(begin):text.index(end)].splitlines()[1:]

    assert section("README.md", "<!-- bench table:", "<!-- end bench table -->") == report.readme_table(payload)
    assert (section("docs/benchmarks.md", "<!-- peers faster:", "<!-- end peers faster -->")
            == report.peers_faster_lines(payload))
    assert report.peers_faster(payload), "the committed run has cases where a peer is faster"
    assert all(ratio < 1 for *_, ratio in report.peers_faster(payload))


def test_mla_waves_prints_the_plans_of_a_described_gpu(capsys):
    """benchmarks/mla_waves.py --plans: the split plan of each MLA target for each mla_waves, without a device."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "mla_waves.py"
    spec = importlib.util.spec_from_file_location("mla_waves", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--plans", "9.0", "--waves", "1,2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 * len(module.TARGETS)
    # 16 row tiles: 132 // 16 = 8 splits a tile, whatever the table's capacity beyond the sequence; 16 with two waves
    assert "B=8 L=8192 H=128 waves=1: 8 split(s) a tile, 24 row tiles" in lines[2]  # (16 + one gap a sequence)
    assert "B=8 L=8192 H=128 waves=2: 16 split(s) a tile" in lines[3]
