// Max and average pooling over the spatial axes of channels-last tensors,
// and their gradients. Every call is 3D (a 1D/2D problem has unit leading
// spatial axes; jax_dnn/_src/pooling.py reshapes):
//
//   x, dx [N, D, H, W, C];  y, dy [N, OD, OH, OW, C];  T = fp32/bf16/fp16.
//
// Windows, along each axis of length L with output size O:
//   pooling:  output o reads [o * stride - pad, o * stride - pad + window);
//             positions outside [0, L) are padding (-inf for max, 0 for avg);
//   adaptive: output o reads PyTorch's bin [floor(o L / O), ceil((o + 1) L / O)).
// Max is exact in T (NaN propagates: a window holding a NaN gives NaN);
// averages sum in fp32, divided by prod(window) (count_include_pad, pooling
// only) or by the window's positions inside the input.
//
// Gradients are gathers (no scatter, no atomics, deterministic): each thread
// owns a vector of channels of one input position and sums over the outputs
// whose windows cover it. Max pooling's gradient goes to each window's first
// maximal position in row-major window order, padding included as -inf (XLA's
// select_and_scatter_add rule); NaN counts as the largest value. Two ways:
//   argmax indices (idx set): the forward also writes idx [N, OD, OH, OW, C]
//     uint8, each window's argmax as its row-major offset in the window
//     [window_d, window_h, window_w] (adaptive: the largest bins'), or
//     kPoolNoArgmax where a padded position wins (the gradient is dropped);
//     the backward reads dy and idx only. Windows of at most kPoolMaxArgmax
//     positions (pooling_plan.h).
//   from x and y (idx null; larger windows): position i is the argmax of
//     window o iff x[i] equals y[o] and no position before i in the window
//     does, so the backward scans a window only where x[i] equals its
//     maximum (once a window for untied data).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "ffi/common/dtype.h"
#include "ffi/pooling/pooling_plan.h"

namespace jax_dnn {

struct PoolParams {
  DType dtype;
  bool max;                // max pooling; else average
  bool adaptive;           // PyTorch's bins; window, stride and pad unused
  bool count_include_pad;  // average pooling's divisor prod(window) (not adaptive)
  const void* x;           // [N, D, H, W, C]: forward input; max backward's x
  const void* y;           // [N, OD, OH, OW, C]: max backward's forward output
  const void* dy;          // [N, OD, OH, OW, C]
  void* idx;               // max: [N, OD, OH, OW, C] uint8 argmax offsets (forward
                           // writes, backward reads), or null
  void* out;               // forward: y; backward: dx
  float* partials;         // global average pooling's [N, parts, C] (parts > 1)
  int64_t parts;           // global average pooling's blocks a column (1: none)
  int64_t n, c;
  int64_t in[3], output[3], window[3], stride[3], pad[3];  // (D, H, W)
};

cudaError_t LaunchPoolFwd(const PoolParams& p, const DeviceProps& device, cudaStream_t stream);
cudaError_t LaunchPoolBwd(const PoolParams& p, cudaStream_t stream);

}  // namespace jax_dnn
