#!/usr/bin/env bash
# One device call that checks the tree on a GPU machine: tools/device_check.sh [step ...]
# Steps (default: warm suite): warm (compile every specialization into the kernel caches, 16 processes),
# suite (every GPU test), quick (GPU tests not marked slow), fuzz (the 2000-
# configuration differential fuzz), sanitize (compute-sanitizer memcheck on every malformed-input class,
# racecheck and synccheck on the warp-specialized prefill), bench (the benchmark command, quick).
# Logs go to $OUT (or ./device_logs); each step prints a one-line summary last.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
out=${OUT:-device_logs}
mkdir -p "$out"
[ $# -gt 0 ] || set -- warm suite
timeout_opt=$(python3 -c "import pytest_timeout" 2>/dev/null && echo "--timeout=${TEST_TIMEOUT:-240}")
status=0
for step in "$@"; do
  start=$(date +%s)
  case $step in
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
      done
      line=$(grep -h "ERROR SUMMARY" "$out"/memcheck_*.log "$out"/*check_wgmma.log | tr '\n' ' ') ;;
    bench) python3 -m cupa.bench --quick --out "$out/bench_quick.json" > "$out/bench.log" 2>&1; rc=$?
           line=$(tail -n 3 "$out/bench.log" | tr '\n' ' ') ;;
    *) echo "unknown step $step"; rc=2; line="" ;;
  esac
  echo "[$step] rc=$rc $(( $(date +%s) - start )) s: $line"
  [ $rc -eq 0 ] || status=$rc
done
exit $status
