#!/usr/bin/env bash
# A/B of builds of the memory-bound kernels on the GPU machine: builds the
# trees in ab_<name>/ for each name in VARIANTS (e.g. `mkdir ab_base && git
# archive HEAD | tar -x -C ab_base`; ab_* is not committed) and the working
# tree ("new") side by side, then runs scripts/ops_ab.py under each,
# alternating ROUNDS times, and prints each case's median time an
# application and its ratio to the first variant's.
#   VARIANTS="base" ROUNDS=2 bash scripts/ops_ab.sh [ops_ab.py arguments]
# AB_SCRIPT names another script printing "case... microseconds" lines
# (e.g. AB_SCRIPT=scripts/bwd_waves.py with its --ab arguments).
set -uo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-2}
AB_SCRIPT=${AB_SCRIPT:-scripts/ops_ab.py}
export CMAKE_BUILD_PARALLEL_LEVEL=$(nproc)
A=/tmp/ops_ab; rm -rf $A; mkdir -p $A
t0=$(date +%s)
VARIANTS=${VARIANTS:-base}
for v in $VARIANTS; do
  (cd ab_$v && python3 -m pip install --no-build-isolation --no-deps -q --target $A/$v \
     -C build-dir=/tmp/ops_ab_build_$v . > $A/$v.log 2>&1 || tail -20 $A/$v.log) &
done
(python3 -m pip install --no-build-isolation --no-deps -q --target $A/new \
   -C build-dir=/tmp/ops_ab_build_new . > $A/new.log 2>&1 || tail -20 $A/new.log) &
wait
echo "built in $(( $(date +%s) - t0 )) s"
for r in $(seq $ROUNDS); do
  for v in $VARIANTS new; do
    (cd /tmp && PYTHONPATH=$A/$v python3 $OLDPWD/$AB_SCRIPT "$@" | sed "s/^/$v /") >> $A/times.txt
  done
done
python3 scripts/ab_table.py $A/times.txt
