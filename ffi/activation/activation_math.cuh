// The activations and their derivatives as device functions, fp32:
// Act<kAct>(x) and ActGrad<kAct>(x) for each Activation (activation.h), shared
// by the kernels that fuse an activation (activation.cu, batch_norm, group_norm).
#pragma once

#include <cmath>

#include "ffi/activation/activation.h"
#include "ffi/common/device.cuh"

namespace jax_dnn {

constexpr float kSqrtHalf = 0.70710678118654752f;
constexpr float kInvSqrt2Pi = 0.39894228040143268f;
constexpr float kTanhCoef = 0.79788456080286536f;  // sqrt(2 / pi)
constexpr float kCubic = 0.044715f;
constexpr float kLog2e = 1.4426950408889634f;

// The tanh GELU's 0.5 (1 + tanh(u)), u = sqrt(2 / pi) (x + 0.044715 x^3),
// is sigmoid(2u) = 1 / (1 + e) with e = exp(-2u) = 2^(-2u log2 e): one
// MUFU.EX2 and one MUFU.RCP (relative error ~2^-22 and ~1 ulp) and a few
// FMA-pipe instructions, where tanhf is ~24 instructions (both of its
// branches, then a select), which left the bf16 GELU close to
// instruction-bound. It also avoids the cancellation in 1 + tanh(u) for
// negative x (at x = -5, 1 + tanh(u) = 9.2e-8, so one ulp of tanh near -1,
// 6e-8, is 65% of the result). Large negative x: e overflows to inf and the
// sigmoid is 0.
// H200 A/B against tanhf (time new / old, bf16, 3 rounds): bias + GELU
// forward 0.887 at 16384 x 1024, 0.983 at x 4096, 0.968 at x 8192; its
// backward 0.96-0.97; GELU backward 0.95-1.00; GELU forward 0.96 at 1024
// wide, 1.007-1.015 at 4096-8192 (memory-bound there); fp32 0.99-1.00.
__device__ __forceinline__ float GeluTanhExp(float x) {
  constexpr float kZ1 = -2.f * kTanhCoef * kLog2e;
  constexpr float kZ3 = kZ1 * kCubic;
  return FastExp2(x * fmaf(kZ3, x * x, kZ1));
}

// exp(-x) for the sigmoid 1 / (1 + exp(-x)) of SiLU and sigmoid, one
// MUFU.EX2, then one MUFU.RCP for the reciprocal, where expf and IEEE
// division took ~20 instructions and a slow-path branch. With it SiLU and
// sigmoid also take the column forward's 40-register bound and the
// backward's two-row loop (64 registers at 16-byte units; on the scalar
// path 45-48, not timed).
// H200 A/B (time new / old, 3 rounds, 16384 x 1024 / x 4096 bf16): bias +
// SiLU fwd 0.886 / 0.900, bwd 0.896 / 0.895; SiLU fwd 0.961 / 1.003, bwd
// 0.921 / 0.994; sigmoid fwd 0.923 / 0.983, bwd 0.925 / 0.982; fp32 x 4096
// 0.97-1.01.
__device__ __forceinline__ float ExpNeg(float x) { return FastExp2(-kLog2e * x); }

// sigmoid(z) = 1 / (1 + e) from e = exp(-z), and its derivative s (1 - s),
// with 1 - s taken as e s: accurate where s rounds near 1 (1 - s would
// cancel); where e = inf, e s is NaN and fminf gives 1 - s = 1.
struct SigmoidOfExp {
  float s, ds;
  __device__ __forceinline__ explicit SigmoidOfExp(float e)
      : s(FastRcp(1.f + e)), ds(s * fminf(e * s, 1.f)) {}
};

template <Activation kAct>
__device__ __forceinline__ float Act(float x) {
  if constexpr (kAct == Activation::kRelu) return Relu(x);
  if constexpr (kAct == Activation::kGelu) return 0.5f * x * (1.f + erff(x * kSqrtHalf));
  if constexpr (kAct == Activation::kGeluTanh) return x * SigmoidOfExp(GeluTanhExp(x)).s;
  if constexpr (kAct == Activation::kSilu) return x * SigmoidOfExp(ExpNeg(x)).s;
  if constexpr (kAct == Activation::kSigmoid) return SigmoidOfExp(ExpNeg(x)).s;
  if constexpr (kAct == Activation::kTanh) return tanhf(x);
}

// d act / dx. relu'(0) = 0, as in jax.nn.relu.
template <Activation kAct>
__device__ __forceinline__ float ActGrad(float x) {
  if constexpr (kAct == Activation::kRelu) return x > 0.f ? 1.f : 0.f;
  if constexpr (kAct == Activation::kGelu)
    return 0.5f * (1.f + erff(x * kSqrtHalf)) + x * kInvSqrt2Pi * expf(-0.5f * x * x);
  if constexpr (kAct == Activation::kGeluTanh) {
    // d/dx x s = s + 2 x s (1 - s) u', s = sigmoid(2u), u' = k (1 + 3c x^2).
    // Past |x| ~ 10, s (1 - s) is 0: x ds first and x^2 capped keep 0 * inf
    // out for finite x up to fp32's largest (x^2 overflows past 1.8e19).
    const SigmoidOfExp g(GeluTanhExp(x));
    return fmaf(2.f * kTanhCoef * (x * g.ds), fmaf(3.f * kCubic, fminf(x * x, 1e30f), 1.f), g.s);
  }
  if constexpr (kAct == Activation::kSilu) {  // s (1 + x (1 - s))
    const SigmoidOfExp g(ExpNeg(x));
    return fmaf(x, g.ds, g.s);
  }
  if constexpr (kAct == Activation::kSigmoid) return SigmoidOfExp(ExpNeg(x)).ds;
  if constexpr (kAct == Activation::kTanh) {
    const float t = tanhf(x);
    return 1.f - t * t;
  }
}

}  // namespace jax_dnn
