#!/usr/bin/env bash
# Each memory-bound kernel's time, DRAM throughput, registers and occupancy,
# ours and XLA's fusion of the same math, under ncu (benchmarks/probes/profile_ops.py on
# 16384 x WIDTH bf16), written to $OUT and summarized per width.
#   OUT=gpu_out bash benchmarks/probes/ncu_ops.sh
# WIDTHS (default "4096 1024"): the rows' widths; MIN_US (default 20): kernels
# shorter than this are not listed; NO_BUILD=1 uses the jax_dnn on PYTHONPATH.
[ -n "${NO_BUILD:-}" ] || python3 -m pip install --no-build-isolation --no-deps -q . > /tmp/build.log 2>&1 || { tail -30 /tmp/build.log; exit 1; }
for w in ${WIDTHS:-4096 1024}; do
timeout -s KILL 150 ncu --clock-control none --csv --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active python3 benchmarks/probes/profile_ops.py $w > $OUT/ncu_$w.csv 2>/dev/null
python3 - $w <<'PY'
import csv, sys, collections
rows = [r for r in csv.reader(open(f"{__import__('os').environ['OUT']}/ncu_{sys.argv[1]}.csv")) if len(r) > 10]
hdr = rows[0]; ki = hdr.index("Kernel Name"); mi = hdr.index("Metric Name"); vi = hdr.index("Metric Value"); ii = hdr.index("ID")
d = collections.OrderedDict()
for r in rows[1:]:
  d.setdefault((r[ii], r[ki][:70]), {})[r[mi]] = r[vi]
print("width", sys.argv[1])
for (i, k), m in d.items():
  t = float(m.get("gpu__time_duration.sum", "0").replace(",", ""))
  if t < 1000 * float(__import__('os').environ.get('MIN_US', '20')): continue
  print(f"{i:>4} {k:70s} {t/1000:8.1f} us dram {m.get('dram__throughput.avg.pct_of_peak_sustained_elapsed')}% regs {m.get('launch__registers_per_thread')} warps {m.get('sm__warps_active.avg.pct_of_peak_sustained_active')}%")
PY
done
