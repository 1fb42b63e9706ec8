"""Prints an A/B run's table: the median of each case's times for each variant
and their ratios to the first variant's. Input lines: `variant case... time`
(scripts/ops_ab.sh and scripts/env_ab.sh write them). A variant missing from
a case (a run that failed) prints as "-".
  python3 scripts/ab_table.py TIMES.txt"""
import statistics
import sys

d = {}
for line in open(sys.argv[1]):
  v, *case, t = line.split()
  d.setdefault(" ".join(case), {}).setdefault(v, []).append(float(t))
names = list(dict.fromkeys(v for vs in d.values() for v in vs))
print(f"{'case':42s} " + " ".join(f"{v + ' us':>9s}" for v in names) + "  ratios to " + names[0])
for case, vs in d.items():
  t = [statistics.median(vs[v]) if v in vs else None for v in names]
  cells = " ".join(f"{x:9.1f}" if x is not None else f"{'-':>9s}" for x in t)
  ratios = " ".join(f"{x / t[0]:.3f}" if x is not None and t[0] else "-" for x in t[1:])
  print(f"{case:42s} {cells}  {ratios}")
