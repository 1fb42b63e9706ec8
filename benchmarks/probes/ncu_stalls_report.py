"""Prints what benchmarks/probes/ncu_stalls.sh collected: duration, DRAM, L2 and L1 throughput,
the warp stall reasons (cycles per issued instruction), and the SASS lines
with the most stall samples.  python3 ncu_stalls_report.py RAW.csv SASS.csv"""

import csv
import sys


def rows(path):
  try:
    return [r for r in csv.reader(open(path)) if r]
  except OSError:
    return []


raw = rows(sys.argv[1])
if len(raw) > 2:
  hdr, units, vals = raw[0], raw[1], raw[2]
  m = dict(zip(hdr, vals))
  print("kernel", m.get("Kernel Name", "?")[:90])
  for k in ("gpu__time_duration.sum", "dram__throughput.avg.pct_of_peak_sustained_elapsed",
            "launch__grid_size", "launch__registers_per_thread",
            "sm__warps_active.avg.pct_of_peak_sustained_active",
            "smsp__issue_active.avg.pct_of_peak_sustained_active",
            # Memory levels: L2 (lts) and L1 (l1tex) throughput and hit rates, and the
            # bytes L2 sent the SMs, which re-read parameters add to beyond DRAM's.
            "lts__t_throughput.avg.pct_of_peak_sustained_elapsed",
            "l1tex__t_throughput.avg.pct_of_peak_sustained_active",
            "lts__t_sector_hit_rate.pct", "l1tex__t_sector_hit_rate.pct",
            "lts__t_sectors_srcunit_tex_op_read.sum", "dram__bytes_read.sum",
            "dram__bytes_write.sum"):
    if k in m:
      print(f"  {k} = {m.get(k)} {units[hdr.index(k)]}")
  stalls = [(k, v) for k, v in m.items()
            if k.startswith("smsp__average_warps_issue_stalled_") and k.endswith("per_issue_active.ratio")]
  stalls.sort(key=lambda kv: -float(kv[1].replace(",", "") or 0))
  for k, v in stalls[:10]:
    print(f"  stall {k[len('smsp__average_warps_issue_stalled_'):-len('_per_issue_active.ratio')]:28s} {v}")
sass = rows(sys.argv[2])
if sass:
  # The table starts at the header row holding "Source".
  start = next((i for i, r in enumerate(sass) if "Source" in r), None)
  if start is not None:
    hdr = sass[start]
    si = hdr.index("Source")
    col = next((c for c in hdr if c.startswith("Warp Stall Sampling (All")), None)
    if col:
      ci = hdr.index(col)
      body = sass[start + 1:]

      def num(r):
        try:
          return float(r[ci].replace(",", ""))
        except (ValueError, IndexError):
          return 0.0

      total = sum(num(r) for r in body) or 1
      print(f"  top SASS lines by stall samples ({col}, total {total:.0f}):")
      for idx, r in sorted(enumerate(body), key=lambda ir: -num(ir[1]))[:25]:
        print(f"   {idx:5d} {100 * num(r) / total:5.1f}%  {r[si][:90]}")
    else:
      print("  source page columns:", hdr[:12])
