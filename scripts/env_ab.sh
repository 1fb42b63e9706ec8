#!/usr/bin/env bash
# A/B of kernel variants selected at run time inside one build: a temporary
# launcher switch reading JAX_DNN_AB (never committed) picks the variant, and
# this runs scripts/ops_ab.py (or AB_SCRIPT) once per value in VALUES,
# alternating ROUNDS times, then prints each case's median time an
# application and its ratio to the first value's. Cheaper than ops_ab.sh when
# the variants are template instantiations of one tree (one build, not one
# a variant). NO_BUILD=1 reuses the installed package.
#   VALUES="0 1 2" ROUNDS=2 bash scripts/env_ab.sh [ops_ab.py arguments]
set -uo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-2}
AB_SCRIPT=${AB_SCRIPT:-scripts/ops_ab.py}
export CMAKE_BUILD_PARALLEL_LEVEL=$(nproc)
if [ -z "${NO_BUILD:-}" ]; then
  t0=$(date +%s)
  python3 -m pip install --no-build-isolation --no-deps -q . > /tmp/env_ab_build.log 2>&1 \
    || { tail -30 /tmp/env_ab_build.log; exit 1; }
  echo "built in $(( $(date +%s) - t0 )) s"
fi
T=/tmp/env_ab_times.txt; rm -f $T
for r in $(seq $ROUNDS); do
  for v in ${VALUES:-0 1}; do
    (cd /tmp && JAX_DNN_AB=$v python3 "$OLDPWD/$AB_SCRIPT" "$@" | sed "s/^/ab$v /") >> $T \
      || echo "variant $v failed in round $r" >&2
  done
done
python3 scripts/ab_table.py $T
