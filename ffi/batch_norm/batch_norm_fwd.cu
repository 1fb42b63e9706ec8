// Batch norm's forward kernels: the per-channel sums and the elementwise
// apply (batch_norm.cuh). The forward reads x twice, once for each, unless
// it stays in L2 between them.
#include "ffi/batch_norm/batch_norm.cuh"

namespace jax_dnn {

cudaError_t LaunchBatchNormStats(const BatchNormParams& p, cudaStream_t stream) {
  return LaunchBatchNorm<BatchNormMode::kStats>(p, stream);
}

cudaError_t LaunchBatchNormFwd(const BatchNormParams& p, cudaStream_t stream) {
  return LaunchBatchNorm<BatchNormMode::kFwd>(p, stream);
}

}  // namespace jax_dnn
