set -uo pipefail
export CMAKE_BUILD_PARALLEL_LEVEL=$(nproc)
t0=$(date +%s)
python3 -m pip install --no-build-isolation --no-deps -q . > $OUT/build.log 2>&1 || { tail -30 $OUT/build.log; exit 1; }
echo "built in $(( $(date +%s) - t0 )) s"
NO_BUILD=1 VALUES="0 5" ROUNDS=3 bash scripts/env_ab.sh --ops layer_norm,rms_norm --modes fwd \
  --cases 16384x2048:bfloat16,16384x4096:bfloat16,16384x8192:bfloat16,4096x16384:bfloat16,16384x4096:float32,16384x2048:float32 2>&1 | tail -14
echo "end at $(( $(date +%s) - t0 )) s"
