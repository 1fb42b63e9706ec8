// The activations' plans (activation_plan.cc): how much workspace the bias +
// activation backward needs. Host-only plain C++, built in CPU-only builds
// too; Python asks it through ffi/registrations.cc (jax_dnn/_src/plans.py).
#pragma once

#include <cstdint>

#include "ffi/common/device_props.h"
#include "ffi/common/dtype.h"

namespace jax_dnn {

// The bias + activation backward's block (BiasActBwdKernel, activation.cu):
// kBiasActColLanes threads across, each on a vector of columns (16 bytes of
// x where the rows allow, else one element), by kBiasActRowLanes rows.
constexpr int kBiasActColLanes = 32;
constexpr int kBiasActRowLanes = 8;

// Row parts of the bias backward's workspace [param_sets, parts, 1, width] (fp32
// partial dbias; ffi/common/column_sum.cu adds them in a fixed order). The
// kernel's grid is (column blocks) x (param_sets * parts): each block sums
// kBiasActRowLanes rows a step, of every parts-th step of its param_set. Any
// count of 1 or more is correct.
//
// The grid aims at 8 blocks an SM, two waves of the four an SM the kernel's
// launch bounds allow, and 1024 blocks with no device known
// (device.sm_count 0; 8 an SM up to 128 SMs, fewer waves beyond). Never more
// parts than a param_set has row steps, nor more than gridDim.y (65535) allows.
int64_t BiasActBwdParts(int64_t rows, int64_t param_sets, int64_t width, DType dtype,
                        const DeviceProps& device);

}  // namespace jax_dnn
