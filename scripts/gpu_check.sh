#!/usr/bin/env bash
# Builds jax_dnn on a GPU machine and runs, in one go: the GPU test suite,
# compute-sanitizer (memcheck, racecheck) over every kernel, and the
# benchmarks. Logs, JSON and plots go to $OUT (or ./gpu_out). The last lines
# printed are a short summary table.
#
#   bash scripts/gpu_check.sh [STAGES]
# STAGES: comma-separated subset of build,tests,opstests,attntests,sharding,
# sanitize,bench,quickbench (default: build,tests,sanitize,bench).
# tests = opstests + attntests; build plus the whole suite runs ~580 s on an
# H100 in one process, close to the device tool's 600 s per call: attntests
# runs test_attention_kernels.py as two processes side by side
# (scripts/gpu_split.sh), and build,opstests then attntests fit two calls.
# sharding runs tests/test_sharding.py alone (its GPU cases need 2 or more
# GPUs: run it on a 2-GPU machine, e.g. `build,sharding`).
# bench runs `python -m jax_dnn.benchmark` over every family (tables in
# bench.log, <family>.json and .png in $OUT/bench); quickbench adds --quick.
# BENCH_FAMILIES (e.g. "norms softmax") limits either to those families, to
# split the full sweep over several calls.
# Stages after build reuse the install. SANITIZE_ONLY (e.g. "conv rows")
# limits the sanitizer stage to those kernel families of
# scripts/sanitize_ops.py; "rnn" there means the recurrence driver below.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export CMAKE_BUILD_PARALLEL_LEVEL=$(nproc)
stages=",${1:-build,tests,sanitize,bench},"
has() { [[ "$stages" == *",$1,"* ]]; }
summary="not run"; san=" not run"

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/gpu.txt"

if has build; then
  echo "== build"
  t0=$(date +%s)
  # The GPU machines have no network: a build requirement they lack (the
  # CUTLASS headers of nvidia-cutlass) installs from the wheels in
  # $JAX_DNN_WHEELS (default ./.wheels, carried beside the tree).
  if ! python3 -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('cutlass_library') is None)"; then
    python3 -m pip install -q --no-deps "${JAX_DNN_WHEELS:-.wheels}"/nvidia_cutlass-*.whl \
      || echo "nvidia-cutlass is not installed: the convolution's implicit-GEMM kernels are not built"
  fi
  python3 -m pip install --no-build-isolation --no-deps -q . > "$OUT/build.log" 2>&1 \
    || { tail -40 "$OUT/build.log"; exit 1; }
  echo "built in $(( $(date +%s) - t0 )) s"
fi

# Run from tests/ so that `import jax_dnn` finds the installed package, not the source tree.
run_tests() {  # $1: log name, rest: test files or directories
  local log="$OUT/$1.log"; shift
  echo "== GPU tests: $*"
  (cd tests && python3 -m pytest -m gpu -q -p no:cacheprovider --maxfail=30 "$@" 2>&1) \
    | tee "$log" | grep -E "^(FAILED|ERROR)|passed|failed" | tail -40
  summary="$summary $(grep -E "passed|failed" "$log" | tail -1);"
}
if has tests || has opstests || has attntests || has sharding; then summary=""; fi
if has tests; then
  run_tests pytest_gpu .
else
  has opstests && run_tests pytest_gpu_ops $(cd tests && ls test_*.py | grep -v attention)
  if has attntests; then
    run_tests pytest_gpu_attention test_attention.py
    # The kernel cases compile for minutes on the host: two processes side by side.
    OUT=$OUT bash scripts/gpu_split.sh test_attention_kernels.py 2 | tee "$OUT/pytest_gpu_attention_kernels.log"
    summary="$summary $(grep -E '^part' "$OUT/pytest_gpu_attention_kernels.log" | tr '\n' ';')"
  fi
  has sharding && run_tests pytest_gpu_sharding -rs test_sharding.py
fi

if has sanitize; then
echo "== compute-sanitizer"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
# XLA's autotuner (it times cuDNN's convolution engines) crashes compute-sanitizer
# at the first XLA convolution; level 0 keeps the autotuner out of the run.
xla_flags=${XLA_FLAGS:-}
export XLA_FLAGS="$xla_flags --xla_gpu_autotune_level=0"
san=""
families=${SANITIZE_ONLY:-attention conv group_norm pool batch_norm rows rnn}
for tool in memcheck racecheck; do
  # racecheck instruments our own kernels only (all in namespace jax_dnn): it
  # segfaults on kernels outside it that XLA runs around ours.
  filter=""; [ $tool = racecheck ] && filter="--kernel-name kns=jax_dnn"
  log="$OUT/sanitizer_$tool.log"; : > "$log"
  # One process a family: a crash of the tool in one leaves the others' summaries.
  for family in $families; do
    [ "$family" = rnn ] && continue
    echo "== $family" >> "$log"
    (cd scripts && compute-sanitizer --tool $tool $filter --error-exitcode 9 python3 sanitize_ops.py "$family") \
      >> "$log" 2>&1
    rc=$?
    san="$san $tool $family: rc=$rc, $(tail -3 "$log" | grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' | sed 's/=* *//');"
  done
  grep -E '^== |SUMMARY' "$log"
done
# The recurrence's kernels from a plain CUDA program (scripts/rnn_driver.cu):
# run through XLA (sanitize_ops.py rnn) the tool exits with a segfault on them.
# Problems: each kind and dtype, ragged and reversed, a 2-chunk batch, the
# streamed weights (H = 2048), two forced variants (state in the workspace) and
# both directions of a layer in one launch.
if [[ " $families " == *" rnn "* ]]; then
  if nvcc -std=c++17 -O3 -arch=sm_90a --expt-relaxed-constexpr -I. -o "$OUT/rnn_driver" \
      scripts/rnn_driver.cu ffi/rnn/rnn_fwd.cu ffi/rnn/rnn_bwd.cu ffi/rnn/rnn_plan.cc \
      > "$OUT/rnn_driver_build.log" 2>&1; then
    rnn_problems=("lstm bf16 20 5 33 --ragged" "gru f32 10 17 100 --ragged --reverse"
                  "rnn_tanh f16 10 3 64" "rnn_relu bf16 8 4 24 --ragged" "lstm bf16 6 16 2048"
                  "lstm bf16 4 130 64 --ragged" "gru bf16 6 9 40 --ragged --variant 5"
                  "lstm f32 6 9 40 --variant 10" "lstm bf16 12 5 33 --ragged --bidirectional"
                  "gru f32 8 17 100 --ragged --bidirectional")
    for tool in memcheck racecheck; do
      log="$OUT/sanitizer_rnn_$tool.log"; : > "$log"; rc=0
      for args in "${rnn_problems[@]}"; do
        # shellcheck disable=SC2086  # args are words
        compute-sanitizer --tool $tool --error-exitcode 9 "$OUT/rnn_driver" $args >> "$log" 2>&1 \
          || rc=$?
      done
      clean=$(grep -cE 'ERROR SUMMARY: 0 errors|RACECHECK SUMMARY: 0 hazards' "$log")
      san="$san rnn $tool: rc=$rc, $clean/${#rnn_problems[@]} clean;"
    done
  else
    san="$san rnn driver: not built ($OUT/rnn_driver_build.log);"
  fi
fi
unset XLA_PYTHON_CLIENT_PREALLOCATE
export XLA_FLAGS="$xla_flags"
fi

bench="not run"
if has bench || has quickbench; then
  echo "== benchmarks"
  bench_args="--out $OUT/bench"
  has quickbench && bench_args="$bench_args --quick"
  # From tests/, like the tests: the installed package (with its kernels), not the source tree.
  # The models family runs this checkout's examples/ (never found from the cwd).
  (cd tests && JAX_DNN_EXAMPLES=${JAX_DNN_EXAMPLES:-$PWD/../examples} \
     python3 -m jax_dnn.benchmark ${BENCH_FAMILIES:-} $bench_args 2>&1) \
    | tee "$OUT/bench.log" | tail -150
  bench="rc=${PIPESTATUS[0]}, $OUT/bench"
fi

echo
echo "== summary"
echo "gpu tests: $summary"
echo "sanitizer:$san"
echo "benchmarks: $bench"
