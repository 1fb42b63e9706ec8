// The shared-memory tiled direct convolution (conv_direct.cu): depthwise and
// grouped fprop and stride-1 dgrad, and depthwise wgrad's partial sums.
// Rules and tiling: conv_direct_plan.h.
#pragma once

#include <cuda_runtime.h>

#include "ffi/conv/conv.h"
#include "ffi/conv/conv_direct_plan.h"

namespace jax_dnn {

// Runs fprop (x, w, bias, residual -> y), stride-1 dgrad (dy, w -> dx) or
// (grouped) wgrad (x, dy -> dw, through the workspace ConvGroupedWorkspaceBytes
// sized) on `shape` with the pointers in `args`. The caller checked that the
// tiling is ok (ConvGroupedSupports / ConvDepthwiseTiled); buffers 16-byte
// aligned.
cudaError_t LaunchConvDirectTiled(ConvOp op, const ConvShape& shape, const ConvArgs& args,
                                  cudaStream_t stream);

// Depthwise wgrad's first stage (ConvDepthwiseTiled(kWgrad, ...) holds):
// writes partial sums [parts, C * taps] (fp32) into `partials` with at most
// `max_parts` parts, and how many in *parts; the caller reduces them in a
// fixed order.
cudaError_t LaunchConvDirectWgradPartials(const ConvShape& shape, const ConvArgs& args,
                                          float* partials, int64_t max_parts, int64_t* parts,
                                          cudaStream_t stream);

// The fixed-order column sum of `parts` rows of partials [parts, width] into
// dw (fp32), or into the workspace's fp32 sum at its start and then cast
// into dw (bf16, fp16).
cudaError_t LaunchConvDirectSumParts(const float* partials, int64_t parts, int64_t width,
                                     const ConvArgs& args, cudaStream_t stream);

}  // namespace jax_dnn
