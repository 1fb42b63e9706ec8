// The norms' plans (layer_norm_plan.cc): how much workspace the backward
// needs. Host-only plain C++, built in CPU-only builds too; Python asks it
// through ffi/registrations.cc (jax_dnn/_src/plans.py).
#pragma once

#include <cstdint>

#include "ffi/common/device_props.h"

namespace jax_dnn {

// Row parts of the backward's workspace [param_sets, parts, sums, width] (fp32
// partial parameter gradients; sums 2 for layer norm, 1 for RMS norm): each
// part (a block, or a cluster) sums its rows of a param_set into its row of the
// workspace, and ffi/common/column_sum.cu adds the parts in a fixed order.
// The register-row and streamed kernels use as many parts as fit on the
// device at once, at most these (BwdParts, layer_norm.h); the fallback
// kernel uses them all. Any count of 1 or more is correct.
//
// All param_sets together take at least kNormBwdMinParts = 320 parts, and two
// an SM on a device with more than 160 SMs: two 256-thread blocks of the
// streamed kernel run on an SM, and the register-row kernel's smaller
// blocks, which fit more, take at most 320 (the partials then stay a few
// percent of the bytes the backward moves). With no device known
// (device.sm_count 0) that is 320: two an SM on every GPU of up to 160 SMs.
// Never more parts than a param_set has rows, and the workspace stays within
// 256 MiB.
int64_t LayerNormBwdParts(int64_t rows, int64_t param_sets, int64_t width, bool rms,
                          const DeviceProps& device);

}  // namespace jax_dnn
