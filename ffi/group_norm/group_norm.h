// Group norm (instance norm: one channel a group) of channels-last x viewed
// as [n, spatial, channels], with an optional fused activation.
//
//   y = act((x - mean) * rstd * scale + bias),  rstd = 1 / sqrt(var + eps)
//
// mean and var per (sample, group) over the spatial positions and the
// channels / groups channels of the group (a contiguous slice of each
// position's channels). x, y, dy, dx are T (fp32/bf16/fp16); scale, bias,
// the statistics and the parameter gradients fp32. scale/bias are
// [param_sets, channels]: sample s uses set s / (n / param_sets).
//
// Forward: statistics blocks (`splits` a sample, group_norm_plan.h) write
// fp32 partial sums to a workspace, a finalize kernel adds them in a fixed
// order into stats [n, groups, 2] (mean, rstd), then an elementwise kernel
// writes y. Backward: blocks write per-channel sums of dz and dz * xhat
// (dz = dy * act'(z), z = xhat * scale + bias), a finalize kernel adds them
// per sample and forms each group's dx coefficients, ffi/common/column_sum.cu
// adds the samples of each parameter set into dbias and dscale, and an
// elementwise kernel writes dx. No atomics: deterministic.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "ffi/common/dtype.h"
#include "ffi/group_norm/group_norm_plan.h"

namespace jax_dnn {

// -1: no activation; otherwise enum Activation (ffi/activation/activation.h).
constexpr int kGroupNormNoActivation = -1;

struct GroupNormFwdParams {
  DType dtype;
  int activation;
  const void* x;       // [n, spatial, channels]
  const float* scale;  // [param_sets, channels]
  const float* bias;   // [param_sets, channels]
  void* y;             // [n, spatial, channels]
  float* stats;        // [n, groups, 2]: (mean, rstd)
  float* partials;     // workspace [n, splits, groups, 2]: sums of d, d^2 (d = x - shift)
  int64_t n, spatial, channels, groups, param_sets, splits;
  int64_t sample_begin, sample_end;  // the samples a launch covers (set by the launcher)
  float epsilon;
};

struct GroupNormBwdParams {
  DType dtype;
  int activation;
  const void* dy;      // [n, spatial, channels]
  const void* x;       // [n, spatial, channels]
  const float* scale;  // [param_sets, channels]
  const float* bias;   // [param_sets, channels]
  const float* stats;  // [n, groups, 2]: the forward's (mean, rstd)
  void* dx;            // [n, spatial, channels]
  float* dscale;       // [param_sets, channels]
  float* dbias;        // [param_sets, channels]
  float* partials;     // workspace [n, splits, 2, channels]: sums of dz, dz * xhat
  float* sample_sums;  // workspace [n, 2, channels] = [param_sets, n / param_sets, 2, channels]
  float* coefs;        // workspace [n, groups, 2]: mean over the group of g, g * xhat (g = dz * scale)
  int64_t n, spatial, channels, groups, param_sets, splits;
  int64_t sample_begin, sample_end;  // the samples a launch covers (set by the launcher)
};

cudaError_t LaunchGroupNormFwd(const GroupNormFwdParams& p, cudaStream_t stream);
cudaError_t LaunchGroupNormBwd(const GroupNormBwdParams& p, cudaStream_t stream);

}  // namespace jax_dnn
