#!/usr/bin/env bash
# One device call that checks the tree on a GPU machine: tools/device_check.sh [step ...]
# Steps (default: warm suite): peers (install the wheels of $WHEELS, default .whl, into /tmp/site with the
# machine's python3 and put it on PYTHONPATH: FlashInfer, ONNX Runtime, transformers...), warm (compile
# every specialization into the kernel caches, 16 processes), suite (every GPU test), quick (GPU tests
# not marked slow), fuzz (the 2000-configuration differential fuzz), sanitize (compute-sanitizer
# memcheck on every malformed-input class, racecheck and synccheck on the warp-specialized prefill (malformed
# fuzz draws and its isolation cases), and
# synccheck on tools/synccheck_probe.py's three arrival forms), ab (benchmarks/ab_trees.py on the tree
# $BEFORE_TREE, a directory with its cupa/ and cuda_src/, and on this one, two rounds), profile (ncu
# of one decode call of $PROFILE_CACHE, default int4, B=64 L=4096), bench (the benchmark command, quick),
# cascade (benchmarks/profile_cascade.py --sweep and the cascade suite), codes (the wgmma prefill over 8-bit
# caches and its copiers' clean of T-cache V tiles: their GPU tests, the isolation and non-finite cases,
# memcheck and racecheck on some of them, both prefills and both cleans timed).
# Logs go to $OUT/logs (or ./device_logs) and, after every step, into $OUT/logs.tgz (a call brings back
# only a few files); each step prints a one-line summary last.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
out=${OUT:+$OUT/logs}
out=${out:-device_logs}
mkdir -p "$out"
[ $# -gt 0 ] || set -- warm suite
timeout_opt=$(python3 -c "import pytest_timeout" 2>/dev/null && echo "--timeout=${TEST_TIMEOUT:-240}")
status=0
for step in "$@"; do
  start=$(date +%s)
  case $step in
    peers) python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
             "${WHEELS:-.whl}"/*.whl > "$out/peers.log" 2>&1; rc=$?
           export PYTHONPATH=$PWD:/tmp/site
           python3 -m cupa.bench --list --quick 2>&1 | grep '^peers' >> "$out/peers.log"
           line=$(tail -n 1 "$out/peers.log") ;;
    warm) python3 -m cupa.compile --warm --jobs "${JOBS:-16}" > "$out/warm.log" 2>&1; rc=$?
          line=$(tail -n 1 "$out/warm.log") ;;
    suite) python3 -m pytest -q -m gpu -p no:cacheprovider $timeout_opt ${SUITE_ARGS:-} tests > "$out/suite.log" 2>&1; rc=$?
           line=$(tail -n 1 "$out/suite.log") ;;
    quick) python3 -m pytest -q -m "gpu and not slow" -p no:cacheprovider $timeout_opt ${SUITE_ARGS:-} tests \
             > "$out/quick.log" 2>&1; rc=$?
           line=$(tail -n 1 "$out/quick.log") ;;
    fuzz) python3 -m tests.fuzz --n "${FUZZ_N:-2000}" --out "$out/fuzz.json" > "$out/fuzz.log" 2>&1; rc=$?
          line=$(grep '^summary' "$out/fuzz.log" | tail -n 1) ;;
    sanitize)
      rc=0
      compute-sanitizer --tool memcheck --error-exitcode 99 python3 -m tests.fuzz --malformed --n "${SAN_N:-400}" \
        > "$out/memcheck_fuzz.log" 2>&1 || rc=$?
      compute-sanitizer --tool memcheck --error-exitcode 99 python3 benchmarks/sanitize_undersized_bound.py \
        > "$out/memcheck_bounds.log" 2>&1 || rc=$?
      for tool in racecheck synccheck; do
        compute-sanitizer --tool $tool --error-exitcode 99 python3 -m tests.fuzz --malformed --backend prefill_wgmma \
          --n "${RACE_N:-120}" > "$out/${tool}_wgmma.log" 2>&1 || rc=$?
        # the V tiles the scheduler cleans (v_land): the isolation cases on the wgmma prefill
        compute-sanitizer --tool $tool --error-exitcode 99 python3 -m pytest -q -m gpu -p no:cacheprovider \
          tests/gpu/test_isolation.py -k prefill_wgmma > "$out/${tool}_wgmma_isolation.log" 2>&1 || rc=$?
      done
      for mode in track wait noinc; do
        compute-sanitizer --tool synccheck python3 tools/synccheck_probe.py --mode $mode > "$out/synccheck_probe_$mode.log" 2>&1
      done
      line=$(grep -h "ERROR SUMMARY\|RACECHECK SUMMARY" "$out"/memcheck_*.log "$out"/*check_wgmma*.log "$out"/synccheck_probe_*.log | tr '\n' ' ') ;;
    ab) rc=0
        for round in 1 2; do
          CUPA_CACHE_DIR=/tmp/cache-before PYTHONPATH="$BEFORE_TREE:$PYTHONPATH" python3 benchmarks/ab_trees.py \
            --label before --out "$out/ab_before_$round.json" >> "$out/ab.log" 2>&1 || rc=$?
          python3 benchmarks/ab_trees.py --label now --out "$out/ab_now_$round.json" >> "$out/ab.log" 2>&1 || rc=$?
        done
        line=$(tail -n 4 "$out/ab.log" | tr '\n' ' ') ;;
    profile) ncu --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy \
               --section MemoryWorkloadAnalysis -k regex:paged_decode -c 1 -s 2 python3 -c "
import cupy as cp, cupa
from cupa.bench import cases
b = cases.build(cases.decode(64, 4096, cache='${PROFILE_CACHE:-int4}', quant='PER_CHANNEL'), cp)
op = cupa.PagedAttention(**b.attributes)
[op(**b.call_inputs()) for _ in range(3)]
cp.cuda.Device().synchronize()" > "$out/profile.log" 2>&1; rc=$?
             line=$(grep -m 2 -E "DRAM Throughput|Compute \(SM\) Throughput" "$out/profile.log" | tr -s ' ' | tr '\n' ' ') ;;
    bench) python3 -m cupa.bench --quick --out "$out/bench_quick.json" > "$out/bench.log" 2>&1; rc=$?
           line=$(tail -n 3 "$out/bench.log" | tr '\n' ' ') ;;
    cascade) rc=0
             python3 benchmarks/profile_cascade.py --sweep --splits auto --reps 200 --out "$out/cascade_sweep.json" \
               > "$out/cascade_sweep.log" 2>&1 || rc=$?
             python3 -m cupa.bench --quick --only cascade --reps 30 --no-plots --no-peers \
               --out "$out/bench_cascade.json" > "$out/bench_cascade.log" 2>&1 || rc=$?
             line="$(grep -m 1 'suffix=256 concurrent' "$out/cascade_sweep.log"); $(grep 'cascade/' "$out/bench_cascade.log")" ;;
    codes) rc=0  # the wgmma prefill over 8-bit caches: its tests, isolation, sanitizers, and both prefills timed
           python3 -m pytest -q -m gpu -p no:cacheprovider $timeout_opt tests/gpu/test_prefill_wgmma_codes.py \
             > "$out/codes.log" 2>&1 || rc=$?
           python3 -m pytest -q -m gpu -p no:cacheprovider $timeout_opt tests/gpu/test_isolation.py \
             tests/gpu/test_nonfinite.py -k prefill_wgmma > "$out/codes_isolation.log" 2>&1 || rc=$?
           compute-sanitizer --tool racecheck --error-exitcode 99 python3 -m pytest -q -m gpu -p no:cacheprovider \
             tests/gpu/test_isolation.py -k copier_clean > "$out/codes_racecheck_clean.log" 2>&1 || rc=$?
           compute-sanitizer --tool memcheck --error-exitcode 99 python3 -m pytest -q -m gpu -p no:cacheprovider \
             tests/gpu/test_prefill_wgmma_codes.py -k "nan_codes or block_sizes" > "$out/codes_memcheck.log" 2>&1 || rc=$?
           compute-sanitizer --tool racecheck --error-exitcode 99 python3 -m pytest -q -m gpu -p no:cacheprovider \
             tests/gpu/test_prefill_wgmma_codes.py -k "smoke or many_items" > "$out/codes_racecheck.log" 2>&1 || rc=$?
           python3 benchmarks/ab_trees.py --label codes --cases "(prefill" --reps 20 --out "$out/codes_ab.json" \
             > "$out/codes_ab.log" 2>&1 || rc=$?
           line="$(tail -n 1 "$out/codes.log"); $(tail -n 1 "$out/codes_isolation.log"); $(grep -h "ERROR SUMMARY\|RACECHECK SUMMARY" "$out"/codes_*check*.log | tr '\n' ' ')" ;;
    *) echo "unknown step $step"; rc=2; line="" ;;
  esac
  echo "[$step] rc=$rc $(( $(date +%s) - start )) s: $line" | tee -a "$out/summary.txt"
  [ -z "${OUT:-}" ] || tar czf "$OUT/logs.tgz" -C "$out" .
  [ $rc -eq 0 ] || status=$rc
done
exit $status
