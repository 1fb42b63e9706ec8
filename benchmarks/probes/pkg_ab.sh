#!/usr/bin/env bash
# A/B of whole builds of jax_dnn through the benchmark CLI: each revision is
# installed in turn on the GPU machine and benchmarked beside XLA and cuDNN,
# so that the ratios of two revisions come from one machine and one clock
# regime: what a user gets, the backward included.
#
# Two steps, for a GPU machine that gets the working tree but not the local
# commits (its .git may be older):
#   here:  bash benchmarks/probes/pkg_ab.sh prepare main next/bwd-mask-intervals main
#   there: BENCH="attention --quick" bash benchmarks/probes/pkg_ab.sh run
# prepare writes the sources a build needs of each revision ("." is the
# working tree) to ab_pkg/<n>_<revision>/ (untracked: it travels; never
# commit it). A revision named twice is benchmarked twice: the spread
# between its runs is the noise to beat. run builds and benchmarks them in
# order (~75 s a build on 16 cores; seconds for a tree built before on the
# same machine); the last one stays installed. BENCH: the arguments of
# `python -m jax_dnn.benchmark` (families, --quick). JSON and plots to
# $OUT/bench_<n>_<revision>/ (OUT defaults to ./gpu_out); the tables print per tree.
set -uo pipefail
cd "$(dirname "$0")/../.."
SOURCES="ffi jax_dnn CMakeLists.txt pyproject.toml README.md"
case "${1:-}" in
  prepare)
    shift
    rm -rf ab_pkg && mkdir ab_pkg
    n=0
    for rev in "$@"; do
      n=$((n + 1))
      dir=ab_pkg/${n}_$(echo "$rev" | tr '/.' '__')
      mkdir -p "$dir"
      if [ "$rev" = . ]; then
        cp -r $SOURCES "$dir"/
      else
        git archive "$rev" $SOURCES | tar -x -C "$dir" || { echo "no revision $rev"; exit 1; }
      fi
      echo "$dir: $(git rev-parse --short "${rev/#./HEAD}")$([ "$rev" = . ] && echo ' + working tree')"
    done
    ;;
  run)
    OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
    BENCH=${BENCH:---quick}
    for dir in $(ls -d ab_pkg/*/ | sort -V); do
      name=$(basename "$dir")
      t0=$(date +%s)
      (cd "$dir" && CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) python3 -m pip install --no-build-isolation --no-deps -q . \
         > "$OUT/pkg_ab_build_$name.log" 2>&1) || { tail -20 "$OUT/pkg_ab_build_$name.log"; exit 1; }
      echo "== $name, built in $(( $(date +%s) - t0 )) s"
      # From tests/, so that the installed package (with its kernels) is imported.
      (cd tests && python3 -m jax_dnn.benchmark $BENCH --out "$OUT/bench_$name" 2>&1)
    done
    ;;
  *)
    echo "usage: pkg_ab.sh prepare REV...  |  BENCH=... pkg_ab.sh run"; exit 2 ;;
esac
