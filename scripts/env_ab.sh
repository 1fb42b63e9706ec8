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
python3 - $T <<'PY'
import statistics, sys
d = {}
for line in open(sys.argv[1]):
  v, *case, t = line.split()
  d.setdefault(" ".join(case), {}).setdefault(v, []).append(float(t))
names = list(next(iter(d.values())))
print(f"{'case':42s} " + " ".join(f"{v + ' us':>9s}" for v in names) + "  ratios to " + names[0])
for case, vs in d.items():
  t = [statistics.median(vs[v]) for v in names]
  print(f"{case:42s} " + " ".join(f"{x:9.1f}" for x in t) + "  " + " ".join(f"{x / t[0]:.3f}" for x in t[1:]))
PY
