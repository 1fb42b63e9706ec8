#!/usr/bin/env bash
# Builds jax_dnn on a GPU machine and runs, in one go: the GPU test suite,
# compute-sanitizer (memcheck, racecheck) over every kernel, and the
# benchmarks. Logs and JSON go to $OUT (or ./gpu_out). The last lines printed
# are a short summary table.
#
#   bash scripts/gpu_check.sh [quick]      quick: fewer benchmark shapes
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export CMAKE_BUILD_PARALLEL_LEVEL=$(nproc)
mode=${1:-full}

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/gpu.txt"

echo "== build"
t0=$(date +%s)
python3 -m pip install --no-build-isolation --no-deps -q . > "$OUT/build.log" 2>&1 \
  || { tail -40 "$OUT/build.log"; exit 1; }
echo "built in $(( $(date +%s) - t0 )) s"

# Run from tests/ so that `import jax_dnn` finds the installed package, not the source tree.
echo "== GPU tests"
(cd tests && python3 -m pytest -m gpu -q -p no:cacheprovider -x . 2>&1) | tee "$OUT/pytest_gpu.log" | tail -25
summary=$(grep -E "passed|failed" "$OUT/pytest_gpu.log" | tail -1)

echo "== compute-sanitizer"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
san=""
for tool in memcheck racecheck; do
  (cd scripts && compute-sanitizer --tool $tool --error-exitcode 9 python3 sanitize_ops.py) \
    > "$OUT/sanitizer_$tool.log" 2>&1
  rc=$?
  san="$san $tool=rc$rc($(grep -c '=========.*Error\|========= Invalid\|RACE' "$OUT/sanitizer_$tool.log") findings)"
  tail -4 "$OUT/sanitizer_$tool.log"
done
unset XLA_PYTHON_CLIENT_PREALLOCATE

echo "== benchmarks"
bench_args="--json $OUT/bench_ops.json"
[ "$mode" = quick ] && bench_args="$bench_args --quick"
(cd benchmarks && python3 bench_ops.py $bench_args 2>&1) | tee "$OUT/bench.log" | tail -80

echo
echo "== summary"
echo "gpu tests: $summary"
echo "sanitizer:$san"
