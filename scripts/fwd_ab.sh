#!/usr/bin/env bash
# A/B of attention-forward variants with scripts/fwd_trace.cu, on the GPU
# machine. Each variant is a copy of the tree in ab_<name>/ (ffi/ and
# scripts/fwd_trace.cu; e.g. `mkdir -p ab_base/scripts && git archive HEAD ffi
# | tar -x -C ab_base && cp scripts/fwd_trace.cu ab_base/scripts/`; ab_* is
# not committed). Prints, per shape: whether each variant's output and
# logsumexp equal the first's byte for byte (else how far apart:
# fwd_ab_diff.py), the median time a call of 5 alternating runs (clocks
# under this load move by 10% between runs, so only alternation compares),
# and each variant's median cycles a work tile. A variant whose attention.h
# has the split tail's workspace gets one (-DJAX_DNN_FWD_HAS_WS).
#   VARIANTS="base new" SHAPES="8192_x_128 2048_causal_128" bash scripts/fwd_ab.sh
# (FWD_T=2000 for ragged queries; FWD_AB_BUILT=1 skips the build in a second run.)
VARIANTS=${VARIANTS:-base new}
cd "$(dirname "$0")/.."
mkdir -p build; F="-std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -I. scripts/fwd_trace.cu ffi/attention/attention_tma.cu"
[ -n "$FWD_AB_BUILT" ] || for v in $VARIANTS; do  # FWD_AB_BUILT=1: reuse the builds of an earlier run in this call
  W=$(grep -q ws_elems ab_$v/ffi/attention/attention.h && echo -DJAX_DNN_FWD_HAS_WS)  # the split tail's workspace
  (cd ab_$v && nvcc $F $W -DFWD_TRACE_OFF -o ../build/$v 2>&1 | grep -i error) &
  (cd ab_$v && nvcc $F $W -o ../build/${v}_tr 2>&1 | grep -i error) &
done; wait
first=${VARIANTS%% *}
for a in ${SHAPES:-8192_x_128 4096_x_128 2048_causal_128 8192_causal_128}; do
  a=${a//_/ }
  echo "== $a"; timeout 60 build/$first $a /tmp/$first.bin > /dev/null || { echo "$first failed"; exit 1; }
  for v in $VARIANTS; do [ $v = $first ] && continue; timeout 60 build/$v $a /tmp/$v.bin > /dev/null || { echo "$v failed"; exit 1; }; cmp -s /tmp/$first.bin /tmp/$v.bin && echo "$v identical" || python3 scripts/fwd_ab_diff.py /tmp/$first.bin /tmp/$v.bin $v ${a##* }; done
  for i in 1 2 3 4 5; do for v in $VARIANTS; do echo "$v $(timeout 60 build/$v $a | head -1 | sed 's/.*: //')"; done; done | awk '{print $1, $2}' | python3 -c "
import sys,statistics as st
d={}
for l in sys.stdin: v,t=l.split(); d.setdefault(v,[]).append(float(t))
b=st.median(d['$first'])
print('  median us: ' + ', '.join(f'{v} {st.median(t):.1f} ({min(t):.1f}-{max(t):.1f}) {st.median(t)/b:.3f}' for v,t in d.items()))"
  for v in $VARIANTS; do echo "  $v: $(timeout 60 build/${v}_tr $a | grep 'per work tile' | sed 's/per work tile (median cycles): //')"; done
done
