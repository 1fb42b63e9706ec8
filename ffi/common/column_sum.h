// Deterministic reduction of per-block partial sums, the second stage of every
// backward kernel that produces a parameter gradient (dscale, dbias). Partials
// are fp32 [param_sets, parts, sums, width]; out[s] is fp32 [param_sets, width] and
// equals the sum over `parts` in a fixed order, so results do not depend on
// scheduling (no atomics).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace jax_dnn {

struct ColumnSumParams {
  const float* partials;  // [param_sets, parts, sums, width]
  float* out[2];          // sums outputs, each [param_sets, width]
  int64_t param_sets;
  int64_t parts;
  int sums;  // 1 or 2
  int64_t width;
};

cudaError_t LaunchColumnSum(const ColumnSumParams& p, cudaStream_t stream);

}  // namespace jax_dnn
