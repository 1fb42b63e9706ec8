#include "ffi/attention/attention_bwd_launch.cuh"

namespace jax_dnn {
namespace attention {
template cudaError_t LaunchBwdTyped<__nv_bfloat16>(const AttentionBwdParams&, cudaStream_t);
}  // namespace attention
}  // namespace jax_dnn
