// Placeholder for the direct depthwise kernels' rules (conv_depthwise_plan.h)
// until those kernels are built: they take no problem and need no workspace.
#include "ffi/conv/conv_depthwise_plan.h"

namespace jax_dnn {

bool ConvDepthwiseSupports(ConvOp, const ConvShape&, DType, std::string* why) {
  if (why) *why = "the depthwise kernels are not built";
  return false;
}

int64_t ConvDepthwiseWorkspaceBytes(ConvOp, const ConvShape&, DType, int) { return 0; }

}  // namespace jax_dnn
