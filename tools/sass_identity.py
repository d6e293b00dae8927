"""Compare the SASS of every registered specialization between two trees of cupa (no GPU needed).

    python tools/sass_identity.py --before REV [--after REV] [--arch sm_80,sm_90] \
        [--map 'AFTER_REGEX=>BEFORE_TEMPLATE' ...] [--kept] [--jobs N] [--json out.json]

Each tree (a git revision exported with ``git archive``; ``--after`` defaults to the working tree)
lists its specializations with its own ``cupa.kernels.registry``, and each specialization is
compiled from that tree's ``cuda_src`` by NVRTC to a cubin (``cupa.jit.compile_offline``, the same
options on both sides) for every architecture (a specialization pinned to an arch-specific target,
``sm_90a``, for that target only, as ``python -m cupa.compile`` does). ``cuobjdump -sass`` then
disassembles each kernel; the function names and the header lines are dropped and the instructions,
with their encodings, are compared, together with ptxas's statistics (registers, spills, static
shared memory, stack).

An *after* specialization is paired with the *before* one whose text (``str(Specialization)``:
``family:name_expression [options] @arch``) it maps to: the first ``--map`` rule whose regular
expression matches the whole text gives the before text (``re.fullmatch(...).expand(template)``);
with no matching rule, the same text. For example, a ``-D`` switch turned into a template parameter::

    --map 'decode_mma:paged_decode_mma<(.*), 3, true>=>decode_mma:paged_decode_mma<\\1> [-DCUPA_MMA8_T=1]'

``--kept`` leaves out the after specializations without a before counterpart (a change that adds
kernels: only the kept ones are compiled and compared). Prints one line per (pair, arch):
``identical``, ``DIFFERENT`` (with the first differing instructions), ``new`` (no before
counterpart: compiled and reported, not compared) or ``removed``; then a summary. The exit status is 1 when a pair differs or fails to compile, else 0.

cuobjdump comes from ``--cuobjdump``, ``PATH``, or the ``nvidia-cuda-cuobjdump`` pip package
(``nvidia/cu13/bin/cuobjdump``; it runs nvdisasm, from ``nvidia-cuda-nvdisasm``, found beside it or on
``PATH``). Both are tools for this script, not dependencies of cupa.
"""

from __future__ import annotations

import argparse
import difflib
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from cupa import jit  # noqa: E402
from cupa.compile import compile_tasks  # noqa: E402

_LIST_SPECS = (
    "import json\n"
    "from cupa.kernels import registry\n"
    "print(json.dumps([[s.family, s.name_expression, list(s.options), s.arch]"
    " for s in registry.all_specializations()]))\n")


def export_tree(rev: str, dest: Path) -> Path:
    """The files of ``cupa/`` and ``cuda_src/`` at git revision ``rev``, under ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    data = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", rev, "cupa", "cuda_src"],
                          check=True, capture_output=True).stdout
    archive = dest / "tree.tar"
    archive.write_bytes(data)
    with tarfile.open(archive) as tar:
        tar.extractall(dest)
    archive.unlink()
    return dest


def tree_specs(tree: Path) -> list:
    """The specializations ``tree``'s own registry lists (in a subprocess importing that tree's cupa)."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    out = subprocess.run([sys.executable, "-c", _LIST_SPECS], check=True, capture_output=True, text=True,
                         env=env, cwd=str(tree)).stdout
    return [jit.Specialization(f, n, tuple(o), a) for f, n, o, a in json.loads(out)]


def find_cuobjdump(given: str = "") -> str:
    if given:
        return given
    found = shutil.which("cuobjdump")
    if found:
        return found
    for site_dir in jit._site_dirs():
        for path in sorted(glob.glob(os.path.join(site_dir, "nvidia", "cu*", "bin", "cuobjdump")), reverse=True):
            return path
    raise SystemExit("sass_identity: no cuobjdump (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm, or pass --cuobjdump PATH)")


_FUNCTION = re.compile(r"^\s*Function : (\S+)")
_ENCODING_ONLY = re.compile(r"^\s*/\* 0x[0-9a-f]+ \*/\s*$")


def sass_of(cuobjdump: str, cubin: bytes, workdir: Path, name: str) -> list:
    """The instructions of kernel ``name`` in ``cubin`` (one string per instruction, encodings kept)."""
    fd, path = tempfile.mkstemp(suffix=".cubin", dir=workdir)
    with os.fdopen(fd, "wb") as f:
        f.write(jit.whole_elf(cubin))
    path = Path(path)
    # cuobjdump runs nvdisasm, which the pip packages install beside it
    env = dict(os.environ, PATH=os.pathsep.join([str(Path(cuobjdump).parent), os.environ.get("PATH", "")]))
    text = subprocess.run([cuobjdump, "-sass", str(path)], check=True, capture_output=True, text=True,
                          env=env).stdout
    path.unlink()
    out, inside = [], False
    for line in text.splitlines():
        m = _FUNCTION.match(line)
        if m:
            inside = m.group(1) == name
            continue
        if not inside or not line.strip() or line.strip().startswith((".", "code for", "Fatbin", "=====")):
            continue
        if _ENCODING_ONLY.match(line) and out:
            out[-1] += " " + line.strip()  # the second half of the instruction's encoding
            continue
        out.append(" ".join(line.split()))
    if not out:
        raise RuntimeError(f"sass_identity: no SASS for {name} in the cuobjdump output")
    return out


def compile_sass(spec, arch: str, tree: Path, cuobjdump: str, workdir: Path) -> dict:
    r = jit.compile_offline(spec, arch, keep_cubin=True, source_dir=tree / "cuda_src")
    if not r.ok:
        return {"ok": False, "log": r.log}
    return {"ok": True, "sass": sass_of(cuobjdump, r.cubin, workdir, r.lowered_name),
            "stats": (r.registers, r.spill_store_bytes, r.spill_load_bytes, r.shared_bytes, r.stack_bytes)}


def parse_map(rules: list) -> list:
    out = []
    for rule in rules:
        if "=>" not in rule:
            raise SystemExit(f"--map: got {rule!r}; expected AFTER_REGEX=>BEFORE_TEMPLATE")
        pattern, template = rule.split("=>", 1)
        out.append((re.compile(pattern), template))
    return out


def before_text(after: str, rules: list) -> str:
    for pattern, template in rules:
        m = pattern.fullmatch(after)
        if m:
            return m.expand(template)
    return after


def stats_text(st) -> str:
    regs, ss, sl, smem, stack = st
    return f"regs {regs} spill {ss}/{sl} smem {smem} stack {stack}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="tools/sass_identity.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True, help="git revision of the tree before the change")
    ap.add_argument("--after", default="", help="git revision after (default: the working tree)")
    ap.add_argument("--arch", default="sm_80,sm_90", help="architectures (default %(default)s)")
    ap.add_argument("--map", action="append", default=[], help="AFTER_REGEX=>BEFORE_TEMPLATE (repeatable)")
    ap.add_argument("--filter", default="", help="only after specializations whose text contains this")
    ap.add_argument("--kept", action="store_true",
                    help="only after specializations with a before counterpart (new ones are not compiled)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--cuobjdump", default="")
    ap.add_argument("--json", default="", help="write the results here")
    args = ap.parse_args(argv)
    os.environ.setdefault("CUDA_CACHE_DISABLE", "1")
    cuobjdump = find_cuobjdump(args.cuobjdump)
    rules = parse_map(args.map)
    archs = [a.strip() for a in args.arch.split(",") if a.strip()]

    with tempfile.TemporaryDirectory(prefix="sass_identity_") as tmp:
        tmp = Path(tmp)
        before_tree = export_tree(args.before, tmp / "before")
        after_tree = export_tree(args.after, tmp / "after") if args.after else REPO
        before = {str(s): s for s in tree_specs(before_tree)}
        after = {str(s): s for s in tree_specs(after_tree) if args.filter in str(s)}
        pairs = [(a, before_text(a, rules)) for a in after]
        if args.kept:
            pairs = [(a, b) for a, b in pairs if b in before]
        paired = {b for _, b in pairs if b in before}
        removed = [b for b in before if b not in paired and not args.filter]

        jobs = []  # (side, text, spec, arch)
        for a, b in pairs:
            for spec, arch in compile_tasks([after[a]], archs):
                jobs.append(("after", a, spec, arch))
                if b in before:
                    jobs.append(("before", b, before[b], arch))
        work = tmp / "cubins"
        work.mkdir()
        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            futures = {(side, text, arch): pool.submit(compile_sass, spec, arch,
                                                      after_tree if side == "after" else before_tree,
                                                      cuobjdump, work)
                       for side, text, spec, arch in jobs}
            results = {k: f.result() for k, f in futures.items()}

    rows, failed = [], 0
    counts = {"identical": 0, "DIFFERENT": 0, "new": 0, "FAILED": 0}
    for a, b in pairs:
        for _, arch in compile_tasks([after[a]], archs):
            ra = results[("after", a, arch)]
            rb = results.get(("before", b, arch))
            row = {"after": a, "before": b if rb else "", "arch": arch}
            if not ra["ok"] or (rb is not None and not rb["ok"]):
                row["status"] = "FAILED"
                row["detail"] = (ra if not ra["ok"] else rb)["log"][-2000:]
            elif rb is None:
                row["status"] = "new"
                row["detail"] = stats_text(ra["stats"])
            elif ra["sass"] == rb["sass"] and ra["stats"] == rb["stats"]:
                row["status"] = "identical"
                row["detail"] = f"{len(ra['sass'])} instructions, " + stats_text(ra["stats"])
            else:
                row["status"] = "DIFFERENT"
                diff = list(difflib.unified_diff(rb["sass"], ra["sass"], "before", "after", n=0, lineterm=""))
                row["detail"] = (f"{len(rb['sass'])} -> {len(ra['sass'])} instructions; "
                                 f"{stats_text(rb['stats'])} -> {stats_text(ra['stats'])}\n      "
                                 + "\n      ".join(diff[2:14]))
            counts[row["status"]] += 1
            failed += row["status"] in ("DIFFERENT", "FAILED")
            rows.append(row)
            pair = a if row["before"] in ("", a) else f"{a}  <-  {b}"
            print(f"{row['status']:<9} {arch:<7} {pair}\n          {row['detail']}", flush=True)
    for b in removed:
        print(f"removed   {b}")
    print(f"summary: {counts['identical']} identical, {counts['DIFFERENT']} different, {counts['new']} new, "
          f"{counts['FAILED']} failed (kernel x arch); {len(removed)} before-specializations removed")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "removed": removed}, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
