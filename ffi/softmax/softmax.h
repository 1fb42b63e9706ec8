// Softmax and log-softmax along one axis of a tensor viewed as [outer, n, inner]
// (n = the softmax axis). inner == 1 (the last axis) takes the row kernels;
// inner > 1 takes the strided kernels, which read down the axis with threads
// spread (and coalesced) across inner. fp32 math; y, dy, dx in the input dtype.
//
//   softmax:      y = exp(x - max) / sum(exp(x - max))
//                 dx = y * (dy - sum(dy * y))
//   log_softmax:  y = x - max - log(sum(exp(x - max)))
//                 dx = dy - softmax(x) * sum(dy)
// The backward takes x, not y, and recomputes softmax(x) (the row is in
// registers anyway): nothing is saved by the forward, so a gradient-only
// program never runs the forward kernel.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "ffi/common/dtype.h"

namespace jax_dnn {

struct SoftmaxFwdParams {
  DType dtype;
  bool log;
  const void* x;  // [outer, n, inner]
  void* y;        // [outer, n, inner]
  int64_t outer;
  int64_t n;
  int64_t inner;
};

struct SoftmaxBwdParams {
  DType dtype;
  bool log;
  const void* x;   // forward input [outer, n, inner]
  const void* dy;  // [outer, n, inner]
  void* dx;        // [outer, n, inner]
  int64_t outer;
  int64_t n;
  int64_t inner;
};

cudaError_t LaunchSoftmaxFwd(const SoftmaxFwdParams& p, cudaStream_t stream);
cudaError_t LaunchSoftmaxBwd(const SoftmaxBwdParams& p, cudaStream_t stream);

}  // namespace jax_dnn
