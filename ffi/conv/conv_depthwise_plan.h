// What the direct depthwise kernels (conv_depthwise.cu) take, host-only (the
// plans build without CUDA): groups == C, K == C * multiplier, w [K, T, R, S, 1].
#pragma once

#include <cstdint>
#include <string>

#include "ffi/conv/conv.h"

namespace jax_dnn {

// True when the depthwise kernel runs `op` on `shape`; otherwise false with
// the reason in *why (one line a user can read).
bool ConvDepthwiseSupports(ConvOp op, const ConvShape& shape, DType dtype, std::string* why);

// Workspace bytes the depthwise kernel needs for `op` (0 when none), for a
// device with `sm_count` SMs (0: unknown; then an upper bound).
int64_t ConvDepthwiseWorkspaceBytes(ConvOp op, const ConvShape& shape, DType dtype, int sm_count);

}  // namespace jax_dnn
