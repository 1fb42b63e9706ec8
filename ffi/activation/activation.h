// Elementwise activations and the fused bias + activation, forward and backward.
//
//   activation:  y = act(x)                 dx = dy * act'(x)
//   bias_act:    y = act(x + bias)          dx = dy * act'(x + bias),
//                                           dbias = sum over rows of dx
//
// x, y, dy, dx are T (fp32/bf16/fp16) viewed as [rows, width]; bias is fp32
// [param_sets, width] (row r uses set r / (rows / param_sets)); math in fp32.
// dbias uses per-block partials [param_sets, parts, 1, width] reduced in a fixed
// order by ffi/common/column_sum.cu: deterministic.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "ffi/activation/activation_plan.h"
#include "ffi/common/dtype.h"

namespace jax_dnn {

// The numbering is the FFI attribute `activation`; keep jax_dnn/_src/activation.py in sync.
enum class Activation : int {
  kRelu = 0,
  kGelu = 1,      // exact: x * Phi(x)
  kGeluTanh = 2,  // tanh approximation
  kSilu = 3,
  kSigmoid = 4,
  kTanh = 5,
};
constexpr int kNumActivations = 6;

struct ActivationFwdParams {
  DType dtype;
  Activation activation;
  const void* x;      // [rows, width]
  const float* bias;  // [param_sets, width], or null for a plain activation
  void* y;            // [rows, width]
  int64_t rows;
  int64_t width;
  int64_t param_sets;
};

struct ActivationBwdParams {
  DType dtype;
  Activation activation;
  const void* dy;     // [rows, width]
  const void* x;      // [rows, width]
  const float* bias;  // [param_sets, width], or null
  void* dx;           // [rows, width]
  float* partials;    // [param_sets, parts, 1, width] workspace when bias is given (BiasActBwdParts)
  float* dbias;       // [param_sets, width] when bias is given
  int64_t rows;
  int64_t width;
  int64_t param_sets;
  int64_t parts;
};

cudaError_t LaunchActivationFwd(const ActivationFwdParams& p, cudaStream_t stream);
cudaError_t LaunchActivationBwd(const ActivationBwdParams& p, cudaStream_t stream);

}  // namespace jax_dnn
