"""cupa.jit without a GPU: header inlining, NVRTC offline compiles, and ``python -m cupa.compile``.

NVRTC comes from pip (nvidia-cuda-nvrtc) and works without a device; the smoke kernels live in
tests/data/jit_smoke.cu. The full registry check runs when cupa.kernels.registry exists.
"""

import io
import os
import re
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from cupa import compile as cupa_compile
from cupa import jit

REPO = Path(__file__).resolve().parents[1]
DATA = Path(__file__).resolve().parent / "data"
QUOTED_INCLUDE = re.compile(r'^\s*#\s*include\s*"', re.MULTILINE)


def nvrtc_or_skip():
    try:
        return jit.nvrtc_version()
    except Exception as exc:  # no CuPy or no libnvrtc: the offline check cannot run at all
        pytest.skip(f"NVRTC is not loadable here ({exc}); pip install nvidia-cuda-nvrtc cupy-cuda13x")


def smoke(name_expression, options=()):
    """A smoke specialization with a fresh nonce: where a driver is installed, NVRTC would answer a
    repeated compile from the CUDA compute cache, and ptxas would print no statistics."""
    nonce = f"-DJIT_SMOKE_NONCE={secrets.randbits(31)}"
    return jit.Specialization("jit_smoke", name_expression, tuple(options) + (nonce,))


# -- source_text --------------------------------------------------------------------------------------

def write(d: Path, files: dict) -> Path:
    for name, text in files.items():
        (d / name).write_text(text)
    return d


def test_source_text_inlines_our_headers_once_and_keeps_system_includes(tmp_path):
    write(tmp_path, {
        "leaf.cuh": "#pragma once\n#include <cuda_fp16.h>\nconstexpr int LEAF_MARK = 7;\n",
        "mid.cuh": '#pragma once\n#include "leaf.cuh"\nconstexpr int MID_MARK = LEAF_MARK + 1;\n',
        "fam.cu": '// family\n#include "mid.cuh"\n#include "leaf.cuh"\n#include <cuda_bf16.h>\n'
                  "__global__ void k(int* p) { *p = MID_MARK; }\n",
    })
    text = jit.source_text("fam.cu", tmp_path)
    assert not QUOTED_INCLUDE.search(text), text
    assert text.count("constexpr int LEAF_MARK = 7;") == 1, text
    assert text.count("constexpr int MID_MARK") == 1
    assert text.index("LEAF_MARK = 7") < text.index("MID_MARK = LEAF_MARK"), "headers must precede their users"
    assert "#include <cuda_fp16.h>" in text and "#include <cuda_bf16.h>" in text
    assert "pragma once" not in text
    # #line directives bring NVRTC messages back to the original files and lines
    assert '#line 1 "leaf.cuh"' in text and '#line 1 "mid.cuh"' in text
    assert '#line 3 "fam.cu"' in text  # after the include on line 2
    # an edit of a header changes the code string CuPy hashes
    (tmp_path / "leaf.cuh").write_text("#pragma once\nconstexpr int LEAF_MARK = 8;\n")
    assert jit.source_text("fam.cu", tmp_path) != text


def test_source_text_reports_missing_and_circular_headers(tmp_path):
    write(tmp_path, {"a.cu": '#include "nope.cuh"\n'})
    with pytest.raises(FileNotFoundError, match=r'a\.cu:1: #include "nope\.cuh" not found'):
        jit.source_text("a.cu", tmp_path)
    write(tmp_path, {"x.cuh": '#include "y.cuh"\n', "y.cuh": '#include "x.cuh"\n', "b.cu": '#include "x.cuh"\n'})
    with pytest.raises(ValueError, match="circular"):
        jit.source_text("b.cu", tmp_path)
    with pytest.raises(FileNotFoundError, match="missing.cu"):
        jit.source_text("missing.cu", tmp_path)


def test_source_dir_is_the_checkouts_cuda_src():
    assert jit.SOURCE_DIR == REPO / "cuda_src"


@pytest.mark.parametrize("family", sorted(p.name for p in (REPO / "cuda_src").glob("*.cu")) or ["(none)"])
def test_every_kernel_family_inlines_completely(family):
    if family == "(none)":
        pytest.skip("cuda_src has no .cu file yet")
    text = jit.source_text(family)
    assert not QUOTED_INCLUDE.search(text), f"{family}: a quoted include survived inlining"


# -- Specialization, errors, ptxas parsing ------------------------------------------------------------

def test_specialization_is_a_hashable_value_and_rejects_arch_options():
    a = jit.Specialization("decode", "paged_decode<__half, 128>", ["-DX=1"])
    assert a.options == ("-DX=1",) and a == jit.Specialization("decode", "paged_decode<__half, 128>", ("-DX=1",))
    assert len({a, jit.Specialization("decode", "paged_decode<__half, 128>", ("-DX=1",))}) == 1
    assert a.filename == "decode.cu"
    with pytest.raises(ValueError, match="architecture"):
        jit.Specialization("decode", "k", ("-arch=sm_90a",))
    with pytest.raises(ValueError, match="family"):
        jit.Specialization("decode.cu", "k")


def test_kernel_compile_error_carries_log_and_name_expression():
    spec = jit.Specialization("jit_smoke", "smoke_scale<int, 3>")
    err = jit.KernelCompileError(spec, "jit_smoke.cu(9): error: boom")
    assert isinstance(err, RuntimeError)
    assert err.name_expression == "smoke_scale<int, 3>" and "boom" in err.log
    assert "smoke_scale<int, 3>" in str(err) and "boom" in str(err)


def test_parse_ptxas_log_picks_each_entry():
    text = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_Z1aPf' for 'sm_90'
ptxas info    : Function properties for _Z1aPf
ptxas         .     8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 40 registers, used 1 barriers, 1024 bytes smem, 400 bytes cmem[0]
ptxas info    : Compiling entry function '_Z1bPf' for 'sm_90'
ptxas info    : Function properties for _Z1bPf
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 16 registers, used 0 barriers
"""
    stats = jit.parse_ptxas_log(text)
    assert stats["_Z1aPf"] == dict(registers=40, spill_store_bytes=4, spill_load_bytes=12, stack_bytes=8,
                                   shared_bytes=1024)
    assert stats["_Z1bPf"]["registers"] == 16 and stats["_Z1bPf"]["shared_bytes"] == 0


# -- offline compiles ---------------------------------------------------------------------------------

def test_cuda_headers_are_found():
    dirs = jit.cuda_include_dirs()
    assert os.path.isfile(os.path.join(dirs[0], "cuda_fp16.h")), dirs


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("ctype,block", [("__half", 128), ("__nv_bfloat16", 256), ("float", 64)])
def test_smoke_kernel_compiles_offline(arch, ctype, block):
    nvrtc_or_skip()
    spec = smoke(f"smoke_scale<{ctype}, {block}>")
    r = jit.compile_offline(spec, arch, source_dir=DATA)
    assert r.ok and r.has_stats, r.log
    assert r.arch == arch and r.spec == spec
    assert 0 < r.registers <= 255
    assert r.shared_bytes == 4 * block  # the kernel's static float tile[BLOCK]
    assert (r.spill_store_bytes, r.spill_load_bytes) == (0, 0) and not r.spills
    assert r.lowered_name.startswith("_Z11smoke_scale")
    assert f"for '{arch}'" in r.log
    assert r.seconds > 0 and r.cubin is None
    assert "regs" in r.summary() and arch in r.summary()


def test_sm_90a_cubin_for_the_hopper_route():
    nvrtc_or_skip()
    r = jit.compile_offline(smoke("smoke_scale<__half, 128>"), "sm_90a", keep_cubin=True, source_dir=DATA)
    assert r.ok, r.log
    assert "for 'sm_90a'" in r.log
    assert r.cubin[:4] == b"\x7fELF"


def test_spills_are_reported():
    nvrtc_or_skip()
    r = jit.compile_offline(smoke("smoke_pressure<32>", ("-maxrregcount=16",)), "sm_90", source_dir=DATA)
    assert r.ok, r.log
    assert r.spills and r.spill_store_bytes > 0 and r.spill_load_bytes > 0
    free = jit.compile_offline(smoke("smoke_pressure<32>"), "sm_90", source_dir=DATA)
    assert free.ok and free.has_stats and not free.spills and free.registers > r.registers


def test_broken_kernel_gives_the_nvrtc_log(tmp_path):
    nvrtc_or_skip()
    write(tmp_path, {"broken.cu": '#include "ok.cuh"\ntemplate <int N> __global__ void broken(float* p) {\n'
                                  "  p[0] = N + undeclared_name;\n}\n",
                     "ok.cuh": "#pragma once\nconstexpr int OK = 1;\n"})
    r = jit.compile_offline(jit.Specialization("broken", "broken<3>"), "sm_90", source_dir=tmp_path)
    assert not r.ok
    assert "undeclared_name" in r.log and "error" in r.log
    assert re.search(r"broken\.cu\(3\)", r.log), r.log  # the #line directives keep the original line
    assert r.registers == -1


def test_compile_without_ptxas_statistics_is_ok_but_says_so(monkeypatch):
    nvrtc_or_skip()
    monkeypatch.setattr(jit, "parse_ptxas_log", lambda text: {})  # what a compute-cache hit looks like
    r = jit.compile_offline(smoke("smoke_scale<float, 64>"), "sm_90", keep_cubin=True, source_dir=DATA)
    assert r.ok and not r.has_stats and r.registers == -1 and r.cubin
    assert "CUDA_CACHE_DISABLE" in r.log and "no ptxas statistics" in r.summary()


def test_bad_name_expression_fails_cleanly():
    nvrtc_or_skip()
    r = jit.compile_offline(smoke("smoke_scale<__half>"), "sm_90", source_dir=DATA)  # missing BLOCK
    assert not r.ok and r.log


def test_bad_arch_is_rejected():
    with pytest.raises(ValueError, match="arch"):
        jit.compile_offline(smoke("smoke_scale<__half, 128>"), "compute_90", source_dir=DATA)


# -- python -m cupa.compile ---------------------------------------------------------------------------

def run_main(monkeypatch, specs, argv):
    monkeypatch.setattr(jit, "SOURCE_DIR", DATA)
    monkeypatch.setattr(cupa_compile, "registry_specializations", lambda: list(specs))
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    code = cupa_compile.main(argv)
    return code, out.getvalue()


def test_compile_check_lines_summary_and_spill_warning(monkeypatch):
    nvrtc_or_skip()
    specs = [smoke("smoke_scale<__half, 128>"), smoke("smoke_pressure<32>", ("-maxrregcount=16",))]
    code, out = run_main(monkeypatch, specs, ["--check", "--arch", "sm_80,sm_90", "--jobs", "2"])
    assert code == 0, out
    lines = out.splitlines()
    assert sum(line.startswith("ok ") for line in lines) == 4, out
    assert any(line.startswith("WARNING:") and "smoke_pressure<32>" in line for line in lines), out
    assert "summary: 4/4 compiled, 0 failed" in out


def test_compile_check_exits_nonzero_on_failure(monkeypatch):
    nvrtc_or_skip()
    specs = [smoke("smoke_scale<__half, 128>"), smoke("smoke_scale<__half>")]
    code, out = run_main(monkeypatch, specs, ["--check", "--arch", "sm_90", "--jobs", "2"])
    assert code == 1, out
    assert "FAIL" in out and "FAILED: jit_smoke:smoke_scale<__half>" in out
    assert "summary: 1/2 compiled, 1 failed" in out


def test_compile_list(monkeypatch):
    code, out = run_main(monkeypatch, [smoke("smoke_scale<float, 64>")], ["--list"])
    assert code == 0 and "smoke_scale<float, 64>" in out and "1 specializations" in out


def test_every_registered_specialization_compiles_for_sm_90():
    nvrtc_or_skip()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-m", "cupa.compile", "--check", "--arch", "sm_90"],
                          capture_output=True, text=True, timeout=1500, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-4000:]
    assert "summary:" in proc.stdout and " 0 failed" in proc.stdout, proc.stdout[-4000:]


def test_decode_trace_instrumentation_applies_and_compiles(tmp_path):
    """benchmarks/trace_decode.py probes decode_mma.cu at fixed anchors: they are all there once, and
    the instrumented kernel compiles (so a kernel edit that moves an anchor fails here, not on the GPU)."""
    import sys

    nvrtc_or_skip()
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import trace_decode
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    from cupa.kernels import registry

    src = trace_decode.instrumented_sources(str(tmp_path))
    text = (Path(src) / "decode_mma.cu").read_text()
    for i in range(len(trace_decode.EVENTS)):   # every event probed (the key-loop ones once per loop variant)
        assert f"cupa_trace_event({i});" in text
    for cache, keys_as_m in (("T", False), ("int8", True)):
        spec = registry.decode_mma_spec("float16", cache, 128, 3, keys_as_m=keys_as_m)
        result = jit.compile_offline(spec, "sm_90", source_dir=src)
        assert result.ok, result.log


def test_trace_common_swaps_the_sources_and_records_modules_for_the_block_only(tmp_path):
    """benchmarks/trace_common.instrumented: inside the block the library compiles from the instrumented
    copy and every RawModule is recorded; afterwards jit.SOURCE_DIR and RawModule are the library's again
    and the copy is gone. trace_buffer takes the newest module with the buffer, None when none has it."""
    import sys
    from types import SimpleNamespace

    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import trace_common
    finally:
        sys.path.remove(str(REPO / "benchmarks"))

    class Module:
        def __init__(self, *a, has=False, **k):
            self.has = has

        def get_global(self, name):
            if not self.has:
                raise KeyError(name)
            return name

    filled = []

    class Array:
        def __init__(self, shape, dtype, ptr):
            self.args = (shape, ptr)

        def fill(self, v):
            filled.append(v)

    cp = SimpleNamespace(RawModule=Module, ndarray=Array, uint64="u8")
    before = jit.SOURCE_DIR
    made = []

    def instrument(tmp):
        made.append(Path(tmp))
        (Path(tmp) / "cuda_src").mkdir()
        return str(Path(tmp) / "cuda_src")

    with trace_common.instrumented(cp, instrument) as modules:
        assert jit.SOURCE_DIR == made[0] / "cuda_src"
        cp.RawModule(has=True)
        cp.RawModule()
        assert len(modules) == 2
        assert trace_common.trace_buffer(cp, modules, "t", 8).args == ((8,), "t") and filled == [0]
        assert trace_common.trace_buffer(cp, modules[1:], "t", 8) is None
    assert jit.SOURCE_DIR == before and cp.RawModule is Module and not made[0].exists()


def _trace_prefill_ws():
    import sys

    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import trace_prefill_ws
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    return trace_prefill_ws


def test_prefill_ws_trace_instrumentation_applies_and_compiles(tmp_path):
    """benchmarks/trace_prefill_ws.py probes prefill_wgmma_ws.cu at fixed anchors: each is there once, and
    the instrumented kernel compiles for sm_90a without spills (a kernel edit that moves an anchor fails
    here, not on the GPU)."""
    nvrtc_or_skip()
    tr = _trace_prefill_ws()
    from cupa.kernels import registry

    src = tr.instrumented_sources(str(tmp_path))
    text = (Path(src) / "prefill_wgmma_ws.cu").read_text()
    for i in range(len(tr.EVENTS)):
        assert text.count(f"cupa_ws_event(n, {i}") == 1, i
    for dtype in ("float16", "bfloat16"):
        result = jit.compile_offline(registry.prefill_wgmma_ws_spec(dtype), "sm_90a", source_dir=src)
        assert result.ok, result.log
        if result.has_stats:
            assert not result.spills, result.summary()


def test_prefill_ws_trace_summary_splits_items_into_phases():
    """trace_prefill_ws.summarize: per item the wait for its Q (from the CTA's entry, then from the previous
    item's epilogue), its first turn, the time per further tile, its last turn and its epilogue; items
    without every event (no key tiles) and rows without an entry are left out."""
    import numpy as np

    tr = _trace_prefill_ws()
    t = np.zeros((3, tr.SLOTS), dtype=np.int64)

    def item(c, n, ready, turn0, softmax0, loop_end, last, stored, ntiles):
        t[c, 1 + n * 8: 1 + n * 8 + 8] = [ready, turn0, softmax0, loop_end, last, stored, 0, ntiles]

    t[0, 0] = 1000
    item(0, 0, 3000, 3100, 3600, 9600, 10000, 11000, 4)   # ready 2000, turn0 500, 3 tiles of 2000, last 400, epi 1000
    item(0, 1, 11200, 11300, 11800, 11800, 12200, 13200, 1)  # ready 200, one tile: no per-tile time
    item(0, 2, 13300, 0, 0, 0, 0, 14000, 0)               # no key tiles: left out
    t[1, 0] = 2000
    item(1, 0, 2500, 2600, 3100, 5100, 5500, 6500, 2)
    res = tr.summarize(t)
    assert res["ctas"] == 2 and res["items"] == 3 and res["tiles"] == 7
    assert res["ready_ns_mean"] == round((2000 + 200 + 500) / 3, 1)
    assert res["turn0_ns_mean"] == 500.0 and res["last_ns_mean"] == 400.0 and res["epilogue_ns_mean"] == 1000.0
    assert res["tile_ns_mean"] == 2000.0  # (6000 / 3 and 2000 / 1)
    span = 2700 + 1500 + (6000 + 0 + 2000) + 1200 + 3000
    assert res["tile_share"] == round(8000 / span, 4)
    assert res["entry_us"] == [0.0, 0.1, 0.5, 0.9, 1.0]
    assert res["end_us"][0] == 5.5 and res["end_us"][-1] == 12.2


def test_decode_trace_summary_groups_ctas_by_their_sms_load():
    """trace_decode.summarize: event quantiles after the first entry, and loop times / exits of the CTAs
    grouped by how many CTAs their SM ran (a row without an entry -- a CTA index never launched -- is
    ignored)."""
    import sys

    import numpy as np

    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import trace_decode
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    us = 1000
    rows = [  # entry, waited, first tile, loop end, stored, exit, -, SM
        [1 * us, 2 * us, 3 * us, 13 * us, 14 * us, 15 * us, 0, 0],
        [1 * us, 2 * us, 3 * us, 23 * us, 24 * us, 25 * us, 0, 0],
        [2 * us, 3 * us, 4 * us, 8 * us, 9 * us, 10 * us, 0, 1],
        [0, 0, 0, 0, 0, 0, 0, 0],
    ]
    res = trace_decode.summarize(np.array(rows, dtype=np.int64))
    assert res["ctas"] == 3
    assert res["entry_us"] == [0.0, 0.0, 0.0, 0.8, 1.0]
    assert res["sms_with_n_ctas"] == [0, 1, 1]  # one SM ran 1 CTA, one ran 2
    assert res["loop_us_on_sms_with_2"] == [10.0, 11.0, 15.0, 19.0, 20.0]
    assert res["loop_us_on_sms_with_1"] == [4.0] * 5
    assert res["exit_us_on_sms_with_1"] == [9.0] * 5
    assert res["exit_us_on_sms_with_2"][-1] == 24.0
    assert res["sm_finish_us"] == [9.0, 10.5, 16.5, 22.5, 24.0]
    rows = np.array(rows, dtype=np.int64)
    rows[:, 4:6] = 0  # no CTA reached its stores (a kernel returning before the probe): no quantiles
    assert trace_decode.summarize(rows)["merge_us"] == []


def test_cubins_are_whole_elf_images():
    """CuPy's nvrtc.getCUBIN drops the image's last byte; jit.whole_elf restores the size the ELF headers
    declare (cuobjdump refuses the short image; the disk cache keeps the whole one)."""
    import struct

    nvrtc_or_skip()
    from cupy_backends.cuda.libs import nvrtc

    prog = nvrtc.createProgram('extern "C" __global__ void k(float* x) { x[threadIdx.x] += 1.0f; }', "k.cu", [], [])
    try:
        nvrtc.compileProgram(prog, ["-arch=sm_90a"])
        raw = bytes(nvrtc.getCUBIN(prog))
    finally:
        nvrtc.destroyProgram(prog)
    whole = jit.whole_elf(raw)
    phoff, shoff = struct.unpack_from("<QQ", whole, 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", whole, 0x36)
    assert len(whole) >= max(phoff + phentsize * phnum, shoff + shentsize * shnum)
    assert whole[:len(raw)] == raw and set(whole[len(raw):]) <= {0}
    assert jit.whole_elf(whole) == whole
    assert jit.whole_elf(b"not an ELF image") == b"not an ELF image"
