#!/usr/bin/env bash
# Where a kernel's warps wait: ncu's warp-state statistics and per-SASS-line
# stall samples for the kernels matching KERNEL (a regex; default the norm
# backward's streamed kernel), run by benchmarks/probes/profile_rows.py on the specs
# given (see there). Report and tables go to $OUT. NO_BUILD=1 skips the install.
#   bash benchmarks/probes/ncu_stalls.sh layer_norm:4096x131072:bfloat16 ...
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
[ -n "${NO_BUILD:-}" ] || python3 -m pip install --no-build-isolation --no-deps -q . > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
kernel=${KERNEL:-LayerNormStreamBwd}
i=0
for spec in "$@"; do
  i=$((i + 1)); rep="$OUT/stalls_$i"
  echo "== $spec"
  (cd benchmarks/probes && timeout -s KILL 240 ncu --clock-control none -k "regex:$kernel" -c 1 \
      --section WarpStateStats --section SourceCounters --section SpeedOfLight \
      --section LaunchStats --section Occupancy --section MemoryWorkloadAnalysis \
      -f -o "$rep" python3 profile_rows.py "$spec" > "$OUT/ncu_$i.log" 2>&1) || tail -5 "$OUT/ncu_$i.log"
  ncu -i "$rep.ncu-rep" --page raw --csv > "$OUT/raw_$i.csv" 2>/dev/null
  ncu -i "$rep.ncu-rep" --page source --csv --print-source sass > "$OUT/sass_$i.csv" 2>/dev/null
  python3 benchmarks/probes/ncu_stalls_report.py "$OUT/raw_$i.csv" "$OUT/sass_$i.csv"
done
