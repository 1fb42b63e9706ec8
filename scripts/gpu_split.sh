#!/usr/bin/env bash
# Runs one GPU test file's `gpu` cases as N pytest processes side by side on
# one GPU (each gets 1/N of its memory, no preallocation). Most of a kernel
# test's time is XLA compiling on the host's cores, so the file finishes in
# a fraction of the time one process takes, inside the device tool's 600 s
# a call. Logs go to $OUT (or ./gpu_out).
#   bash scripts/gpu_split.sh test_attention_kernels.py 3
set -uo pipefail
cd "$(dirname "$0")/../tests"
OUT=${OUT:-$PWD/../gpu_out}; mkdir -p "$OUT"
file=$1; parts=$2
# Collected from tests/, the ids read "FILE::case"; some versions prefix "tests/".
mapfile -t ids < <(python3 -m pytest --co -q -m gpu -p no:cacheprovider "$file" 2>/dev/null \
                   | grep '::' | sed 's#^tests/##')
n=${#ids[@]}
echo "== $file: $n cases in $parts processes"
for ((p = 0; p < parts; p++)); do
  lo=$(( p * n / parts )); hi=$(( (p + 1) * n / parts ))
  XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=$(python3 -c "print(round(0.9 / $parts, 3))") \
    python3 -m pytest -v --tb=short -m gpu -p no:cacheprovider "${ids[@]:lo:hi-lo}" \
    > "$OUT/${file%.py}_part$p.log" 2>&1 &
done
wait
for ((p = 0; p < parts; p++)); do
  log="$OUT/${file%.py}_part$p.log"
  grep -E "^(FAILED|ERROR)" "$log"
  echo "part $p: $(grep -E "passed|failed|error" "$log" | tail -1)"
done
