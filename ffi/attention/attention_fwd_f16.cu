#include "ffi/attention/attention_fwd_launch.cuh"

namespace jax_dnn {
namespace attention {
template cudaError_t LaunchFwdTyped<__half>(const AttentionFwdParams&, cudaStream_t);
}  // namespace attention
}  // namespace jax_dnn
