// Convolution: forward (fprop), data gradient (dgrad) and weight gradient
// (wgrad), 1D/2D/3D, channels last.
//
//   fprop:  y[n, p, k]  = act(sum_{r, c} x[n, p * stride - pad_lo + r * dilation, g(k) c]
//                                        * w[k, r, c] + bias[k] + residual[n, p, k])
//   dgrad:  dx = the transpose of fprop (without bias/act) applied to dy
//   wgrad:  dw[k, r, c] = sum_{n, p} dy[n, p, k] * x[n, p * stride - pad_lo + r * dilation, g(k) c]
//
// Layouts (the FFI operands, every spatial rank padded to 3 with extent-1 axes
// in front: a 1D problem is D = H = 1, a 2D one D = 1):
//   x  [N, D, H, W, C]            (NDHWC)
//   w  [K, T, R, S, C / groups]   (KTRSC: output channel outermost)
//   y  [N, O, P, Q, K]
// Output channel k belongs to group g(k) = k / (K / groups), which reads input
// channels [g(k) * C / groups, (g(k) + 1) * C / groups).
// Elements are T (bf16, fp16; fp32 runs as TF32 on tensor cores); bias and
// residual are T; accumulation is fp32.
// Host-only: the plans (built without CUDA) include it.
#pragma once

#include <cstdint>

#include "ffi/common/dtype.h"

namespace jax_dnn {

enum class ConvOp : int { kFprop = 0, kDgrad = 1, kWgrad = 2 };

// The numbering is the FFI attribute `activation` (-1: none); it is bias_act's
// (ffi/activation/activation.h, jax_dnn/_src/activation.py ACTIVATIONS).
constexpr int kConvNoActivation = -1;

// One convolution problem, the same for its three ops. Spatial arrays are in
// (D, H, W) order; unused leading axes have extent 1, stride 1, dilation 1, pad 0.
struct ConvShape {
  int64_t n = 0;       // batch (a vmapped axis is folded into it)
  int64_t c = 0;       // input channels
  int64_t k = 0;       // output channels
  int64_t groups = 1;  // C % groups == 0 and K % groups == 0
  int64_t input[3] = {1, 1, 1};   // D, H, W
  int64_t window[3] = {1, 1, 1};  // T, R, S
  int64_t output[3] = {1, 1, 1};  // O, P, Q
  int64_t stride[3] = {1, 1, 1};
  int64_t dilation[3] = {1, 1, 1};
  int64_t pad_lo[3] = {0, 0, 0};
  int64_t pad_hi[3] = {0, 0, 0};
  int rank = 2;  // the caller's spatial rank (1, 2 or 3): picks 2D or 3D kernels
};

// The raw pointers of one call. fprop: x, w, bias (or null), residual (or
// null) -> y. dgrad: dy, w -> dx. wgrad: x, dy -> dw. workspace as the plan sized it.
struct ConvArgs {
  DType dtype = DType::kBF16;
  int activation = kConvNoActivation;  // fprop only
  const void* x = nullptr;
  const void* w = nullptr;
  const void* bias = nullptr;
  const void* residual = nullptr;
  const void* dy = nullptr;
  void* y = nullptr;
  void* dx = nullptr;
  void* dw = nullptr;
  void* workspace = nullptr;
  int64_t workspace_bytes = 0;
};

}  // namespace jax_dnn
