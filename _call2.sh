set -uo pipefail
export CMAKE_BUILD_PARALLEL_LEVEL=$(nproc)
python3 -m pip install --no-build-isolation --no-deps -q . > /tmp/build.log 2>&1 || tail -20 /tmp/build.log
cd benchmarks && timeout 300 python3 bench_ops.py --ops softmax --json $OUT/bench_ops_softmax_h200_2026-11-24p.json 2>&1 | tail -45
cd ../scripts && XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 200 compute-sanitizer --tool memcheck python3 sanitize_ops.py ops 2>&1 | tail -2
