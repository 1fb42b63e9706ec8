// Dispatch of the attention launchers on the element type.
#include "ffi/attention/attention.h"

namespace jax_dnn {
namespace attention {
template <typename T>
cudaError_t LaunchFwdTyped(const AttentionFwdParams& p, cudaStream_t stream);
template <typename T>
cudaError_t LaunchBwdTyped(const AttentionBwdParams& p, cudaStream_t stream);
}  // namespace attention

cudaError_t LaunchAttentionFwd(const AttentionFwdParams& p, cudaStream_t stream) {
  if (p.dtype == DType::kBF16) return attention::LaunchFwdTyped<__nv_bfloat16>(p, stream);
  if (p.dtype == DType::kF16) return attention::LaunchFwdTyped<__half>(p, stream);
  return cudaErrorInvalidValue;
}

cudaError_t LaunchAttentionBwd(const AttentionBwdParams& p, cudaStream_t stream) {
  if (p.dtype == DType::kBF16) return attention::LaunchBwdTyped<__nv_bfloat16>(p, stream);
  if (p.dtype == DType::kF16) return attention::LaunchBwdTyped<__half>(p, stream);
  return cudaErrorInvalidValue;
}

}  // namespace jax_dnn
