// Batch norm's kernels over x viewed as [rows, C] (channels last), in G
// parameter sets of rows / G consecutive rows (G > 1 only where vmap folded
// its axis in):
//
//   stats:      s1 = sum(x - k), s2 = sum((x - k)^2)          per (set, channel)
//   fwd:        y = act(x * a + b + residual)
//   bwd_stats:  sdz = sum(dz), sdzc = sum(dz * (x - m))       dz = dy * act'(x * a + b + residual)
//   bwd:        dx = k1 * dz + k2 * (x - m) + k3, dresidual = dz
//
// x, y, dy, dx, residual are T (fp32/bf16/fp16); the per-channel operands
// fp32: shift [G, C], coefs [G, K, C] with rows (a, b, m, k1, k2, k3) (K = 2
// forward, 3 for bwd_stats, 6 backward); sums fp32 [G, C]. Math in fp32. The
// sums come from per-block partials [G, parts, 2, C] added in a fixed order
// (ffi/common/column_sum.cu): deterministic.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "ffi/batch_norm/batch_norm_plan.h"
#include "ffi/common/dtype.h"

namespace jax_dnn {

// activation: enum Activation (ffi/activation/activation.h), or kBatchNormNoActivation.
constexpr int kBatchNormNoActivation = -1;

struct BatchNormParams {
  DType dtype;
  int activation;
  const void* dy;        // [rows, C] (backward)
  const void* x;         // [rows, C]
  const void* residual;  // [rows, C], or null
  const float* coefs;    // [G, K, C] (fwd, bwd_stats, bwd), or the shift [G, C] (stats)
  int coef_rows;         // K
  void* out;             // y (fwd), dx (bwd)
  void* dresidual;       // dz (bwd with a residual), or null
  float* partials;       // [G, parts, 2, C] (stats, bwd_stats)
  float* sums[2];        // [G, C] each (stats, bwd_stats)
  int64_t rows;
  int64_t width;
  int64_t param_sets;
  int64_t parts;         // the reductions' workspace parts (BatchNormParts)
};

cudaError_t LaunchBatchNormStats(const BatchNormParams& p, cudaStream_t stream);
cudaError_t LaunchBatchNormFwd(const BatchNormParams& p, cudaStream_t stream);
cudaError_t LaunchBatchNormBwdStats(const BatchNormParams& p, cudaStream_t stream);
cudaError_t LaunchBatchNormBwd(const BatchNormParams& p, cudaStream_t stream);

}  // namespace jax_dnn
