// Batch norm's backward kernels: the per-channel sums of dz and dz (x - m),
// and the elementwise dx (and dresidual) (batch_norm.cuh). Each recomputes
// dz = dy act'(x a + b + residual) from its inputs.
#include "ffi/batch_norm/batch_norm.cuh"

namespace jax_dnn {

cudaError_t LaunchBatchNormBwdStats(const BatchNormParams& p, cudaStream_t stream) {
  return LaunchBatchNorm<BatchNormMode::kBwdStats>(p, stream);
}

cudaError_t LaunchBatchNormBwd(const BatchNormParams& p, cudaStream_t stream) {
  return LaunchBatchNorm<BatchNormMode::kBwd>(p, stream);
}

}  // namespace jax_dnn
