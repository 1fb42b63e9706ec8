// Placeholder for the direct depthwise kernels (conv_depthwise.h) until they
// are built: ConvDepthwiseSupports declines every problem, so no plan picks them.
#include "ffi/conv/conv_depthwise.h"

namespace jax_dnn {

cudaError_t LaunchConvDepthwise(ConvOp, const ConvShape&, const ConvArgs&, cudaStream_t) {
  return cudaErrorNotSupported;
}

}  // namespace jax_dnn
