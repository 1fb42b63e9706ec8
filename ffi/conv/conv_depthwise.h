// The direct depthwise convolution kernels (groups == C): fprop, dgrad and
// wgrad, memory-bound, channels last. Rules and workspace: conv_depthwise_plan.h.
#pragma once

#include <cuda_runtime.h>

#include "ffi/conv/conv.h"
#include "ffi/conv/conv_depthwise_plan.h"

namespace jax_dnn {

// Runs `op` on `shape` with the pointers in `args` (those `op` uses; see
// ConvArgs) on `stream`. The caller checked ConvDepthwiseSupports and passes
// the workspace that ConvDepthwiseWorkspaceBytes sized.
cudaError_t LaunchConvDepthwise(ConvOp op, const ConvShape& shape, const ConvArgs& args,
                                cudaStream_t stream);

}  // namespace jax_dnn
