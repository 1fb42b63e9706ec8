// Dispatch of the attention launchers on the element type.
#include "ffi/attention/attention.h"
#include "ffi/attention/attention_common.cuh"
#include "ffi/attention/attention_tma.h"

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

bool AttentionFusedDqSupported(const AttentionBwdParams& p) {
  const int64_t d = attention::PadDim(p.shape.h);
  return (d == 64 || d == 128) && attention::PadDim(p.shape.hv) == d &&
         p.dbias == nullptr &&
         !attention::NeedsGeneral(p.mask, p.softcap);
}

int64_t AttentionDqAccElements(const AttentionShape& s) {
  const int64_t d = attention::PadDim(s.h), rows = attention::DqTileRows(d);
  return s.b * s.n * ((s.t + rows - 1) / rows) * rows * d;
}

}  // namespace jax_dnn
